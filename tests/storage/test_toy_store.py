"""A new store is one class and one registration: a toy store of bytes in a dict, saved to and loaded from by
``checkpoint_id="toy://..."``, passing the blob-store contract suite and the storage suite."""

import threading
import uuid

import pytest
import torch

import distckpt
from distckpt.backends import BlobStore, BufferedWriter, BytesReader, register_store, unregister_store
from distckpt.errors import CheckpointError, CheckpointNotFoundError
from distckpt.testing.blob_store_suite import BlobStoreSuite
from distckpt.testing.storage_suite import StorageSuite

BLOBS: dict[str, dict[str, bytes]] = {}  # location -> blob name -> bytes
LOCK = threading.Lock()


class ToyStore(BlobStore):
    """Blobs as bytes in a dict, under one location name; a save's staging area is a location of its own."""

    def __init__(self, where: str):
        self.where = where

    def _blobs(self) -> dict[str, bytes]:
        with LOCK:
            return BLOBS.setdefault(self.where, {})

    def create(self, name, buffer_bytes=None):
        return BufferedWriter(lambda data, sync: self._blobs().__setitem__(name, data), name)

    def open(self, name):
        blob = BLOBS.get(self.where, {}).get(name)
        if blob is None:
            raise CheckpointNotFoundError(f"{self.where}/{name} does not exist")
        return BytesReader(blob)

    def list(self):
        return sorted(BLOBS.get(self.where, {}))

    def staging(self, save_id):
        return ToyStore(f"{self.where}#{save_id}")

    def commit(self, staging, overwrite, sync):
        with LOCK:
            if not overwrite and "metadata.json" in BLOBS.get(self.where, {}):
                BLOBS.pop(staging.where, None)
                raise CheckpointError(f"{self.where} is committed already")
            BLOBS[self.where] = BLOBS.pop(staging.where, {})

    def discard(self, staging):
        BLOBS.pop(staging.where, None)

    def incomplete_saves(self):
        return sorted(w for w in BLOBS if w.startswith(self.where + "#"))


@pytest.fixture(autouse=True)
def toy_scheme():
    register_store("toy", ToyStore)
    yield
    unregister_store("toy")


def test_save_and_load_through_the_scheme():
    sd = {"w": torch.randn(7, 3), "b": torch.arange(5), "step": 12, "nested": {"lr": 0.1}}
    cid = f"toy://{uuid.uuid4().hex}"
    distckpt.save(sd, checkpoint_id=cid)
    assert "metadata.json" in BLOBS[cid]
    out = {"w": torch.zeros(7, 3), "b": torch.zeros(5, dtype=torch.int64), "step": 0, "nested": {"lr": 0.0}}
    distckpt.load(out, checkpoint_id=cid)
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"])
    assert out["step"] == 12 and out["nested"] == {"lr": 0.1}
    assert distckpt.verify(cid).ok
    assert distckpt.read_metadata(cid).state_dict_metadata["w"].size == torch.Size([7, 3])


def test_an_unregistered_scheme_is_a_clear_error():
    with pytest.raises(CheckpointError, match="register_store"):
        distckpt.save({"w": torch.ones(1)}, checkpoint_id="nowhere://x")


class TestToyBlobStore(BlobStoreSuite):
    def make_store(self, tmp_path, name):
        return ToyStore(f"toy://{tmp_path.name}/{name}")


class TestToyStorage(StorageSuite):
    def checkpoint_id(self, tmp_path, name):
        return f"toy://{tmp_path.name}/{name}"
