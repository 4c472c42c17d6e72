"""The BlobStore contract suite: the store interface's methods, tested directly.

Every in-tree store passes it; a third-party store subclasses it and says how
to make a fresh, empty checkpoint location::

    from distckpt.testing.blob_store_suite import BlobStoreSuite

    class TestMyBlobStore(BlobStoreSuite):
        def make_store(self, tmp_path, name):
            return MyStore(f"{tmp_path}/{name}")

Parts of the interface a store declares it does not implement (its
``capabilities``, see :mod:`distckpt.engine.blobs`) are skipped. The storage
suite (:mod:`.storage_suite`) then tests the same store through save and load,
and the crash model (:mod:`.crash_model`) under processes killed mid-save.
"""

from __future__ import annotations

import uuid
from typing import Optional

import pytest

from ..engine.blobs import LEASES, MAPS, REFERENCES, RUNS, BlobStore
from ..errors import CheckpointError, CheckpointNotFoundError
from ..format import METADATA_FILE
from ..format.codec import encode_metadata
from ..format.datafile import build_header
from ..format.records import FileInfo, FileStorageData
from ..metadata import Metadata, StorageMeta

__all__ = ["BlobStoreSuite"]


def _save_id() -> str:
    return uuid.uuid4().hex


def _write(store: BlobStore, name: str, data: bytes) -> None:
    w = store.create(name)
    half = len(data) // 2
    w.pwrite(memoryview(data[:half]), 0)
    w.pwritev([memoryview(data[half:half + 3]), memoryview(data[half + 3:])], half)
    w.close(True)


class BlobStoreSuite:
    """What every BlobStore must do. Subclass and implement ``make_store``."""

    def make_store(self, tmp_path, name: str) -> BlobStore:
        raise NotImplementedError

    def store(self, tmp_path, name: str = "ck") -> BlobStore:
        store = self.make_store(tmp_path, name)
        store.prepare()
        return store

    def needs(self, store: BlobStore, capability: str) -> None:
        if capability not in store.capabilities:
            pytest.skip(f"{type(store).__name__} does not declare {capability!r}")

    def commit_one(self, store: BlobStore, payload: bytes = b"payload", overwrite: bool = False,
                   save_id: Optional[str] = None) -> str:
        """A save as the storage layer makes one: a data blob and the metadata in staging, then commit."""
        save_id = save_id or _save_id()
        staging = store.staging(save_id)
        staging.prepare()
        _write(staging, "data-00000.safetensors", payload)
        files = {"data-00000.safetensors": FileInfo(len(payload), 0, 0)}
        document = encode_metadata(Metadata({}, storage_data=FileStorageData(save_id, files), storage_meta=StorageMeta(save_id=save_id)))
        staging.put_atomic(METADATA_FILE, document, True)
        store.commit(staging, overwrite, True)
        return save_id

    # ------------------------------------------------------------ blobs

    def test_written_bytes_read_back_by_every_read_method(self, tmp_path):
        staging = self.store(tmp_path).staging(_save_id())
        staging.prepare()
        data = bytes(range(256)) * 40
        _write(staging, "a", data)
        r = staging.open("a")
        try:
            assert r.size == len(data)
            assert r.pread(100, 7) == data[7:107]
            buf = bytearray(50)
            assert r.readinto(memoryview(buf), 1000) == 50 and bytes(buf) == data[1000:1050]
            views = [memoryview(bytearray(10)), memoryview(bytearray(20))]
            assert r.readv(views, 5) == 30 and bytes(views[0]) + bytes(views[1]) == data[5:35]
            cached = r.readv_cached([memoryview(bytearray(10))], 0)
            assert cached is None or 0 <= cached <= 10
            tail = bytearray(100)
            assert r.readinto(memoryview(tail), len(data) - 40) == 40  # short only at the end of the blob
        finally:
            r.close()
        assert staging.sizes()["a"] == len(data) and "a" in set(staging.list())

    def test_an_aborted_blob_goes_with_its_discarded_save(self, tmp_path):
        store = self.store(tmp_path)
        staging = store.staging(_save_id())
        staging.prepare()
        w = staging.create("gone")
        w.pwrite(memoryview(b"partial"), 0)
        w.abort()
        store.discard(staging)
        assert store.incomplete_saves() == [] and not store.is_committed()

    def test_opening_a_missing_blob_is_not_found(self, tmp_path):
        store = self.store(tmp_path)
        with pytest.raises(CheckpointNotFoundError):
            store.open("nothing-here")

    def test_put_atomic_exists_and_describe(self, tmp_path):
        store = self.store(tmp_path)
        assert not store.exists("small")
        store.put_atomic("small", b"whole", True)
        assert store.exists("small") and store.open("small").pread(5, 0) == b"whole"
        assert "small" in store.describe("small")

    # ------------------------------------------------------------ commit

    def test_commit_publishes_the_staging_store_at_once(self, tmp_path):
        store = self.store(tmp_path)
        assert not store.is_committed()
        save_id = self.commit_one(store, b"first")
        assert store.is_committed()
        assert store.data_store(save_id).open("data-00000.safetensors").pread(5, 0) == b"first"
        assert store.incomplete_saves() == []

    def test_a_second_commit_fails_without_overwrite_and_keeps_the_first(self, tmp_path):
        store = self.store(tmp_path)
        first = self.commit_one(store, b"first")
        with pytest.raises(CheckpointError):
            self.commit_one(store, b"other")
        assert store.data_store(first).open("data-00000.safetensors").pread(5, 0) == b"first"

    def test_an_overwriting_commit_replaces_whole(self, tmp_path):
        store = self.store(tmp_path)
        self.commit_one(store, b"first")
        store.check_replaceable()
        second = self.commit_one(store, b"again", overwrite=True)
        assert store.is_committed()
        assert store.data_store(second).open("data-00000.safetensors").pread(5, 0) == b"again"

    def test_an_uncommitted_save_is_listed_until_discarded(self, tmp_path):
        store = self.store(tmp_path)
        staging = store.staging(_save_id())
        staging.prepare()
        _write(staging, "data-00000.safetensors", b"partial")
        assert len(store.incomplete_saves()) == 1 and not store.is_committed()
        store.discard(staging)
        assert store.incomplete_saves() == []

    # ------------------------------------------------------------ declared parts

    def test_runs_of_checkpoints(self, tmp_path):
        parent = self.store(tmp_path, "run")
        self.needs(parent, RUNS)
        child = parent.child("step-1")
        child.prepare()
        self.commit_one(child)
        assert "step-1" in parent.children() and parent.child("step-1").is_committed()
        parent.child("step-1").remove()
        assert not parent.child("step-1").is_committed()
        assert parent.remove_incomplete_below("step-") == []

    def test_references_between_the_checkpoints_of_a_run(self, tmp_path):
        """A retired checkpoint's kept blobs stay readable through a sibling's ``referenced``, until cleanup is told
        nothing references them."""
        parent = self.store(tmp_path, "run")
        self.needs(parent, REFERENCES)
        save_id = _save_id()
        payload = build_header([], save_id, 0)[0] + b"the chunk bytes"  # a data file whose header names its save
        step = parent.child("step-1")
        step.prepare()
        self.commit_one(step, payload, save_id=save_id)
        sibling = parent.child("step-2")
        assert sibling.parent() is not None and sibling.parent().describe() == parent.describe()
        assert sibling.referenced("step-1", save_id).open("data-00000.safetensors").pread(len(payload), 0) == payload
        step.retire(save_id, {"data-00000.safetensors"})
        assert not parent.child("step-1").is_committed()
        assert sibling.referenced("step-1", save_id).open("data-00000.safetensors").pread(len(payload), 0) == payload
        parent.remove_incomplete_below("step-", {("step-1", save_id): {"data-00000.safetensors"}})
        assert sibling.referenced("step-1", save_id).open("data-00000.safetensors").pread(len(payload), 0) == payload
        parent.remove_incomplete_below("step-")  # told nothing: a retired checkpoint is left alone
        assert sibling.referenced("step-1", save_id).open("data-00000.safetensors").size == len(payload)
        parent.remove_incomplete_below("step-", {})
        with pytest.raises(CheckpointNotFoundError):
            sibling.referenced("step-1", save_id).open("data-00000.safetensors")

    def test_mapped_blobs(self, tmp_path):
        store = self.store(tmp_path)
        self.needs(store, MAPS)
        store.prepare()
        _write(store, "blob", b"0123456789")
        mapped = store.map("blob", 10)
        assert bytes(mapped[:]) == b"0123456789"
        mapped[0:1] = b"x"  # private: the blob itself never changes
        reader = store.open("blob")
        assert reader.pread(10, 0) == b"0123456789"
        reader.close()
        with pytest.raises(CheckpointError):
            store.map("blob", 11)  # not the size the metadata records
        with pytest.raises(CheckpointError):
            store.map("missing", 1)

    def test_leases(self, tmp_path):
        store = self.store(tmp_path)
        self.needs(store, LEASES)
        save_id = _save_id()
        assert store.read_lease(save_id) is None
        store.put_lease(save_id, b"holder")
        with pytest.raises(CheckpointError):
            store.put_lease(save_id, b"another holder")
        record, age = store.read_lease(save_id)
        assert record == b"holder" and (age is None or age >= 0)
        store.renew_lease(save_id)
        other = _save_id()
        store.put_lease(other, b"holder")
        assert store.lease_ids() == sorted([save_id, other])
        store.drop_lease(save_id)
        store.drop_lease(other)
        assert store.read_lease(save_id) is None and store.lease_ids() == []
        store.drop_lease(save_id)  # gone already: no error
