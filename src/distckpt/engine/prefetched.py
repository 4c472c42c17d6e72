"""Bytes of a checkpoint's data files read ahead of a load (:mod:`distckpt.prefetching`), and the store through which
the load finds them: a read wholly inside a prefetched range is a memory copy, any other goes to storage.

A range is bound to the version of its file that it was read from (its size and identity): a file replaced since is
read from storage again. The bytes take the load's own path from there, so they are checked against their checksums
like any other read.
"""

from __future__ import annotations

import bisect
import threading
from typing import Iterable, Optional

import torch

from .blobs import MAPS, BlobReader, BlobStore
from .references import ReadOnlyStore

__all__ = ["PrefetchCache", "PrefetchedStore"]


class _FileRanges:
    """One file's prefetched ranges: (start, bytes) sorted by start, none overlapping."""

    def __init__(self, size: int, identity: Optional[tuple]) -> None:
        self.size, self.identity = size, identity
        self.starts: list[int] = []
        self.buffers: list[torch.Tensor] = []

    def add(self, start: int, buf: torch.Tensor) -> None:
        at = bisect.bisect_left(self.starts, start)
        self.starts.insert(at, start)
        self.buffers.insert(at, buf)

    def covering(self, offset: int, n: int) -> Optional[memoryview]:
        """The cached bytes [offset, offset + n), where one range holds them all."""
        at = bisect.bisect_right(self.starts, offset) - 1
        if at < 0:
            return None
        start, buf = self.starts[at], self.buffers[at]
        if offset + n > start + buf.numel():
            return None
        return memoryview(buf.numpy()).cast("B")[offset - start:offset - start + n]


class PrefetchCache:
    """What a prefetch read of one checkpoint (``checkpoint_id``, ``save_id``): ranges of its data files."""

    def __init__(self, checkpoint_id: str, save_id: Optional[str]) -> None:
        self.checkpoint_id, self.save_id = checkpoint_id, save_id
        self.files: dict[str, _FileRanges] = {}
        self.nbytes = 0
        self._lock = threading.Lock()

    def add(self, name: str, size: int, identity: Optional[tuple], start: int, buf: torch.Tensor) -> None:
        with self._lock:
            ranges = self.files.get(name)
            if ranges is None or (ranges.size, ranges.identity) != (size, identity):
                ranges = self.files[name] = _FileRanges(size, identity)
            ranges.add(start, buf)
            self.nbytes += buf.numel()

    def holds(self, name: str, offset: int, n: int) -> bool:
        """Whether bytes [offset, offset + n) of ``name`` were prefetched (of whichever version)."""
        ranges = self.files.get(name)
        return ranges is not None and ranges.covering(offset, n) is not None

    def release(self) -> None:
        with self._lock:
            self.files, self.nbytes = {}, 0


class _PrefetchedReader(BlobReader):
    """A data file's reader that copies what the prefetch holds of this version of it and reads the rest."""

    def __init__(self, inner: BlobReader, ranges: Optional[_FileRanges]) -> None:
        self.inner, self.size = inner, inner.size
        self.small_reads_are_cheap = inner.small_reads_are_cheap
        same = ranges is not None and (ranges.size, ranges.identity) == (inner.size, inner.identity())
        self.ranges = ranges if same else None

    def _cached(self, views: list, offset: int) -> Optional[int]:
        total = sum(len(v) for v in views)
        held = self.ranges.covering(offset, total) if self.ranges is not None and total else None
        if held is None:
            return None
        at = 0
        for v in views:
            n = len(v)
            memoryview(v).cast("B")[:] = held[at:at + n]
            at += n
        return total

    def readinto(self, buf: memoryview, offset: int) -> int:
        got = self._cached([buf], offset)
        return self.inner.readinto(buf, offset) if got is None else got

    def readv(self, views: list, offset: int) -> int:
        got = self._cached(views, offset)
        return self.inner.readv(views, offset) if got is None else got

    def readv_cached(self, views: list, offset: int) -> Optional[int]:
        got = self._cached(views, offset)
        return self.inner.readv_cached(views, offset) if got is None else got

    def identity(self) -> Optional[tuple]:
        return self.inner.identity()

    def close(self) -> None:
        self.inner.close()


class PrefetchedStore(ReadOnlyStore):
    """A checkpoint's data store, its readers served first from a :class:`PrefetchCache`."""

    def __init__(self, inner: BlobStore, cache: PrefetchCache) -> None:
        self.inner, self.cache = inner, cache
        self.capabilities = inner.capabilities - {MAPS}  # reads go through the readers, where the prefetched bytes are

    def holds(self, name: str, offset: int, n: int) -> bool:
        """Whether the prefetch read bytes [offset, offset + n) of ``name``."""
        return self.cache.holds(name, offset, n)

    def open(self, name: str) -> BlobReader:
        return _PrefetchedReader(self.inner.open(name), self.cache.files.get(name))

    def list(self) -> Iterable[str]:
        return self.inner.list()

    def exists(self, name: str) -> bool:
        return self.inner.exists(name)

    def sizes(self) -> dict[str, int]:
        return self.inner.sizes()

    def describe(self, name: str = "") -> str:
        return self.inner.describe(name)
