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


class _TornFileSystem(MemoryFileSystem):
    """fsspec's memory filesystem whose writes of a step's metadata, when ``tear`` is set, stop half-way (a dropped
    upload on sftp, hdfs, ftp, where a write is not atomic)."""

    protocol = "fstorn"
    store: dict = {}
    pseudo_dirs = [""]
    tear = False

    def pipe_file(self, path, value, **kwargs):
        if type(self).tear and "/step-1/metadata.json" in path:
            with self.open(path, "wb") as f:
                f.write(value[: len(value) // 2])
            raise ConnectionResetError("connection lost mid-upload")
        return super().pipe_file(path, value, **kwargs)


fsspec.register_implementation("fstorn", _TornFileSystem, clobber=True)


def test_an_overwrite_whose_metadata_write_is_cut_short_keeps_the_old_checkpoint():
    cid = f"fstorn://bucket/{uuid.uuid4().hex[:8]}/step-1"
    distckpt.save({"w": torch.ones(4)}, checkpoint_id=cid, no_dist=True)
    _TornFileSystem.tear = True
    try:
        with pytest.raises(distckpt.CheckpointError):
            distckpt.save({"w": torch.full((4,), 2.0)}, checkpoint_id=cid, no_dist=True, overwrite=True)
    finally:
        _TornFileSystem.tear = False
    out = {"w": torch.zeros(4)}
    distckpt.load(out, checkpoint_id=cid, no_dist=True)  # the old checkpoint, whole
    assert torch.equal(out["w"], torch.ones(4))


@pytest.fixture
def ftp_server(tmp_path, monkeypatch):
    """pyftpdlib on loopback: a filesystem of real directories, absolute paths and listings fsspec caches, that makes
    no parent directory itself (as real FTP servers do not)."""
    import logging
    import socket
    import threading

    ftpd = pytest.importorskip("pyftpdlib")  # noqa: F841 - a test dependency (pyproject's test extra)
    from pyftpdlib.authorizers import DummyAuthorizer
    from pyftpdlib.handlers import FTPHandler
    from pyftpdlib.servers import FTPServer

    logging.getLogger("pyftpdlib").setLevel(logging.ERROR)
    auth = DummyAuthorizer()
    auth.add_user("alice", "pw", str(tmp_path), perm="elradfmwMT")
    handler = type("Handler", (FTPHandler,), {"authorizer": auth})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = FTPServer(("127.0.0.1", port), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"timeout": 0.1}, daemon=True)
    thread.start()
    monkeypatch.setenv("DISTCKPT_FSSPEC_OPTIONS", '{"username": "alice", "password": "pw"}')
    yield f"ftp://127.0.0.1:{port}", tmp_path
    server.close_all()


def test_a_run_on_an_ftp_server_keeps_its_policy_and_nothing_else(ftp_server):
    url, root = ftp_server
    mgr = distckpt.CheckpointManager(f"{url}/data/run", keep_last=1, no_dist=True)
    for step in (1, 2, 3):
        mgr.save(step, {"w": torch.full((3,), float(step))})
    assert mgr.all_steps() == [3]
    out = {"w": torch.zeros(3)}
    assert mgr.load(out) == 3 and torch.equal(out["w"], torch.full((3,), 3.0))
    left = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert [p for p in left if "step-0000000003" not in p] == [] and not any("tmp" in p for p in left), left


class _NoRanges(MemoryFileSystem):
    """A filesystem whose server ignores ranges (an http server without Range support): every read is whole."""

    protocol = "fsnorange"
    store: dict = {}
    pseudo_dirs = [""]

    def cat_file(self, path, start=None, end=None, **kwargs):
        return super().cat_file(path, **kwargs)


fsspec.register_implementation("fsnorange", _NoRanges, clobber=True)


def test_a_server_that_ignores_ranges_is_a_typed_error_naming_the_object():
    cid = f"fsnorange://bucket/{uuid.uuid4().hex[:8]}"
    distckpt.save({"a": torch.ones(64), "b": torch.ones(64)}, checkpoint_id=cid, no_dist=True)
    with pytest.raises(distckpt.StorageIOError, match="ignores ranges") as raised:
        distckpt.load({"a": torch.zeros(64), "b": torch.zeros(64)}, checkpoint_id=cid, no_dist=True)
    assert "data-" in str(raised.value)
