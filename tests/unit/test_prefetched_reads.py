"""The reader a load gets through prefetched bytes (engine/prefetched.py): each stretch the prefetch holds comes
from memory, every other from the file, in one read; a file whose version changed is read from the file, or, where
the load took its prefetched chunks as checked, refused."""

from __future__ import annotations

import pytest
import torch

from distckpt.engine.blobs import BytesReader
from distckpt.engine.prefetched import PrefetchCache, _PrefetchedReader
from distckpt.errors import CorruptCheckpointError

DATA = bytes(range(256)) * 4  # 1,024 bytes


class _Counted(BytesReader):
    def __init__(self, data: bytes, identity=("v", 1)):
        super().__init__(data)
        self.asked: list[tuple[int, int]] = []
        self._identity = identity

    def readinto(self, buf, offset):
        self.asked.append((offset, len(buf)))
        return super().readinto(buf, offset)

    def identity(self):
        return self._identity


def _cache() -> PrefetchCache:
    cache = PrefetchCache("ck", "save")
    for start, end in ((100, 200), (300, 400)):
        cache.add("f", len(DATA), ("v", 1), start, torch.frombuffer(bytearray(DATA[start:end]), dtype=torch.uint8))
    return cache


def _views(sizes):
    return [memoryview(bytearray(n)) for n in sizes]


@pytest.mark.parametrize("offset,sizes", [(50, [400]), (120, [30, 50]), (100, [100]), (0, [1024]), (380, [20, 7])])
def test_stretches_held_come_from_memory_and_the_rest_from_the_file(offset, sizes):
    inner = _Counted(DATA)
    reader = _PrefetchedReader("f", inner, _cache().files["f"], trusted=False)
    views = _views(sizes)
    assert reader.readv(views, offset) == sum(sizes)
    assert b"".join(bytes(v) for v in views) == DATA[offset:offset + sum(sizes)]
    for start, n in inner.asked:  # no byte the prefetch holds is read again
        assert all(not (100 <= b < 200 or 300 <= b < 400) for b in range(start, start + n)), inner.asked


def test_a_read_past_the_end_of_the_file_stops_there():
    reader = _PrefetchedReader("f", _Counted(DATA), _cache().files["f"], trusted=False)
    views = _views([200])
    assert reader.readv(views, 900) == 124 and bytes(views[0][:124]) == DATA[900:]


def test_a_read_without_waiting_takes_only_what_is_held_from_its_start():
    reader = _PrefetchedReader("f", _Counted(DATA), _cache().files["f"], trusted=False)
    views = _views([150])
    assert reader.readv_cached(views, 150) == 50 and bytes(views[0][:50]) == DATA[150:200]


def test_another_version_of_the_file_is_read_from_the_file_or_refused_where_its_chunks_count_as_checked():
    changed = bytes(reversed(DATA))
    inner = _Counted(changed, identity=("v", 2))
    reader = _PrefetchedReader("f", inner, _cache().files["f"], trusted=False)
    views = _views([100])
    assert reader.readv(views, 100) == 100 and bytes(views[0]) == changed[100:200]
    with pytest.raises(CorruptCheckpointError, match="changed while it was being loaded"):
        _PrefetchedReader("f", _Counted(changed, identity=("v", 2)), _cache().files["f"], trusted=True)
