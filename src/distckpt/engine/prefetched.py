"""Bytes of a checkpoint's data files read ahead of a load (:mod:`distckpt.prefetching`), and the store through which
the load finds them: each stretch of a read that a prefetched range holds is a memory copy, the rest goes to storage.

A range is bound to the version of its file that it was read from (its size and identity, taken before the read and
found unchanged after it), and so are the chunks the prefetch checked against their checksums in it: a file replaced
since is read from storage again, and its chunks are checked by the load.
"""

from __future__ import annotations

import bisect
import threading
from typing import Iterable, Optional

import torch

from ..errors import CheckpointError, CorruptCheckpointError
from .blobs import MAPS, BlobReader, BlobStore
from .references import ReadOnlyStore

__all__ = ["PrefetchCache", "PrefetchedStore"]


class _FileRanges:
    """One version of a file's prefetched ranges: (start, bytes) sorted by start, none overlapping, and the chunks
    checked in them."""

    def __init__(self, size: int, identity: Optional[tuple]) -> None:
        self.size, self.identity = size, identity
        self.starts: list[int] = []
        self.buffers: list[torch.Tensor] = []
        self.checked: set = set()

    def add(self, start: int, buf: torch.Tensor, checked: set) -> None:
        at = bisect.bisect_left(self.starts, start)
        self.starts.insert(at, start)
        self.buffers.insert(at, buf)
        self.checked |= checked

    def stretch(self, offset: int, n: int) -> tuple[Optional[torch.Tensor], int]:
        """From ``offset``, up to ``n`` bytes: the cached bytes that start there (None where none are), and where
        (relative to ``offset``) the next cached range begins, or ``n``."""
        at = bisect.bisect_right(self.starts, offset) - 1
        if at >= 0:
            start, buf = self.starts[at], self.buffers[at]
            if offset < start + buf.numel():
                end = min(start + buf.numel(), offset + n)
                return buf[offset - start:end - start], end - offset
        following = self.starts[at + 1] if at + 1 < len(self.starts) else None
        return None, n if following is None else min(n, following - offset)

    def holds(self, offset: int, n: int) -> bool:
        """Whether one range holds all of bytes [offset, offset + n)."""
        at = bisect.bisect_right(self.starts, offset) - 1
        return at >= 0 and offset + n <= self.starts[at] + self.buffers[at].numel()


class PrefetchCache:
    """What a prefetch read of one checkpoint (``checkpoint_id``, ``save_id``): ranges of its data files."""

    def __init__(self, checkpoint_id: str, save_id: Optional[str]) -> None:
        self.checkpoint_id, self.save_id = checkpoint_id, save_id
        self.files: dict[str, _FileRanges] = {}
        self.nbytes = 0
        self._lock = threading.Lock()

    def add(self, name: str, size: int, identity: Optional[tuple], start: int, buf: torch.Tensor,
            checked: set = frozenset()) -> None:
        """Bytes of ``name`` from ``start``, read from the version (``size``, ``identity``), and the chunks
        (MetadataIndex) wholly in them that matched their checksums. Another version's ranges go, with their chunks."""
        with self._lock:
            ranges = self.files.get(name)
            if ranges is None or (ranges.size, ranges.identity) != (size, identity):
                if ranges is not None:
                    self.nbytes -= sum(b.numel() for b in ranges.buffers)
                ranges = self.files[name] = _FileRanges(size, identity)
            ranges.add(start, buf, checked)
            self.nbytes += buf.numel()

    def holds(self, name: str, offset: int, n: int) -> bool:
        """Whether bytes [offset, offset + n) of ``name`` were prefetched (of whichever version)."""
        ranges = self.files.get(name)
        return ranges is not None and ranges.holds(offset, n)

    def release(self) -> None:
        with self._lock:
            self.files, self.nbytes = {}, 0


class _PrefetchedReader(BlobReader):
    """A data file's reader that copies what the prefetch holds of this version of it and reads the rest."""

    def __init__(self, name: str, inner: BlobReader, ranges: Optional[_FileRanges], trusted: bool,
                 where: str = "checkpoint") -> None:
        self.inner, self.size = inner, inner.size
        self.small_reads_are_cheap = inner.small_reads_are_cheap
        same = ranges is not None and (ranges.size, ranges.identity) == (inner.size, inner.identity())
        if trusted and not same:  # its prefetched chunks were taken as checked: their bytes must come from memory
            inner.close()
            raise CorruptCheckpointError(f"{where}: data file {name!r} changed while it was being loaded (it was "
                                         "replaced); load again")
        self.ranges = ranges if same else None

    def _fill(self, views: list, offset: int, cached_only: bool) -> Optional[int]:
        """Fill ``views`` from ``offset``: each stretch the prefetch holds from memory, the others from the file
        (where ``cached_only``, up to the first stretch not held). The bytes filled; None where nothing of the
        first stretch is held (the file's own reader then reads it all)."""
        total = sum(len(v) for v in views)
        if self.ranges is None or not total:
            return None
        flat = [memoryview(v).cast("B") for v in views]
        at = 0
        while at < total:
            held, step = self.ranges.stretch(offset + at, total - at)
            if held is not None:
                _copy_into(flat, at, held)
                at += held.numel()
            elif at == 0 and step == total or cached_only:
                return at or None
            else:
                got = self.inner.readv(_slices(flat, at, at + step), offset + at)
                at += got
                if got < step:  # the file ends here
                    break
        return at

    def readinto(self, buf: memoryview, offset: int) -> int:
        got = self._fill([buf], offset, False)
        return self.inner.readinto(buf, offset) if got is None else got

    def readv(self, views: list, offset: int) -> int:
        got = self._fill(views, offset, False)
        return self.inner.readv(views, offset) if got is None else got

    def readv_cached(self, views: list, offset: int) -> Optional[int]:
        got = self._fill(views, offset, True)
        return self.inner.readv_cached(views, offset) if got is None else got

    def identity(self) -> Optional[tuple]:
        return self.inner.identity()

    def close(self) -> None:
        self.inner.close()


def _slices(flat: list, a: int, b: int) -> list:
    """The pieces of the concatenation of ``flat`` from byte ``a`` to ``b``."""
    out, pos = [], 0
    for v in flat:
        n = len(v)
        lo, hi = max(a, pos), min(b, pos + n)
        if lo < hi:
            out.append(v[lo - pos:hi - pos])
        pos += n
        if pos >= b:
            break
    return out


def _copy_into(flat: list, at: int, data: torch.Tensor) -> None:
    """``data`` into the concatenation of ``flat`` from byte ``at``: torch's copy, which runs without the
    interpreter's lock and on its threads (a memoryview's holds the lock, one copy at a time)."""
    done = 0
    for piece in _slices(flat, at, at + data.numel()):
        n = len(piece)
        torch.frombuffer(piece, dtype=torch.uint8).copy_(data[done:done + n])
        done += n


class PrefetchedStore(ReadOnlyStore):
    """A checkpoint's data store, its readers served first from a :class:`PrefetchCache`."""

    def __init__(self, inner: BlobStore, cache: PrefetchCache) -> None:
        self.inner, self.cache = inner, cache
        self.capabilities = inner.capabilities - {MAPS}  # reads go through the readers, where the prefetched bytes are
        self.trusted: set = set()  # files whose prefetched chunks the load takes as checked (verified())

    def holds(self, name: str, offset: int, n: int) -> bool:
        """Whether the prefetch read bytes [offset, offset + n) of ``name``."""
        return self.cache.holds(name, offset, n)

    def verified(self) -> set:
        """The chunks the prefetch checked against their checksums, of files still the version it read (a file
        replaced later fails the load's open of it, instead of handing over bytes no one checked)."""
        out: set = set()
        for name, ranges in self.cache.files.items():
            if not ranges.checked:
                continue
            try:
                blob = self.inner.open(name)
            except CheckpointError:
                continue
            try:
                if (ranges.size, ranges.identity) == (blob.size, blob.identity()):
                    out |= ranges.checked
                    self.trusted.add(name)
            finally:
                blob.close()
        return out

    def open(self, name: str) -> BlobReader:
        return _PrefetchedReader(name, self.inner.open(name), self.cache.files.get(name), name in self.trusted,
                                 self.inner.describe())

    def list(self) -> Iterable[str]:
        return self.inner.list()

    def exists(self, name: str) -> bool:
        return self.inner.exists(name)

    def sizes(self) -> dict[str, int]:
        return self.inner.sizes()

    def describe(self, name: str = "") -> str:
        return self.inner.describe(name)
