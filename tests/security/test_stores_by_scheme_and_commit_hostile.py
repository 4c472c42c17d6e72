"""Hostile review of issue 46's surfaces: stores registered by scheme (register_store, store_for, BlobStorageWriter and
BlobStorageReader by id, reset, pick_storage, overwrite=), the one commit home with a chunk codec on the columnar path
(multi-rank, results in mixed forms, corrupt chunks, files removed before commit, the frames' decoders), and the split
of process state and async saving (fork during an async save, release_buffers).

The defects the review found are fixed; each test failed before its fix."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import numpy as np
import pytest
import torch

import distckpt
from distckpt.async_saving import release_buffers
from distckpt.backends import (
    BlobStorageReader,
    BlobStorageWriter,
    BlobStore,
    BufferedWriter,
    BytesReader,
    FileSystemReader,
    FileSystemWriter,
    register_store,
    schemes,
    store_for,
    unregister_store,
)
from distckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from distckpt.planner import SavePlan
from distckpt.planning import DefaultLoadPlanner, DefaultSavePlanner
from distckpt.testing import run_ranks
from distckpt.wire.columns import KEEP_MAGIC, PLAN_MAGIC, RESULTS_MAGIC
from distckpt.wire.frames import encode_frame, pack_json
from distckpt.wire.save_messages import decode_plan, decode_reply, decode_results

from . import stores_by_scheme_workers as w

# ------------------------------------------------------------------ a toy store, as docs/stores.md builds one

_BLOBS: dict[str, dict[str, bytes]] = {}
_LOCK = threading.Lock()


class DictStore(BlobStore):
    """Blobs in a dict under one location (tests/storage/test_toy_store.py's store)."""

    def __init__(self, where: str):
        self.where = where

    def _blobs(self) -> dict[str, bytes]:
        with _LOCK:
            return _BLOBS.setdefault(self.where, {})

    def create(self, name, buffer_bytes=None):
        return BufferedWriter(lambda data, sync: self._blobs().__setitem__(name, data), name)

    def open(self, name):
        blob = _BLOBS.get(self.where, {}).get(name)
        if blob is None:
            raise CheckpointNotFoundError(f"{self.where}/{name} does not exist")
        return BytesReader(blob)

    def list(self):
        return sorted(_BLOBS.get(self.where, {}))

    def staging(self, save_id):
        return type(self)(f"{self.where}#{save_id}")

    def commit(self, staging, overwrite, sync):
        with _LOCK:
            if not overwrite and "metadata.json" in _BLOBS.get(self.where, {}):
                _BLOBS.pop(staging.where, None)
                raise CheckpointError(f"{self.where} is committed already")
            _BLOBS[self.where] = _BLOBS.pop(staging.where, {})

    def discard(self, staging):
        _BLOBS.pop(staging.where, None)

    def incomplete_saves(self):
        return sorted(k for k in _BLOBS if k.startswith(self.where + "#"))


class HidesMetadata(DictStore):
    """A store whose list() lies: it never shows the commit."""

    def list(self):
        return [n for n in super().list() if n != "metadata.json"]


class ShowsGhosts(DictStore):
    """A store whose list() lies the other way: it shows a commit and a data file that are not there."""

    def list(self):
        return super().list() + ["metadata.json", "data-00000.safetensors"]


class ListsNone(DictStore):
    """A store whose list() breaks its contract: None instead of names."""

    def list(self):
        return None


@pytest.fixture
def scheme():
    """Register stores by scheme for one test; every scheme registered through it (built-ins too) is put back."""
    before = dict(schemes._SCHEMES)

    def register(name, factory, **kw):
        register_store(name, factory, **kw)

    yield register
    schemes._SCHEMES.clear()
    schemes._SCHEMES.update(before)


def _state(fill: float = 1.0) -> dict:
    return {"a": torch.full((16,), fill), "b": torch.arange(6, dtype=torch.int64), "step": int(fill)}


def _blank() -> dict:
    return {"a": torch.zeros(16), "b": torch.zeros(6, dtype=torch.int64), "step": 0}


# ------------------------------------------------------------------ ids that name no place, or another scheme's


@pytest.mark.parametrize("cid", ["", "file://", "."])
def test_an_id_that_names_no_directory_is_refused_and_the_working_directory_survives(tmp_path, monkeypatch, cid):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    inode = os.stat(cwd).st_ino
    with pytest.raises(CheckpointError):
        distckpt.save(_state(), checkpoint_id=cid, no_dist=True)
    assert os.getcwd() == str(cwd) and os.stat(cwd).st_ino == inode
    assert os.listdir(cwd) == [] and not [n for n in os.listdir(tmp_path) if n.startswith(".distckpt")]


@pytest.mark.parametrize("cid", ["s3:/bucket/run", "memory:/name"])
def test_a_registered_scheme_with_one_slash_is_a_typo_not_a_local_path(tmp_path, monkeypatch, cid):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="://"):
        distckpt.save(_state(), checkpoint_id=cid, no_dist=True)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("cid", ["memory://issue46-fs", "s3://bucket/prefix/step-1"])
def test_a_filesystem_writer_given_another_schemes_id_refuses_it(tmp_path, monkeypatch, cid):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=cid.split("://")[0]):
        distckpt.save(_state(), checkpoint_id=cid, storage_writer=FileSystemWriter(), no_dist=True)
    with pytest.raises(CheckpointError):
        distckpt.load(_blank(), checkpoint_id=cid, storage_reader=FileSystemReader(), no_dist=True)
    assert os.listdir(tmp_path) == []


def test_a_blob_storage_writer_follows_the_registry_when_reset_to_another_scheme(tmp_path):
    """BlobStorageWriter(path) reset to memory:// by checkpoint_id goes to the memory store, not to disk."""
    name = f"memory://issue46-{os.getpid()}-{time.monotonic_ns()}"
    distckpt.save(_state(3.0), checkpoint_id=name, storage_writer=BlobStorageWriter(str(tmp_path / "disk")), no_dist=True)
    assert not (tmp_path / "disk").exists()
    out = _blank()
    distckpt.load(out, checkpoint_id=name, no_dist=True)
    assert out["step"] == 3 and torch.equal(out["a"], torch.full((16,), 3.0))


def test_a_nul_in_a_path_is_refused_naming_the_id(tmp_path):
    cid = str(tmp_path / "a\0b")
    with pytest.raises(CheckpointError) as info:
        distckpt.save(_state(), checkpoint_id=cid, no_dist=True)
    assert "\\x00" in str(info.value) or "NUL" in str(info.value)
    assert os.listdir(tmp_path) == []


def test_a_very_long_id_fails_typed_and_leaves_nothing(tmp_path):
    cid = str(tmp_path / ("x" * 5000))
    with pytest.raises(CheckpointError):
        distckpt.save(_state(), checkpoint_id=cid, no_dist=True)
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ factories that fail or lie


def test_a_factory_that_returns_no_store_is_a_typed_error_naming_the_scheme(scheme):
    scheme("notastore", lambda cid: object())
    with pytest.raises(CheckpointError, match="notastore"):
        store_for("notastore://x")
    with pytest.raises(CheckpointError, match="notastore"):
        distckpt.verify("notastore://x")
    with pytest.raises(CheckpointError, match="notastore"):
        distckpt.read_metadata("notastore://x")
    with pytest.raises(CheckpointError, match="notastore"):
        BlobStorageWriter("notastore://x").set_up_storage_writer(True)
    with pytest.raises(CheckpointError, match="notastore"):
        distckpt.save(_state(), checkpoint_id="notastore://x", no_dist=True)


def test_a_factory_that_raises_is_a_typed_error_naming_the_id(scheme):
    def exploding(cid):
        raise ValueError("endpoint unreachable")

    scheme("boom", exploding)
    with pytest.raises(CheckpointError, match="boom://bucket/x"):
        store_for("boom://bucket/x")
    with pytest.raises(CheckpointError, match="boom://bucket/x"):
        distckpt.verify("boom://bucket/x")
    with pytest.raises(CheckpointError, match="endpoint unreachable"):
        distckpt.save(_state(), checkpoint_id="boom://bucket/x", no_dist=True)


@pytest.mark.parametrize("cls", [BlobStorageWriter, BlobStorageReader])
def test_a_storage_layer_given_neither_store_nor_id_is_a_typed_error(cls):
    with pytest.raises(CheckpointError, match="3"):
        cls(3)


def test_a_scheme_registered_twice_resolves_to_the_later_factory(scheme):
    where = f"issue46-{time.monotonic_ns()}"
    scheme("twice", lambda cid: DictStore("first:" + cid))
    scheme("twice", lambda cid: DictStore("second:" + cid))
    distckpt.save(_state(2.0), checkpoint_id=f"twice://{where}", no_dist=True)
    assert f"second:twice://{where}" in _BLOBS and f"first:twice://{where}" not in _BLOBS
    out = _blank()
    distckpt.load(out, checkpoint_id=f"twice://{where}", no_dist=True)
    assert out["step"] == 2


@pytest.mark.parametrize("bad", ["", None, "gs://", "a/b"])
def test_register_store_refuses_what_is_not_a_scheme(bad):
    with pytest.raises(CheckpointError):
        register_store(bad, DictStore)


def test_unregistering_the_file_scheme_is_a_typed_error_naming_the_fix_and_a_writer_still_works(scheme, tmp_path):
    unregister_store("file")
    with pytest.raises(CheckpointError, match="register_store") as info:
        distckpt.save(_state(), checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert str(tmp_path / "c") in str(info.value)
    distckpt.save(_state(5.0), storage_writer=FileSystemWriter(str(tmp_path / "d")), no_dist=True)
    out = _blank()
    distckpt.load(out, storage_reader=FileSystemReader(str(tmp_path / "d")), no_dist=True)
    assert out["step"] == 5


def test_a_store_whose_list_hides_the_commit_cannot_lose_the_committed_checkpoint(scheme):
    scheme("hides", HidesMetadata)
    cid = f"hides://{time.monotonic_ns()}"
    distckpt.save(_state(1.0), checkpoint_id=cid, no_dist=True)
    committed = dict(_BLOBS[cid])
    with pytest.raises(CheckpointError):
        distckpt.save(_state(2.0), checkpoint_id=cid, no_dist=True)  # the store's own commit refuses
    assert _BLOBS[cid] == committed
    with pytest.raises(CheckpointNotFoundError, match=cid):
        distckpt.verify(cid)


def test_a_store_whose_list_shows_ghosts_fails_typed(scheme):
    scheme("ghosts", ShowsGhosts)
    cid = f"ghosts://{time.monotonic_ns()}"
    with pytest.raises(CheckpointError):
        distckpt.save(_state(), checkpoint_id=cid, no_dist=True)
    with pytest.raises(CheckpointNotFoundError, match=cid):
        distckpt.read_metadata(cid)
    with pytest.raises(CheckpointNotFoundError):
        distckpt.verify(cid)


def test_a_store_whose_list_breaks_its_contract_fails_typed(scheme):
    scheme("listsnone", ListsNone)
    with pytest.raises(CheckpointError, match="(?i)listsnone"):
        distckpt.read_metadata("listsnone://x")
    with pytest.raises(CheckpointError, match="(?i)listsnone"):
        distckpt.verify("listsnone://x")


# ------------------------------------------------------------------ reset mid-life


def test_a_writer_reset_between_planning_and_writing_is_a_typed_error(tmp_path):
    writer = BlobStorageWriter(str(tmp_path / "c"))
    writer.set_up_storage_writer(True)
    plans = writer.prepare_global_plan([SavePlan([])])
    writer.reset("memory://issue46-elsewhere")
    with pytest.raises(CheckpointError):
        writer.write_data(plans[0], DefaultSavePlanner())
    assert not (tmp_path / "c").exists()


def test_a_reader_reset_between_set_up_and_read_data_is_a_typed_error(tmp_path):
    cid = str(tmp_path / "c")
    distckpt.save(_state(4.0), checkpoint_id=cid, no_dist=True)
    reader = BlobStorageReader(cid)
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, True)
    reader.reset("memory://issue46-nowhere")
    planner, out = DefaultLoadPlanner(), {"a": torch.zeros(16)}
    planner.set_up_planner(out, md, True)
    with pytest.raises(CheckpointError):
        reader.read_data(planner.create_local_plan(), planner).wait()


class _SlowSetUp(FileSystemWriter):
    """A writer whose background save takes a moment to begin (as one behind a slow mount would)."""

    def set_up_storage_writer(self, *args, **kwargs):
        time.sleep(0.4)
        return super().set_up_storage_writer(*args, **kwargs)


def test_one_writer_shared_by_two_async_saves_in_flight_commits_each_at_its_own_id(tmp_path):
    writer = _SlowSetUp()
    first = distckpt.async_save(_state(1.0), checkpoint_id=str(tmp_path / "A"), storage_writer=writer, no_dist=True,
                                max_in_flight=2)
    second = distckpt.async_save(_state(2.0), checkpoint_id=str(tmp_path / "B"), storage_writer=writer, no_dist=True,
                                 max_in_flight=2)
    outcomes = []
    for handle in (first, second):
        try:
            handle.result(timeout=20)
            outcomes.append("ok")
        except CheckpointError as exc:
            outcomes.append(str(exc))
    for name, fill in (("A", 1.0), ("B", 2.0)):
        out = _blank()
        distckpt.load(out, checkpoint_id=str(tmp_path / name), no_dist=True)
        assert out["step"] == int(fill), (name, out["step"], outcomes)
    assert outcomes == ["ok", "ok"]


def test_overwrite_given_to_save_leaves_the_callers_writer_as_it_was(tmp_path):
    cid = str(tmp_path / "c")
    distckpt.save(_state(1.0), checkpoint_id=cid, no_dist=True)
    writer = FileSystemWriter(cid)
    distckpt.save(_state(2.0), storage_writer=writer, no_dist=True, overwrite=True)
    assert writer.overwrite is None
    with pytest.raises(CheckpointError, match="already exists"):
        distckpt.save(_state(3.0), storage_writer=writer, no_dist=True)
    out = _blank()
    distckpt.load(out, checkpoint_id=cid, no_dist=True)
    assert out["step"] == 2


def test_overwrite_on_a_writer_without_the_capability_is_refused_naming_it(tmp_path):
    class Plain(FileSystemWriter):
        capabilities = frozenset()

    with pytest.raises(CheckpointError, match="Plain"):
        distckpt.save(_state(), storage_writer=Plain(str(tmp_path / "c")), no_dist=True, overwrite=True)
    assert not (tmp_path / "c").exists()


# ------------------------------------------------------------------ links on the path


def test_a_checkpoint_directory_that_is_a_link_is_refused_by_any_spelling(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    os.symlink(target, tmp_path / "link")
    for cid in (str(tmp_path / "link"), "file://" + str(tmp_path / "link")):
        with pytest.raises(CheckpointError):
            distckpt.save(_state(), checkpoint_id=cid, no_dist=True)
        with pytest.raises(CheckpointError):
            distckpt.save(_state(), checkpoint_id=cid, no_dist=True, overwrite=True)
    assert os.listdir(target) == []


def test_a_save_under_a_linked_parent_either_commits_and_succeeds_or_commits_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTCKPT_FSYNC", "1")
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "runs")
    cid = str(tmp_path / "runs" / "step-1")
    try:
        distckpt.save(_state(6.0), checkpoint_id=cid, no_dist=True)
        failed = None
    except CheckpointError as exc:
        failed = exc
    committed = (tmp_path / "real" / "step-1" / "metadata.json").exists()
    assert committed == (failed is None), f"committed={committed}, save raised {failed!r}"


# ------------------------------------------------------------------ the columnar commit with a chunk codec


def test_zstd_save_with_one_ranks_results_in_json_and_the_others_as_columns(tmp_path):
    root = str(tmp_path / "ck")
    res = run_ranks(w.mixed_result_forms_through_zstd, 3, root, timeout_s=90, collective_timeout_s=30)
    assert all(r["wrong"] == [] for r in res), res
    assert sorted(set(res[0]["forms"])) == ["ResultColumns", "list"], res[0]  # rank 1 in JSON, the others as columns
    md = distckpt.read_metadata(root)
    assert {si.codec for si in md.storage_data.items.values()} == {"stream.zstd/1"}
    assert distckpt.verify(root).ok


def test_zstd_save_on_columns_of_empty_0d_bool_int_values_and_shards_round_trips(tmp_path):
    root = str(tmp_path / "ck")
    res = run_ranks(w.columns_through_zstd, 2, root, timeout_s=90, collective_timeout_s=30)
    assert all(r["wrong"] == [] for r in res), res
    assert distckpt.verify(root).ok


def test_a_data_file_removed_before_the_commit_fails_the_save_on_every_rank_and_commits_nothing(tmp_path):
    root = str(tmp_path / "ck")
    res = run_ranks(w.commit_with_a_data_file_removed, 3, root, timeout_s=90, collective_timeout_s=30)
    for rank, r in enumerate(res):
        assert not r["ok"] and r["checkpoint_error"], (rank, r)
        assert "data-00001.safetensors" in r["msg"] and "Nothing was committed" in r["msg"], (rank, r)
        assert not r["exists"] and r["s"] < 20, (rank, r)
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)  # no staging directory or lease left


def test_overwrite_of_a_committed_zstd_checkpoint(tmp_path):
    root = str(tmp_path / "ck")
    res = run_ranks(w.overwrite_zstd, 2, root, timeout_s=90, collective_timeout_s=30)
    for rank, r in enumerate(res):
        assert not r["refused"]["ok"] and r["refused"]["checkpoint_error"] and "overwrite=True" in r["refused"]["msg"], (rank, r)
        assert r["wrong"] == [] and r["step"] == 8, (rank, r)
    assert distckpt.verify(root).ok
    assert [n for n in os.listdir(tmp_path) if n != "ck"] == []


def _flip_middle_byte(root: str, fqn: str) -> None:
    md = distckpt.read_metadata(root)
    for index, info in md.storage_data.items.items():
        if index.fqn == fqn:
            with open(os.path.join(root, info.file), "r+b") as f:
                f.seek(info.offset + info.length // 2)
                b = f.read(1)
                f.seek(info.offset + info.length // 2)
                f.write(bytes([b[0] ^ 0x5A]))
            return
    raise AssertionError(fqn)


def test_a_corrupt_zstd_chunk_is_named_by_load_and_verify(tmp_path):
    root = str(tmp_path / "ck")
    sd = {"good": torch.arange(4000, dtype=torch.float32), "bad": torch.arange(4000, dtype=torch.float32) * 3}
    distckpt.save(sd, storage_writer=FileSystemWriter(root, _extensions=[distckpt.ZStandard()]), no_dist=True)
    _flip_middle_byte(root, "bad")
    report = distckpt.verify(root, raise_on_error=False)
    assert not report.ok and any("bad" in p for p in report.problems) and not any("'good'" in p for p in report.problems)
    out = {"good": torch.zeros(4000), "bad": torch.zeros(4000)}
    with pytest.raises(CorruptCheckpointError, match="bad"):
        distckpt.load(out, checkpoint_id=root, no_dist=True)
    only_good = {"good": torch.zeros(4000)}
    distckpt.load(only_good, checkpoint_id=root, no_dist=True)  # a load that does not need the damaged chunk still works
    assert torch.equal(only_good["good"], sd["good"])


# ------------------------------------------------------------------ decoders of frames given malformed frames

_u8 = np.uint8


def _results(**over) -> bytes:
    parts = {"files": pack_json([["data-00000.safetensors", 100, 0, 5]]), "file_no": np.array([0], _u8),
             "offset": np.array([0], _u8), "length": np.array([4], _u8), "crc": np.array([1], _u8),
             "codecs": pack_json(["identity"]), "codec": np.array([0], _u8)}
    parts.update(over)
    return encode_frame(RESULTS_MAGIC, list(parts.values()))


def _props() -> list:
    from distckpt.format.codec import enc_props
    from distckpt.metadata import TensorProperties

    return enc_props(TensorProperties(dtype=torch.float32))


def _plan(keys=None, meta=None, item_key=None) -> bytes:
    keys = [["a", 0, _props(), [4], None]] if keys is None else keys
    meta = {"storage_data": None, "usable": True} if meta is None else meta
    item_key = np.array([0], _u8) if item_key is None else item_key
    return encode_frame(PLAN_MAGIC, [pack_json(keys), pack_json(meta), pack_json(None), item_key,
                                     np.zeros((1, 1), _u8), np.full((1, 1), 4, _u8)])


def _use_results(raw: bytes):
    from distckpt.metadata import MetadataIndex
    from distckpt.planner import BytesIOWriteData, WriteItem, WriteItemType

    return decode_results(raw).to_results([WriteItem(MetadataIndex("a"), WriteItemType.BYTE_IO, BytesIOWriteData(4))])


def _use_plan(raw: bytes):
    return decode_plan(raw).to_plan()


def test_well_formed_frames_decode():
    assert _use_results(_results())[0].storage_data.file == "data-00000.safetensors"
    assert _use_plan(_plan()).items[0].index.fqn == "a"


_MALFORMED = {
    "results: codec index out of range": lambda: _use_results(_results(codec=np.array([3], _u8))),
    "results: codec names not strings": lambda: _use_results(_results(codecs=pack_json([1]))),
    "results: mismatched column lengths": lambda: _use_results(_results(offset=np.array([0, 1], _u8))),
    "results: negative codec index (signed column)": lambda: _use_results(_results(codec=np.array([-1], np.int8))),
    "results: negative file number (signed column)": lambda: _use_results(_results(file_no=np.array([-1], np.int8))),
    "results: negative offset (signed column)": lambda: _use_results(_results(offset=np.array([-5], np.int8))),
    "results: a column as raw bytes": lambda: _use_results(_results(file_no=b"\x00")),
    "results: file rows not lists": lambda: _use_results(_results(files=pack_json([1]))),
    "results: file rows too short": lambda: _use_results(_results(files=pack_json([["a"]]))),
    "results: too few sections": lambda: decode_results(encode_frame(RESULTS_MAGIC, [pack_json([])])),
    "plan: meta without its members": lambda: _use_plan(_plan(meta={})),
    "plan: item keys as raw bytes": lambda: _use_plan(_plan(item_key=b"\x00")),
    "plan: negative item key (signed column)": lambda: _use_plan(_plan(item_key=np.array([-1], np.int8))),
    "plan: type code out of range": lambda: _use_plan(_plan(keys=[["a", 9, _props(), [4], None]])),
    "plan: type code not a number": lambda: _use_plan(_plan(keys=[["a", "x", _props(), [4], None]])),
    "plan: key row too short": lambda: _use_plan(_plan(keys=[["a"]])),
    "plan: fqn not a string": lambda: _use_plan(_plan(keys=[[1, 0, _props(), [4], None]])),
    "plan: global size not a list": lambda: _use_plan(_plan(keys=[["a", 0, _props(), None, None]])),
    "plan: too few sections": lambda: decode_plan(encode_frame(PLAN_MAGIC, [pack_json([])])),
    "keep: meta without n": lambda: decode_reply(encode_frame(KEEP_MAGIC, [pack_json({}), np.zeros(1, _u8)]), SavePlan([])),
    "keep: meta not an object": lambda: decode_reply(encode_frame(KEEP_MAGIC, [pack_json([1]), np.zeros(1, _u8)]), SavePlan([])),
}


@pytest.mark.parametrize("case", sorted(_MALFORMED))
def test_a_malformed_frame_is_a_corrupt_checkpoint_error(case):
    with pytest.raises(CorruptCheckpointError):
        _MALFORMED[case]()


def test_a_truncated_or_foreign_frame_is_a_corrupt_checkpoint_error():
    good = _results()
    for raw in (good[:-1], good + b"\x00", RESULTS_MAGIC + b"\xff\xff\xff\xff"):
        with pytest.raises(CorruptCheckpointError):
            decode_results(raw)


# ------------------------------------------------------------------ fork during an async save; release_buffers


class _SlowWrite(FileSystemWriter):
    def write_data(self, plan, planner):
        time.sleep(1.5)
        return super().write_data(plan, planner)


def _child_saves_alone(root: str, queue) -> None:
    try:
        start = time.monotonic()
        distckpt.save({"c": torch.arange(10.0)}, checkpoint_id=os.path.join(root, "child-sync"), no_dist=True)
        handle = distckpt.async_save({"c": torch.arange(10.0)}, checkpoint_id=os.path.join(root, "child-async"), no_dist=True)
        handle.result(timeout=15)
        release_buffers()  # the parent's save in flight is not the child's to wait for
        queue.put(("ok", time.monotonic() - start))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        queue.put(("error", repr(exc)))


def test_a_child_forked_during_an_async_save_saves_on_its_own(tmp_path):
    sd = {"w": torch.randn(512, 512)}
    handle = distckpt.async_save(sd, storage_writer=_SlowWrite(str(tmp_path / "parent")), no_dist=True)
    assert not handle.done()
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_saves_alone, args=(str(tmp_path), queue))
    child.start()
    child.join(20)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail("the forked child hung")
    outcome = queue.get(timeout=5)
    assert child.exitcode == 0 and outcome[0] == "ok" and outcome[1] < 10, outcome
    handle.result(timeout=20)
    for name in ("child-sync", "child-async"):
        out = {"c": torch.zeros(10)}
        distckpt.load(out, checkpoint_id=str(tmp_path / name), no_dist=True)
        assert torch.equal(out["c"], torch.arange(10.0))
    out = {"w": torch.zeros(512, 512)}
    distckpt.load(out, checkpoint_id=str(tmp_path / "parent"), no_dist=True)
    assert torch.equal(out["w"], sd["w"])


def test_release_buffers_waits_for_the_save_in_flight_and_the_next_async_save_works(tmp_path):
    sd = {"w": torch.randn(256, 256)}
    handle = distckpt.async_save(sd, storage_writer=_SlowWrite(str(tmp_path / "a")), no_dist=True)
    freed = release_buffers()
    assert handle.done() and handle.exception() is None
    assert freed >= sd["w"].nbytes
    assert release_buffers() == 0
    again = distckpt.async_save({"w": sd["w"] + 1}, checkpoint_id=str(tmp_path / "b"), no_dist=True)
    again.result(timeout=20)
    out = {"w": torch.zeros(256, 256)}
    distckpt.load(out, checkpoint_id=str(tmp_path / "b"), no_dist=True)
    assert torch.equal(out["w"], sd["w"] + 1)
    release_buffers()
