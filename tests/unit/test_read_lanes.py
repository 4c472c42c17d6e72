"""Reads go through each file front to back on one thread (a lane), and a file not in the page
cache is read in one request per batch instead of in cache-sized windows."""

import os
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import distckpt
from bench.measure import drop_cache
from distckpt.backends import filesystem
from distckpt.engine import read as reading
from distckpt.engine.tasks import split_lanes
from distckpt.errors import CorruptCheckpointError
from distckpt.testing.states import seeded


@settings(deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 100)), max_size=30), st.integers(1, 6))
def test_lanes_keep_each_file_in_order_and_give_every_thread_one_where_they_can(tasks, threads):
    tasks.sort(key=lambda t: t[0])  # tasks come in file order
    files = [f"f{f}" for f, _ in tasks]
    sizes = [n for _, n in tasks]
    lanes = split_lanes(files, sizes, threads)
    assert [i for _, lane in lanes for i in lane] == list(range(len(tasks)))  # every task once, in order
    assert all(lane and all(files[i] == name for i in lane) for name, lane in lanes)
    distinct = len(dict.fromkeys(files))
    if distinct >= threads:
        assert len(lanes) == distinct  # a lane per file, none split
    else:
        # split until every thread has a lane, or no lane has two tasks left
        assert len(lanes) == min(threads, len(tasks)) or all(len(lane) == 1 for _, lane in lanes) or len(lanes) >= threads


def test_a_lane_split_halves_the_bytes():
    lanes = split_lanes(["a"] * 4 + ["b"], [10, 10, 10, 10, 5], 3)
    assert lanes == [("a", [0, 1]), ("a", [2, 3]), ("b", [4])]
    assert split_lanes(["a"] * 3, [100, 1, 1], 2) == [("a", [0]), ("a", [1, 2])]
    assert split_lanes(["a"], [7], 4) == [("a", [0])]


def _state():
    return seeded({f"w{i}": 1 << 18 for i in range(12)}, seed=1)  # 12 MiB over 12 tensors


def _record_reads(monkeypatch, methods=("readv", "readv_cached")):
    seen = []
    lock = threading.Lock()
    for method in methods:  # data in the page cache comes through readv_cached
        real = getattr(filesystem.FileReader, method)

        def record(self, views, offset, real=real):
            with lock:
                seen.append((threading.get_ident(), os.path.basename(self.path), id(self), offset, sum(len(v) for v in views)))
            return real(self, views, offset)
        monkeypatch.setattr(filesystem.FileReader, method, record)
    return seen


@pytest.mark.parametrize("save_threads,load_threads", [(2, 2), (1, 2), (1, 3)])
def test_each_lane_reads_its_file_front_to_back_with_a_reader_of_its_own(tmp_path, monkeypatch, save_threads, load_threads):
    sd = _state()
    ck = str(tmp_path / "ck")
    monkeypatch.setenv("DISTCKPT_IO_THREADS", str(save_threads))
    monkeypatch.setenv("DISTCKPT_IO_BATCH_BYTES", str(1 << 20))  # a batch per tensor
    monkeypatch.setenv("DISTCKPT_MIN_FILE_BYTES", str(1 << 20))  # a file per save thread, small as the state is
    distckpt.save(sd, checkpoint_id=ck)
    monkeypatch.setenv("DISTCKPT_IO_THREADS", str(load_threads))
    seen = _record_reads(monkeypatch)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    distckpt.load(out, checkpoint_id=ck)
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    data = [r for r in seen if r[4] > 4096]  # not the header checks
    readers = {}
    for thread, name, reader, offset, n in data:
        readers.setdefault(reader, []).append((thread, name, offset))
    # every reader is used by one lane: one file, offsets rising
    for rows in readers.values():
        assert len({name for _, name, _ in rows}) == 1
        offsets = [o for _, _, o in rows]
        assert offsets == sorted(offsets)
    files = {name for _, name, _, _, _ in data}
    assert len(files) == save_threads
    # fewer files than threads: a file is split into lanes, each with its own open file
    assert len(readers) == max(len(files), min(load_threads, 12))


def _cached_reads_refused(monkeypatch, cached_bytes):
    """Simulate a page cache that holds only the first ``cached_bytes`` of each read (where the file
    system cannot answer, as tmpfs, the real one would say None)."""
    calls = []
    real_readv = filesystem.FileReader.readv

    def readv_cached(self, views, offset):
        want = sum(len(v) for v in views)
        got = min(want, cached_bytes)
        calls.append((offset, want, got))
        return min(real_readv(self, views, offset), got) if got else 0
    monkeypatch.setattr(filesystem.FileReader, "readv_cached", readv_cached)
    return calls


@pytest.mark.parametrize("cached_bytes", [0, 3000, 1 << 22])
def test_data_not_in_the_page_cache_is_read_in_one_request_per_batch(tmp_path, monkeypatch, cached_bytes):
    g = torch.Generator().manual_seed(2)
    sd = {"big": torch.randn(3 << 20, generator=g), "small": torch.randn(10, generator=g)}  # 12 MiB: six windows
    ck = str(tmp_path / "ck")
    monkeypatch.setenv("DISTCKPT_IO_THREADS", "1")
    distckpt.save(sd, checkpoint_id=ck)
    calls = _cached_reads_refused(monkeypatch, cached_bytes)
    seen = _record_reads(monkeypatch, ("readv",))
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    distckpt.load(out, checkpoint_id=ck)
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    big = [r for r in seen if r[4] >= 1 << 20]
    assert len(calls) == 1  # asked once for the lane (its file), not per window or batch
    if cached_bytes < 2 << 20:  # the first window is not cached: each batch is one read
        assert len(big) == 1 and big[0][4] >= 12 << 20
    else:  # cached: cache-sized windows, checksummed while they are in the CPU cache
        assert [r[4] for r in big] == [2 << 20] * 6
    assert distckpt.verify(ck).ok


def _saved_big(tmp_path, seed):
    sd = {"big": torch.randn(3 << 20, generator=torch.Generator().manual_seed(seed))}
    ck = str(tmp_path / "ck")
    distckpt.save(sd, checkpoint_id=ck)
    return sd, ck, distckpt.read_metadata(ck).storage_data.items[distckpt.metadata.MetadataIndex("big", [0])]


def test_a_flip_in_data_read_cold_is_caught_and_named(tmp_path, monkeypatch):
    sd, ck, info = _saved_big(tmp_path, 3)
    with open(os.path.join(ck, info.file), "r+b") as f:
        f.seek(info.offset + (9 << 20) + 7)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    _cached_reads_refused(monkeypatch, 0)
    with pytest.raises(CorruptCheckpointError, match=rf"'big'.*{info.file}"):
        distckpt.load({"big": torch.zeros_like(sd["big"])}, checkpoint_id=ck)


def _opening_without_checks(headers: dict):
    """The size check before reading catches truncation first; a test of the read's own check skips it,
    with the headers the files had before."""
    def open_all(store, fsd, names, where, spans=None, expected=None):
        if spans is not None:
            spans.update(headers)
        return {name: store.open(name) for name in names}
    return open_all


def test_a_truncated_file_read_cold_is_reported_as_truncated(tmp_path, monkeypatch):
    from distckpt.format.datafile import header_spans, read_header

    sd, ck, info = _saved_big(tmp_path, 4)
    _cached_reads_refused(monkeypatch, 0)
    blob = filesystem.FsStore(ck).open(info.file)
    headers = {info.file: header_spans(read_header(blob.pread, blob.size, "test"))}
    blob.close()
    monkeypatch.setattr(reading, "open_and_validate", _opening_without_checks(headers))
    os.truncate(os.path.join(ck, info.file), info.offset + (5 << 20))
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        distckpt.load({"big": torch.zeros_like(sd["big"])}, checkpoint_id=ck)


def test_the_real_page_cache_probe_on_this_file_system(tmp_path):
    # on a disk file system a dropped file is not cached, a fresh read is; tmpfs cannot tell (None)
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(1 << 20))
    reader = filesystem.FsStore(str(tmp_path)).open("f.bin")
    try:
        buf = bytearray(1 << 20)
        reader.readv([memoryview(buf)], 0)
        first = reader.readv_cached([memoryview(bytearray(1 << 20))], 0)
        if first is None:
            pytest.skip("this file system does not answer non-blocking reads (tmpfs)")
        assert first == 1 << 20
        drop_cache(str(tmp_path))
        assert reader.readv_cached([memoryview(bytearray(1 << 20))], 0) < 1 << 20
    finally:
        reader.close()
