"""Data files written around the page cache (O_DIRECT) through bounce buffers: the bytes on disk are
exactly the bytes written, whatever the sizes, order or the kernel's answers."""

from __future__ import annotations

import errno
import fcntl
import os
import random
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import distckpt
from distckpt.backends import direct_io
from distckpt.backends.direct_io import DirectWriter, direct_io_wanted
from distckpt.backends.filesystem import FsStore, _io_error
from distckpt.errors import CheckpointError
from tests.forking import run_in_fork

pytestmark = pytest.mark.skipif(not getattr(os, "O_DIRECT", 0), reason="no O_DIRECT on this platform")
SMALL = 8192  # a bounce buffer of two blocks, so that tests cross many buffer boundaries


def _is_direct(writer: DirectWriter) -> bool:
    return bool(fcntl.fcntl(writer.fd, fcntl.F_GETFL) & os.O_DIRECT)


def _writer(path: str) -> DirectWriter:
    w = DirectWriter(path, _io_error)
    if not w.direct:
        w.abort()
        pytest.skip(f"the file system of {path} refuses O_DIRECT")
    return w


@pytest.fixture(autouse=True)
def _small_buffers(monkeypatch):
    monkeypatch.setenv("DISTCKPT_DIRECT_IO_BUFFER_BYTES", str(SMALL))


def _record(monkeypatch, cls, method: str) -> list:
    """What ``cls.method`` returns from now on, call by call."""
    results: list = []
    real = getattr(cls, method)

    def spy(self, *args):
        out = real(self, *args)
        results.append(out)
        return out

    monkeypatch.setattr(cls, method, spy)
    return results


@pytest.fixture
def in_place(monkeypatch) -> list:
    """The byte counts of the writes made straight from the source's memory, as they happen."""
    return _record(monkeypatch, DirectWriter, "_write_in_place")


@settings(deadline=None)
@given(sizes=st.lists(st.integers(0, 3 * SMALL + 5), max_size=12), group=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_writes_in_file_order_land_exactly(sizes, group, seed):
    rng = random.Random(seed)
    pieces = [bytes(rng.getrandbits(8) for _ in range(n)) for n in sizes]
    with tempfile.TemporaryDirectory(dir=os.getcwd()) as d:
        path = os.path.join(d, "f")
        w = _writer(path)
        offset = 0
        for i in range(0, len(pieces), group):
            batch = pieces[i:i + group]
            w.pwritev([memoryview(p) for p in batch], offset)
            offset += sum(len(p) for p in batch)
        assert w.direct and _is_direct(w), "in-order writes stay direct"
        w.close(sync=True)
        with open(path, "rb") as f:
            assert f.read() == b"".join(pieces)


@settings(deadline=None)
@given(depth=st.integers(1, 5), sizes=st.lists(st.integers(0, 3 * SMALL + 5), max_size=12), seed=st.integers(0, 2**16),
       aligned=st.booleans())
def test_several_writes_in_flight_land_exactly(depth, sizes, seed, aligned):
    """Buffers written by several flushers at once, at their own offsets, and aligned sources written in place in
    pieces in flight together: the file holds exactly the bytes written, in order."""
    os.environ["DISTCKPT_DIRECT_IO_QUEUE_DEPTH"] = str(depth)
    try:
        rng = random.Random(seed)
        pieces = [rng.randbytes(n) for n in sizes]
        with tempfile.TemporaryDirectory(dir=os.getcwd()) as d:
            path = os.path.join(d, "f")
            w = _writer(path)
            assert len(w.buffers) == depth + 1
            offset = 0
            for p in pieces:
                src = memoryview(_aligned_source(p))[:len(p)] if aligned else memoryview(p)
                w.pwrite(src, offset)
                offset += len(p)
            assert len(w.in_flight) <= depth and w.direct
            w.close(sync=False)
            with open(path, "rb") as f:
                assert f.read() == b"".join(pieces)
    finally:
        del os.environ["DISTCKPT_DIRECT_IO_QUEUE_DEPTH"]


def test_the_buffers_of_a_file_fit_its_share(monkeypatch):
    monkeypatch.setenv("DISTCKPT_DIRECT_IO_BUFFER_BYTES", str(16 << 20))
    for depth in (1, 2, 7):
        monkeypatch.setenv("DISTCKPT_DIRECT_IO_QUEUE_DEPTH", str(depth))
        for share in (1, 4096 * (depth + 1), 10 << 20, 1 << 30):
            size = direct_io.bounce_buffer_bytes(share)
            assert size % 4096 == 0 and size <= 16 << 20
            assert direct_io.bounce_buffer_count() * size <= max(share, direct_io.bounce_buffer_count() * 4096)


def test_a_write_out_of_order_goes_on_buffered(tmp_path):
    data = os.urandom(5 * SMALL + 123)
    head = 4096
    w = _writer(str(tmp_path / "f"))
    w.pwrite(memoryview(data)[head:head + 3 * SMALL + 7], head)  # the data first, as if the header came last
    w.pwrite(memoryview(data)[head + 3 * SMALL + 7:], head + 3 * SMALL + 7)
    w.pwrite(memoryview(data)[:head], 0)
    assert not w.direct and not _is_direct(w)
    w.close(sync=True)
    assert (tmp_path / "f").read_bytes() == data


@pytest.mark.parametrize("depth", [1, 3])
def test_a_refused_direct_write_goes_on_buffered(tmp_path, monkeypatch, depth):
    monkeypatch.setenv("DISTCKPT_DIRECT_IO_QUEUE_DEPTH", str(depth))
    real = os.pwrite
    calls = []

    def refuse_from_the_second(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            calls.append(offset)
            if offset >= SMALL:  # every write but the first, however many flushers race to it
                raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(direct_io.os, "pwrite", refuse_from_the_second)
    data = os.urandom(4 * SMALL + 99)
    w = _writer(str(tmp_path / "f"))
    w.pwritev([memoryview(data)[:SMALL + 1], memoryview(data)[SMALL + 1:]], 0)
    # one flusher at a time writes in file order; several race, and whichever is refused first ends direct I/O
    assert (calls == [0, SMALL] if depth == 1 else any(c >= SMALL for c in calls)) and not w.direct
    w.close(sync=True)
    assert (tmp_path / "f").read_bytes() == data


def test_a_short_direct_write_goes_on_buffered(tmp_path, monkeypatch):
    real = os.pwrite

    def short(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and len(data) > 4096:
            return real(fd, memoryview(data)[:4096], offset) - 4000  # a short write leaving the rest misaligned
        return real(fd, data, offset)

    monkeypatch.setattr(direct_io.os, "pwrite", short)
    data = os.urandom(3 * SMALL + 5)
    w = _writer(str(tmp_path / "f"))
    w.pwrite(memoryview(data), 0)
    w.close(sync=False)
    assert (tmp_path / "f").read_bytes() == data


def test_a_file_system_without_direct_io_gets_buffered_writes(tmp_path, monkeypatch):
    real = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *args)

    monkeypatch.setattr(direct_io.os, "open", no_direct)
    w = DirectWriter(str(tmp_path / "f"), _io_error)
    assert not w.direct
    data = os.urandom(SMALL + 3)
    w.pwrite(memoryview(data), 0)
    w.close(sync=True)
    assert (tmp_path / "f").read_bytes() == data


def test_the_knob(monkeypatch, tmp_path):
    monkeypatch.setenv("DISTCKPT_DIRECT_IO", "off")
    assert not direct_io_wanted(str(tmp_path))
    monkeypatch.setenv("DISTCKPT_DIRECT_IO", "on")
    assert direct_io_wanted(str(tmp_path))
    monkeypatch.setenv("DISTCKPT_DIRECT_IO", "sometimes")
    with pytest.raises(CheckpointError, match="DISTCKPT_DIRECT_IO"):
        direct_io_wanted(str(tmp_path))
    monkeypatch.setenv("DISTCKPT_DIRECT_IO", "auto")
    if os.path.isdir("/dev/shm") and direct_io._file_system_type("/dev/shm") == 0x01021994:
        assert not direct_io_wanted("/dev/shm"), "tmpfs is memory: no direct I/O there"
    kind = direct_io._file_system_type(str(tmp_path))
    assert direct_io_wanted(str(tmp_path)) == (kind in direct_io.LOCAL_BLOCK_FILE_SYSTEMS)
    monkeypatch.setenv("DISTCKPT_DIRECT_IO_BUFFER_BYTES", "5000")
    with pytest.raises(CheckpointError, match="multiple of 4096"):
        DirectWriter(str(tmp_path / "g"), _io_error)


def test_save_and_load_with_direct_writes(tmp_path, monkeypatch):
    """End to end through the public API: odd sizes, values and two data files, written directly."""
    monkeypatch.setenv("DISTCKPT_DIRECT_IO", "on")
    _writer(str(tmp_path / "probe")).abort()  # skips where the file system refuses O_DIRECT
    monkeypatch.setenv("DISTCKPT_IO_THREADS", "2")
    monkeypatch.setenv("DISTCKPT_MIN_FILE_BYTES", str(1 << 20))  # two files for this small state
    writers = _record(monkeypatch, FsStore, "create")
    g = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(513, 1021, generator=g),
        "b": torch.randn(3, generator=g).to(torch.bfloat16),
        "step": torch.tensor(7),
        "mask": torch.rand(100003, generator=g) > 0.5,
        "meta": {"epoch": 3, "name": "run"},
        "blob": b"\x00\x01" * 3000,
    }
    path = tmp_path / "ck"
    distckpt.save(state, checkpoint_id=str(path))
    assert len(writers) == 2 and all(isinstance(w, DirectWriter) and w.direct for w in writers), "written directly"
    dest = {"w": torch.zeros(513, 1021), "b": torch.zeros(3, dtype=torch.bfloat16), "step": torch.tensor(0),
            "mask": torch.zeros(100003, dtype=torch.bool), "meta": {"epoch": 0, "name": ""}, "blob": b""}
    distckpt.load(dest, checkpoint_id=str(path))
    for k in ("w", "b", "step", "mask"):
        assert torch.equal(dest[k], state[k]), k
    assert dest["meta"] == state["meta"] and dest["blob"] == state["blob"]
    report = distckpt.verify(str(path))
    assert not report.problems
    md = distckpt.read_metadata(str(path))
    assert md is not None


def _aligned_source(data: bytes):
    """``data`` in page-aligned memory, as async_save's staging arena holds large tensors."""
    import mmap

    m = mmap.mmap(-1, max(len(data), 1))
    m[:len(data)] = data
    return m


def test_aligned_memory_is_written_in_place(tmp_path, in_place):
    rng = random.Random(5)
    head, big, rest = (bytes(rng.getrandbits(8) for _ in range(n)) for n in (4096, 3 * 65536 + 5, 2 * 65536))
    w = _writer(str(tmp_path / "f"))
    w.pwrite(memoryview(head), 0)  # bytes at no particular address: copied into the buffer
    w.pwrite(memoryview(_aligned_source(big))[:len(big)], len(head))  # its whole blocks go in place, after the buffer
    w.pwrite(memoryview(_aligned_source(rest)), len(head) + len(big))  # 5 bytes into a block: copied
    w.close(sync=True)
    assert (tmp_path / "f").read_bytes() == head + big + rest
    assert in_place == [3 * 65536]


def test_in_place_writes_refused_go_on_buffered(tmp_path, monkeypatch):
    import numpy as np

    real = os.pwrite
    refused = []
    w = _writer(str(tmp_path / "f"))
    bounds = [(a.ctypes.data, a.ctypes.data + len(a)) for a in (np.frombuffer(b, dtype=np.uint8) for b in w.buffers)]

    def only_from_buffer(fd, data, offset):
        addr = np.frombuffer(data, dtype=np.uint8).ctypes.data
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and not any(lo <= addr < hi for lo, hi in bounds):
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(direct_io.os, "pwrite", only_from_buffer)
    data = os.urandom(5 * 65536 + 11)
    w.pwrite(memoryview(_aligned_source(data))[:len(data)], 0)
    assert refused == [0] and not w.direct and not _is_direct(w)
    w.close(sync=True)
    assert (tmp_path / "f").read_bytes() == data


def test_async_save_stages_large_tensors_on_pages(tmp_path):
    from distckpt.staging import BufferPool

    leaves = [(("a",), torch.zeros(3)), (("b",), torch.zeros(70000)), (("c",), torch.zeros(5, dtype=torch.int8)),
              (("d",), torch.zeros(16384 + 1))]
    bufs = BufferPool().buffers_for(leaves)
    assert [b.data_ptr() % 4096 == 0 for b in bufs][1::2] == [True, True]
    assert all(b.data_ptr() % 64 == 0 for b in bufs)
    ends = sorted((b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in bufs)
    assert all(e <= s for (_, e), (s, _) in zip(ends, ends[1:])), "buffers do not overlap"


def test_async_save_writes_its_staging_buffers_in_place(tmp_path, monkeypatch, in_place):
    monkeypatch.setenv("DISTCKPT_DIRECT_IO", "on")
    _writer(str(tmp_path / "probe")).abort()  # skips where the file system refuses O_DIRECT
    g = torch.Generator().manual_seed(1)
    # layer sizes are whole pages, as a model's usually are; the odd-sized step counter is written last
    state = {f"layer{i}": torch.randn(256, 64 * (i + 1), generator=g) for i in range(6)} | {"step": torch.tensor(3)}
    expected = {k: v.clone() for k, v in state.items()}
    handle = distckpt.async_save(state, checkpoint_id=str(tmp_path / "ck"))
    for v in state.values():
        v.add_(1)  # after staging: must not reach the file
    handle.result()
    assert sum(in_place) == sum(v.numel() * 4 for k, v in expected.items() if k != "step")
    dest = {k: torch.zeros_like(v) for k, v in expected.items()}
    distckpt.load(dest, checkpoint_id=str(tmp_path / "ck"))
    assert all(torch.equal(dest[k], expected[k]) for k in expected)


@pytest.mark.parametrize("depth", [1, 4])
def test_a_failed_write_in_the_background_surfaces_on_the_writer(tmp_path, monkeypatch, depth):
    from distckpt.errors import StorageIOError

    monkeypatch.setenv("DISTCKPT_DIRECT_IO_QUEUE_DEPTH", str(depth))

    real = os.pwrite

    def full_disk(fd, data, offset):
        if offset >= SMALL:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(direct_io.os, "pwrite", full_disk)
    w = _writer(str(tmp_path / "f"))
    with pytest.raises(StorageIOError, match="free disk space"):
        try:
            w.pwrite(memoryview(os.urandom(8 * SMALL)), 0)  # the second buffer's write fails in a flusher
            w.close(sync=True)
        except StorageIOError:
            w.abort()
            raise


def _write_in_child(path: str) -> bool:
    data = bytes(range(256)) * (5 * SMALL // 256)
    w = DirectWriter(path, _io_error)
    w.pwrite(memoryview(data), 0)  # hands buffers to flusher threads
    w.close(sync=False)
    with open(path, "rb") as f:
        return f.read() == data


def test_a_forked_child_gets_flusher_threads_of_its_own(tmp_path):
    """A process forked after direct writes (a data loader's workers) can still write directly."""
    w = _writer(str(tmp_path / "parent"))
    w.pwrite(memoryview(os.urandom(3 * SMALL)), 0)  # the flusher threads exist in this process now
    w.close(sync=False)
    assert run_in_fork(_write_in_child, str(tmp_path / "child"),
                       hang="the forked child hung waiting for flusher threads it does not have") is True


def _scribble(buf) -> bool:
    buf[:4] = b"kid!"  # the child's own copy of the parent's buffer, if the buffer is private
    return True


def test_bounce_buffers_are_not_shared_with_a_forked_child():
    """A child forked while the parent's writers hold bounce buffers (an async save in flight when a data loader
    forks its workers) must not write into the parent's bytes, nor the parent into the child's."""
    buf = direct_io._POOL.take(direct_io.ALIGN)
    try:
        buf[:4] = b"mine"
        assert run_in_fork(_scribble, buf) is True
        assert buf[:4] == b"mine"
    finally:
        direct_io._POOL.give(buf)


def _pool_is_fresh(parent_pool_id: int) -> bool:
    return id(direct_io._POOL) != parent_pool_id and direct_io._POOL.free == []


def test_a_forked_child_starts_with_an_empty_bounce_pool():
    buf = direct_io._POOL.take(direct_io.ALIGN)
    direct_io._POOL.give(buf)  # the parent keeps one
    assert run_in_fork(_pool_is_fresh, id(direct_io._POOL)) is True


def test_the_way_to_write_is_learned_per_device():
    """Direct first, then buffered, then whichever moved files faster, with the other taken again every so often."""
    from distckpt.backends.write_paths import LOOK_AGAIN_EVERY, WritePaths

    paths, mib = WritePaths(), 1 << 20
    assert paths.choose(7) is True
    paths.record(7, True, 64 * mib, 0.10)  # 671 MB/s
    assert paths.choose(7) is False
    paths.record(7, False, 64 * mib, 0.05)  # twice as fast
    paths.record(7, False, mib, 1.0)  # too small to say anything about the device: ignored
    picks = [paths.choose(7) for _ in range(2 * LOOK_AGAIN_EVERY)]
    assert picks.count(True) == 2 and picks.count(False) == 2 * LOOK_AGAIN_EVERY - 2
    assert paths.choose(8) is True  # another device learns on its own
    paths.record(7, True, 64 * mib, 0.01)  # the device drifted: direct is now far faster on average
    picks = [paths.choose(7) for _ in range(LOOK_AGAIN_EVERY)]
    assert picks.count(True) == LOOK_AGAIN_EVERY - 1


def test_auto_saves_on_a_local_disk_try_both_ways_and_keep_the_faster(tmp_path, monkeypatch):
    """Through the public API: with DISTCKPT_DIRECT_IO=auto on a local disk file system, the first save writes
    directly and the second through the page cache; each file's time to durable is recorded; then the faster
    way is kept. The bytes are the same either way."""
    from distckpt.backends import filesystem, write_paths
    from distckpt.backends.filesystem import _FdWriter

    _writer(str(tmp_path / "probe")).abort()  # skips where the file system refuses O_DIRECT
    monkeypatch.setenv("DISTCKPT_DIRECT_IO", "auto")
    monkeypatch.setenv("DISTCKPT_FSYNC", "1")
    monkeypatch.setattr(direct_io, "_file_system_type", lambda path: 0xEF53)  # as ext4
    paths = write_paths.WritePaths()
    monkeypatch.setattr(filesystem, "PATHS", paths)
    writers = _record(monkeypatch, FsStore, "create")
    state = {"w": torch.randn(5 << 20, generator=torch.Generator().manual_seed(1))}  # 20 MiB: one file, recorded
    for i in range(3):
        distckpt.save(state, checkpoint_id=str(tmp_path / f"ck{i}"))
        dest = {"w": torch.zeros(5 << 20)}
        distckpt.load(dest, checkpoint_id=str(tmp_path / f"ck{i}"))
        assert torch.equal(dest["w"], state["w"])
    inner = [w.inner for w in writers]
    assert isinstance(inner[0], DirectWriter) and isinstance(inner[1], _FdWriter) and not isinstance(inner[1], DirectWriter)
    device = os.stat(tmp_path).st_dev
    assert set(paths.rate) == {(device, True), (device, False)}
    faster = paths.rate[(device, True)] >= paths.rate[(device, False)]
    assert isinstance(inner[2], DirectWriter) == faster
    monkeypatch.setenv("DISTCKPT_DIRECT_IO", "on")  # a setting of on or off is never second-guessed
    distckpt.save(state, checkpoint_id=str(tmp_path / "ck-on"))
    assert isinstance(writers[-1], DirectWriter)
