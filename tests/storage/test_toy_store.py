"""A new store is one class and one registration: a toy store of bytes in a dict, saved to and loaded from by
``checkpoint_id="toy://..."``, passing the blob-store contract suite and the storage suite. A new object store is
one client of primitives: ``toyobj://`` gets commits, overwrites, runs, incremental references, retention,
leases and cleanup from :class:`~distckpt.backends.ObjectStore`, and passes the whole contract suite."""

import threading
import uuid

import pytest
import torch

import distckpt
from distckpt.backends import (
    BlobStore,
    BufferedWriter,
    BytesReader,
    ObjectClient,
    ObjectInfo,
    ObjectStore,
    register_store,
    unregister_store,
)
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


OBJECTS: dict[str, tuple] = {}  # key -> (bytes, tag, version)
VERSIONS = iter(range(1, 1 << 62))


class _VersionReader(BytesReader):
    def __init__(self, data, version):
        super().__init__(data)
        self.version = version

    def identity(self):
        return ("toy", self.version)


class ToyObjects(ObjectClient):
    """The required primitives only, over a dict: no uploads, no ages."""

    def url(self, key):
        return f"toyobj://{key}"

    def put(self, key, data, *, if_absent=False, tag=None):
        with LOCK:
            if if_absent and key in OBJECTS:
                return False
            OBJECTS[key] = (bytes(data), tag, next(VERSIONS))
        return True

    def get(self, key, limit=None):
        found = OBJECTS.get(key)
        return None if found is None else found[0][:limit]

    def head(self, key):
        found = OBJECTS.get(key)
        return None if found is None else ObjectInfo(key, len(found[0]), tag=found[1])

    def list(self, prefix, delimiter=False):
        out = {}
        for key in [k for k in list(OBJECTS) if k.startswith(prefix)]:
            rest = key[len(prefix):]
            if delimiter and "/" in rest:
                out[prefix + rest.split("/", 1)[0] + "/"] = ObjectInfo(prefix + rest.split("/", 1)[0] + "/")
            elif key in OBJECTS:
                out[key] = ObjectInfo(key, len(OBJECTS[key][0]))
        return [out[k] for k in sorted(out)]

    def delete(self, keys):
        with LOCK:
            for key in keys:
                OBJECTS.pop(key, None)

    def touch(self, key):
        if key not in OBJECTS:
            raise CheckpointNotFoundError(f"{self.url(key)} does not exist")

    def writer(self, key, buffer_bytes=None):
        return BufferedWriter(lambda data, sync: self.put(key, data), self.url(key))

    def reader(self, key, missing):
        found = OBJECTS.get(key)
        if found is None:
            raise missing(None)
        return _VersionReader(found[0], found[2])


def toy_object_store(checkpoint_id):
    return ObjectStore(ToyObjects(), str(checkpoint_id)[len("toyobj://"):])


@pytest.fixture(autouse=True)
def toy_scheme():
    register_store("toy", ToyStore)
    register_store("toyobj", toy_object_store)
    yield
    unregister_store("toy")
    unregister_store("toyobj")


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


class TestToyObjectStore(BlobStoreSuite):
    def make_store(self, tmp_path, name):
        return toy_object_store(f"toyobj://{tmp_path.name}/{name}")


class TestToyObjectStorage(StorageSuite):
    def checkpoint_id(self, tmp_path, name):
        return f"toyobj://{tmp_path.name}/{name}"


def test_the_run_lifecycle_on_a_client_of_primitives():
    """tests/security/test_run_lifecycle_hostile.py's checks (an overwrite in an incremental run, retention after each
    way of writing a document again, a header written again), then retention and compaction leave only what kept
    steps reference."""
    from distckpt.testing import rewritten
    from tests.crash.test_incremental_machine import incremental_state, stray_keys
    from tests.security import test_run_lifecycle_hostile as lifecycle

    tag = uuid.uuid4().hex[:8]
    lifecycle.overwrite_a_step_of_an_incremental_run(f"toyobj://over-{tag}")
    for name, rewrite in sorted(rewritten.REWRITES.items()):
        lifecycle.retention_after_a_rewrite(f"toyobj://life-{name}-{tag}", rewrite)
    lifecycle.a_reserialised_header_is_still_its_save(f"toyobj://header-{tag}")
    root = f"toyobj://run-{tag}"
    mgr = distckpt.CheckpointManager(root, keep_last=2, incremental=True)
    for step in (1, 2, 3, 4):
        mgr.save(step, incremental_state(step))
    prefix = root[len("toyobj://"):] + "/"
    assert mgr.all_steps() == [3, 4]
    assert any(n.startswith("step-0000000001/") for n in distckpt.read_metadata(mgr.path(4)).storage_data.files)
    assert stray_keys([k[len(prefix):] for k in OBJECTS if k.startswith(prefix)], mgr) == []
    mgr.compact(4)
    mgr.delete(3)
    assert stray_keys([k[len(prefix):] for k in OBJECTS if k.startswith(prefix)], mgr) == []
    assert not any(k.startswith(prefix + "step-0000000001/") for k in OBJECTS)
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in incremental_state(4).items()}
    mgr.load(out, step=4)
    assert all(torch.equal(out[k], v) if isinstance(v, torch.Tensor) else out[k] == v for k, v in incremental_state(4).items())
    assert distckpt.verify(mgr.path(4)).ok
