"""Reading one stored chunk: its shape from the metadata, its bytes read exactly, its checksum compared, and the
rows a read item wants copied out of a slab of it. Shared by the read engine and the checkers."""

from __future__ import annotations

import mmap
from typing import Union

import torch

from ..errors import CorruptCheckpointError
from ..format.records import StorageInfo
from ..metadata import Metadata, MetadataIndex, TensorStorageMetadata
from ..planner import ReadItem
from .blobs import BlobReader
from .device_copy import PendingCopies, to_device

__all__ = ["ChunkShapes", "check_checksum", "copy_rows", "fresh_buffer", "read_exact", "read_into", "rows_meet"]


def rows_meet(item: ReadItem, a: int, b: int, shape: tuple) -> bool:
    if not shape:
        return True
    r0 = item.storage_offsets[0]
    return max(a, r0) < min(b, r0 + item.lengths[0])


def copy_rows(item: ReadItem, dest: torch.Tensor, slab: torch.Tensor, a: int, b: int, shape: tuple,
               pending: PendingCopies | None) -> None:
    """Copy the part of ``item`` that lies in rows [a, b) of its chunk from ``slab`` into ``dest``.

    With ``pending``, a copy from a pinned slab to a device is only queued there.
    """
    if not shape:
        _copy(dest, slab, pending)
        return
    r0 = item.storage_offsets[0]
    lo, hi = max(a, r0), min(b, r0 + item.lengths[0])
    src = slab.narrow(0, lo - a, hi - lo)
    for dim in range(1, len(shape)):
        src = src.narrow(dim, item.storage_offsets[dim], item.lengths[dim])
    _copy(dest.narrow(0, lo - r0, hi - lo), src, pending)


def _copy(dest: torch.Tensor, src: torch.Tensor, pending: PendingCopies | None) -> None:
    if pending is None:
        dest.copy_(src)
    else:
        to_device(dest, src, pending)


class ChunkShapes:
    """Shapes of stored chunks, looked up by MetadataIndex.

    The ``index`` hint of a MetadataIndex (set by the load planners) finds the
    chunk directly; a key's chunks are scanned into a table only when a hint
    is missing or stale. So a load touches the metadata of the chunks it reads,
    not of every chunk of the checkpoint (at 1,024 ranks a table of all chunks
    took longer than decoding the metadata).
    """

    def __init__(self, md: Metadata) -> None:
        self.md = md
        self.tables: dict[str, dict] = {}

    def get(self, index: MetadataIndex) -> tuple[int, ...] | None:
        """The chunk's shape, or None if the metadata has no such chunk."""
        entry = self.md.state_dict_metadata.get(index.fqn)
        chunks = entry.chunks if isinstance(entry, TensorStorageMetadata) else None
        if not chunks:
            return None
        hint = index.index
        if hint is not None and 0 <= hint < len(chunks) and chunks[hint].offsets == index.offset:
            return tuple(chunks[hint].sizes)
        table = self.tables.get(index.fqn)
        if table is None:
            table = self.tables[index.fqn] = {tuple(c.offsets): tuple(c.sizes) for c in chunks}
        return table.get(tuple(index.offset or ()))


def check_checksum(verify: bool, got: int, info: StorageInfo, here: str, dests: list = ()) -> None:
    """Raise if the checksum of a chunk read differs from the stored one, first zeroing ``dests``:
    bytes that failed their checksum never stay in the caller's tensors."""
    if verify and got != info.crc32c:
        for dest in dests:
            if isinstance(dest, torch.Tensor) and dest.device.type != "meta":
                dest.zero_()
        raise CorruptCheckpointError(
            f"{here}: checksum mismatch in file {info.file!r} at offset {info.offset} ({info.length} bytes): "
            f"stored {info.crc32c:08x}, computed {got:08x}. The data is damaged; restore the file from a copy.")


def read_into(blob: BlobReader, view: memoryview, offset: int, here: str, file: str) -> None:
    got = blob.readinto(view, offset)
    if got != len(view):
        raise CorruptCheckpointError(f"{here}: file {file!r} ends at {offset + got}, before the {len(view)} bytes at offset "
                                     f"{offset}; it is truncated")


MAPPED_BYTES = 1 << 20


def fresh_buffer(n: int) -> Union[bytearray, mmap.mmap]:
    """A writable buffer of ``n`` bytes that gives its memory back when the last view of it goes.

    From :data:`MAPPED_BYTES` up, an anonymous mapping of its own. glibc's malloc raises its mmap threshold to the
    size of the last large block freed (up to 32 MiB) and then serves smaller blocks from its arenas, one per
    thread, each keeping up to twice that size of freed memory: buffers of chunk size made and dropped on 4 threads
    kept 24 MiB resident after the last was freed, and DCP items read under a 32 MiB budget peaked at 1.25x it
    (bench/load_memory.py); a mapping is unmapped when freed."""
    return mmap.mmap(-1, n) if n >= MAPPED_BYTES else bytearray(n)


def read_exact(blob: BlobReader, n: int, offset: int, here: str, file: str) -> Union[bytearray, mmap.mmap]:
    """``n`` bytes at ``offset``, in the buffer they were read into (:func:`fresh_buffer`): a copy into ``bytes``
    would hold the chunk twice at once, beyond the memory budget it was read under."""
    buf = fresh_buffer(n)
    read_into(blob, memoryview(buf), offset, here, file)
    return buf
