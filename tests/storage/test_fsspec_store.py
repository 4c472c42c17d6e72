"""Any fsspec URL as a store, for schemes distckpt has none of its own for: an fsspec filesystem registered under a
scheme of the test's own (fsspec's in-memory filesystem) is saved to and loaded from by ``checkpoint_id``, passes
the blob-store contract suite and the storage suite, keeps a run (retention, incremental references, compaction)
with nothing left behind, warns once that its commit is not atomic, and refuses what it cannot do typed."""

from __future__ import annotations

import uuid
import warnings

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

import distckpt
from distckpt import backends
from distckpt.backends import fsspec_store
from distckpt.testing.blob_store_suite import BlobStoreSuite
from distckpt.testing.storage_suite import StorageSuite

SCHEME = "fsmemtest"


class _TestFileSystem(MemoryFileSystem):
    protocol = SCHEME
    store: dict = {}  # its own files, apart from other tests' use of fsspec's memory filesystem
    pseudo_dirs = [""]
    opened_with: list = []  # the storage options of each instance made

    def __init__(self, *args, **storage_options):
        super().__init__(*args, **storage_options)
        type(self).opened_with.append(storage_options)


fsspec.register_implementation(SCHEME, _TestFileSystem, clobber=True)


def _files(prefix: str) -> list[str]:
    return sorted(k.lstrip("/")[len(prefix):] for k in _TestFileSystem.store if k.lstrip("/").startswith(prefix))


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*no conditional create.*")
        yield


def test_save_and_load_by_an_fsspec_url_and_the_warning_once(recwarn):
    fsspec_store._WARNED.discard(SCHEME)
    sd = {"w": torch.randn(7, 3), "b": torch.arange(5), "step": 12}
    cid = f"{SCHEME}://bucket/{uuid.uuid4().hex}"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        distckpt.save(sd, checkpoint_id=cid, no_dist=True)
        distckpt.save(sd, checkpoint_id=cid + "-2", no_dist=True)
    assert [str(w.message) for w in seen if "conditional create" in str(w.message)].__len__() == 1
    out = {"w": torch.zeros(7, 3), "b": torch.zeros(5, dtype=torch.int64), "step": 0}
    distckpt.load(out, checkpoint_id=cid, no_dist=True)
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"]) and out["step"] == 12
    assert distckpt.verify(cid).ok
    assert isinstance(backends.writer_for(cid), fsspec_store.FsspecWriter)
    with pytest.raises(distckpt.CheckpointError, match="overwrite"):  # committed: not replaced without overwrite
        distckpt.save(sd, checkpoint_id=cid, no_dist=True)


def test_the_writer_takes_storage_options_as_dcps_does():
    cid, token = f"{SCHEME}://bucket/{uuid.uuid4().hex}", uuid.uuid4().hex
    distckpt.save({"w": torch.ones(2)}, storage_writer=fsspec_store.FsspecWriter(cid, token=token), no_dist=True)
    assert {"token": token} in _TestFileSystem.opened_with
    out = {"w": torch.zeros(2)}
    distckpt.load(out, storage_reader=fsspec_store.FsspecReader(cid, token=token), no_dist=True)
    assert torch.equal(out["w"], torch.ones(2))


def test_storage_options_by_knob_and_a_bad_knob(monkeypatch):
    token = uuid.uuid4().hex
    monkeypatch.setenv("DISTCKPT_FSSPEC_OPTIONS", '{"token": "%s"}' % token)
    distckpt.save({"w": torch.ones(2)}, checkpoint_id=f"{SCHEME}://bucket/{token}", no_dist=True)
    assert {"token": token} in _TestFileSystem.opened_with
    monkeypatch.setenv("DISTCKPT_FSSPEC_OPTIONS", "[1]")
    with pytest.raises(distckpt.CheckpointError, match="JSON object"):
        distckpt.save({"w": torch.ones(2)}, checkpoint_id=f"{SCHEME}://bucket/{token}-2", no_dist=True)


def test_a_scheme_neither_distckpt_nor_fsspec_knows_is_a_clear_error():
    with pytest.raises(distckpt.CheckpointError, match="register_store"):
        distckpt.save({"w": torch.ones(1)}, checkpoint_id="nowhere-at-all://x", no_dist=True)


def test_the_local_disk_through_fsspec_is_refused_for_the_disk_store(tmp_path):
    with pytest.raises(distckpt.CheckpointError, match="pass the path itself"):
        distckpt.save({"w": torch.ones(1)}, checkpoint_id=f"local://{tmp_path}/ck", no_dist=True)
    assert not (tmp_path / "ck").exists()


def test_a_run_keeps_what_its_steps_reference_and_nothing_else():
    from tests.crash.test_incremental_machine import incremental_state, stray_keys

    root = f"{SCHEME}://bucket/run-{uuid.uuid4().hex[:8]}"
    mgr = distckpt.CheckpointManager(root, keep_last=2, incremental=True)
    for step in (1, 2, 3, 4):
        mgr.save(step, incremental_state(step))
    assert mgr.all_steps() == [3, 4]
    prefix = root[len(SCHEME) + 3:] + "/"
    assert stray_keys(_files(prefix), mgr) == []
    mgr.compact(4)
    mgr.delete(3)
    assert stray_keys(_files(prefix), mgr) == []
    want = incremental_state(4)
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in want.items()}
    mgr.load(out, step=4)
    assert all(torch.equal(out[k], v) if isinstance(v, torch.Tensor) else out[k] == v for k, v in want.items())


class TestFsspecBlobStore(BlobStoreSuite):
    def make_store(self, tmp_path, name):
        return fsspec_store.FsspecStore(f"{SCHEME}://bucket/{tmp_path.name}/{name}")


class TestFsspecStorage(StorageSuite):
    def checkpoint_id(self, tmp_path, name):
        return f"{SCHEME}://bucket/{tmp_path.name}/{name}"
