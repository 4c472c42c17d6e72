"""Sharing checksum work between the ranks that read parts of one stored chunk.

A chunk's CRC-32C covers the whole chunk, so a rank that needs only part of
it (a load at another world size or sharding) would have to read all of it
to verify it. Instead, during load planning every rank names the chunks it
reads only partly; the coordinator picks one of each chunk's readers to read
it whole and verify it (balancing the bytes each rank verifies), and the
others read just the rows they need. A failed verification fails the load on
every rank, because read failures are shared before load() returns.

Chunks travel as ``(file number, byte offset, length)``: the file number is
the file's position in the metadata's file table, the same on every rank.

A reader that declares ``SHARED_VERIFICATION`` (:mod:`distckpt.capabilities`) gives the load sequence
these steps as its own methods; :class:`SharedVerification` is them, for a reader to inherit.
"""

from __future__ import annotations

import heapq
import struct
from typing import Optional

import numpy as np

from ..errors import CorruptCheckpointError
from ..format.records import FileStorageData
from ..item_columns import ReadColumns
from ..metadata import Metadata, MetadataIndex
from ..planner import LoadItemType, LoadPlan
from .chunk_reads import ChunkShapes

__all__ = ["SharedVerification", "partial_chunks", "encode_chunks", "decode_chunks", "assign_verifiers", "verified_elsewhere"]

_HEAD = struct.Struct("<Q")


def partial_chunks(md: Metadata, plan: LoadPlan) -> list[MetadataIndex]:
    """The stored tensor chunks that ``plan`` reads, but no single item of it reads whole."""
    shapes = ChunkShapes(md)
    whole: dict[MetadataIndex, bool] = {}
    items = plan.items
    if isinstance(items, ReadColumns) and items.intact:
        items = items.general  # a column item reads its chunk whole: only the others can read one in part
    for item in items:
        if item.type != LoadItemType.TENSOR:
            continue
        index = item.storage_index
        covers = whole.get(index) is None and all(o == 0 for o in item.storage_offsets)
        whole[index] = covers and tuple(item.lengths) == (shapes.get(index) or ())
    return [index for index, is_whole in whole.items() if not is_whole]


def encode_chunks(md: Metadata, chunks: list[MetadataIndex]) -> bytes:
    """``chunks`` as three little-endian int64 columns: file number, offset, length."""
    fsd: FileStorageData = md.storage_data
    file_no = {name: i for i, name in enumerate(fsd.files)}
    table = np.empty((3, len(chunks)), dtype="<i8")
    for j, index in enumerate(chunks):
        info = fsd.items[index]
        table[:, j] = (file_no[info.file], info.offset, info.length)
    return _HEAD.pack(len(chunks)) + table.tobytes()


def decode_chunks(raw: bytes) -> np.ndarray:
    """The (3, n) table :func:`encode_chunks` wrote."""
    if len(raw) < _HEAD.size:
        raise CorruptCheckpointError("chunk list from a rank is truncated")
    (n,) = _HEAD.unpack_from(raw)
    if len(raw) != _HEAD.size + 24 * n:
        raise CorruptCheckpointError("chunk list from a rank has the wrong length")
    return np.frombuffer(raw, dtype="<i8", offset=_HEAD.size).reshape(3, n)


def assign_verifiers(tables: list[np.ndarray]) -> list[bytes]:
    """For each rank, one byte per chunk it listed: 1 where it is the rank that verifies that chunk.

    Every chunk listed by any rank gets exactly one verifier among the ranks
    that listed it; larger chunks are placed first, each on the reader that
    has the fewest bytes to verify so far.
    """
    readers: dict[tuple[int, int], list[tuple[int, int]]] = {}
    length: dict[tuple[int, int], int] = {}
    for rank, table in enumerate(tables):
        for j in range(table.shape[1]):
            key = (int(table[0, j]), int(table[1, j]))
            readers.setdefault(key, []).append((rank, j))
            length[key] = int(table[2, j])
    masks = [np.zeros(t.shape[1], dtype=np.uint8) for t in tables]
    load = [0] * len(tables)
    for key in sorted(readers, key=lambda k: (-length[k], k)):
        candidates = readers[key]
        if len(candidates) == 1:
            rank, j = candidates[0]
        else:
            _, rank, j = heapq.nsmallest(1, ((load[r], r, jj) for r, jj in candidates))[0]
        masks[rank][j] = 1
        load[rank] += length[key]
    return [m.tobytes() for m in masks]


def verified_elsewhere(chunks: list[MetadataIndex], mask: bytes) -> set[MetadataIndex]:
    """The chunks of ``chunks`` that another rank verifies (mask byte 0)."""
    if len(mask) != len(chunks):
        raise CorruptCheckpointError("verifier assignment does not match this rank's chunk list")
    return {index for index, mine in zip(chunks, mask) if not mine}


class SharedVerification:
    """The load sequence's steps of shared verification, as a reader's methods (for readers declaring
    ``SHARED_VERIFICATION``). The reader sets ``metadata`` (``set_up_storage_reader``) and ``verify_checksums``,
    and reads the chunks in ``verified_elsewhere`` in part without checking them."""

    metadata: Optional[Metadata] = None
    verify_checksums: bool = True
    verified_elsewhere: frozenset = frozenset()  # set per load by skip_verification

    def partly_read_chunks(self, plan: LoadPlan) -> tuple[list[MetadataIndex], bytes]:
        """The chunks ``plan`` reads only in part (none where nothing is verified), and their table for the
        coordinator. Every rank, after its local plan."""
        chunks = partial_chunks(self.metadata, plan) if self.verify_checksums else []
        return chunks, encode_chunks(self.metadata, chunks)

    def assign_verifiers(self, tables: list[bytes]) -> list[bytes]:
        """Every rank's table of chunks -> one mask per rank: which of its chunks it verifies. Coordinator."""
        return assign_verifiers([decode_chunks(t) for t in tables])

    def accept_verifiers(self, chunks: list[MetadataIndex], mask: bytes) -> None:
        """Skip the verification of ``chunks`` that another rank verifies (``mask`` byte 0). Every rank."""
        self.skip_verification(verified_elsewhere(chunks, mask))

    def skip_verification(self, chunks: set) -> None:
        """Chunks this rank reads only partly and another rank of the load verifies whole."""
        self.verified_elsewhere = set(self.verified_elsewhere) | set(chunks)  # a prefetch's checked chunks stay
