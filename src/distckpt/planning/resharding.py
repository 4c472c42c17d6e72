"""Chunk and overlap arithmetic. Pure Python on integer tuples: no torch.distributed.

A *box* is ``(offsets, sizes)`` in the coordinates of a global tensor. Saved
chunks and the caller's local shards are boxes; a load reads, for each local
shard, the intersection with every saved chunk that meets it.
"""

from __future__ import annotations

import operator
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

__all__ = ["shard_extent", "local_box", "intersect", "Overlap", "overlaps", "ChunkIndex", "volume", "Placement"]

# A placement on one mesh dimension: ("shard", tensor_dim) or ("replicate",)
Placement = tuple


def shard_extent(dim_size: int, num_shards: int, index: int) -> tuple[int, int]:
    """Offset and length of shard ``index`` when ``dim_size`` is split in ``num_shards``.

    Same rule as ``torch.chunk`` (and DTensor's ``Shard``): every shard has
    ``ceil(dim_size / num_shards)`` elements except the last non-empty one;
    trailing shards may be empty.
    """
    if num_shards <= 0 or not 0 <= index < num_shards:
        raise ValueError(f"shard index {index} out of range for {num_shards} shards")
    step = -(-dim_size // num_shards) if dim_size else 0
    start = min(index * step, dim_size)
    end = min(start + step, dim_size)
    return start, end - start


def local_box(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The box of the global tensor held at ``coordinate`` of a device mesh.

    Mesh dimensions are applied in order; two mesh dimensions sharding the
    same tensor dimension split it successively, as DTensor does.
    """
    offsets = [0] * len(global_shape)
    sizes = list(global_shape)
    for mesh_dim, placement in enumerate(placements):
        if placement[0] == "replicate":
            continue
        if placement[0] != "shard":
            raise ValueError(f"unsupported placement {placement!r}")
        d = placement[1]
        off, length = shard_extent(sizes[d], mesh_shape[mesh_dim], coordinate[mesh_dim])
        offsets[d] += off
        sizes[d] = length
    return tuple(offsets), tuple(sizes)


def volume(sizes: Iterable[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def intersect(
    a_off: Sequence[int], a_size: Sequence[int], b_off: Sequence[int], b_size: Sequence[int]
) -> Optional[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The intersection box of two boxes, or None if they do not meet (or it is empty)."""
    offs, sizes = [], []
    for ao, asz, bo, bsz in zip(a_off, a_size, b_off, b_size):
        lo = max(ao, bo)
        hi = min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offs.append(lo)
        sizes.append(hi - lo)
    return tuple(offs), tuple(sizes)


@dataclass(frozen=True)
class Overlap:
    """A box to copy: from saved chunk ``chunk_index`` at ``storage_offsets`` into the
    destination at ``dest_offsets``, ``lengths`` long in each dimension."""

    chunk_index: int
    storage_offsets: tuple[int, ...]
    dest_offsets: tuple[int, ...]
    lengths: tuple[int, ...]


def _overlap(i: int, c_off: Sequence[int], c_size: Sequence[int], dest_offsets: Sequence[int],
             dest_sizes: Sequence[int]) -> Optional[Overlap]:
    box = intersect(c_off, c_size, dest_offsets, dest_sizes)
    if box is None:
        return None
    lo, lengths = box
    return Overlap(i, tuple(x - c for x, c in zip(lo, c_off)), tuple(x - d for x, d in zip(lo, dest_offsets)), lengths)


def overlaps(
    saved: Sequence[tuple[Sequence[int], Sequence[int]]],
    dest_offsets: Sequence[int],
    dest_sizes: Sequence[int],
) -> list[Overlap]:
    """Every non-empty intersection of the destination box with the saved chunks, in chunk order.

    Offsets in the result are relative to the saved chunk and to the
    destination box. For a 0-d tensor the single saved chunk overlaps fully.
    """
    out = []
    for i, (c_off, c_size) in enumerate(saved):
        ov = _overlap(i, c_off, c_size, dest_offsets, dest_sizes)
        if ov is not None:
            out.append(ov)
    return out


class ChunkIndex:
    """The saved chunks of one tensor (objects with ``offsets`` and ``sizes``, such as
    ChunkStorageMetadata), indexed so that :meth:`overlaps` looks only at chunks
    that may meet the destination.

    At thousands of ranks a tensor has thousands of chunks and each rank's
    shard meets one or two of them; scanning them all for every key cost
    seconds per rank. Chunks are ordered by their start in the first
    dimension where starts differ (checkpoints list them in that order
    already; otherwise they are sorted); a chunk meets ``[lo, hi)`` there only
    if its start lies in ``(lo - longest chunk, hi)``, found by bisection. The
    result equals :func:`overlaps` on the same chunks.
    """

    def __init__(self, chunks: Sequence) -> None:
        self.chunks = chunks
        self.dim: Optional[int] = None
        if len(chunks) < 8:
            return  # a scan is as fast
        try:
            for d in range(len(chunks[0].offsets)):
                starts = [c.offsets[d] for c in chunks]
                if min(starts) != max(starts):
                    break
            else:
                return  # every chunk starts at the same place in every dimension: scan
            self.reach = max([c.sizes[d] for c in chunks])
            self.order: Optional[list[int]] = None
            if not all(map(operator.le, starts, starts[1:])):
                self.order = sorted(range(len(starts)), key=starts.__getitem__)
                starts = [starts[i] for i in self.order]
        except (IndexError, TypeError):
            return  # malformed chunks: the scan meets them as they are
        self.dim, self.starts = d, starts

    def overlaps(self, dest_offsets: Sequence[int], dest_sizes: Sequence[int]) -> list[Overlap]:
        """What :func:`overlaps` returns for these chunks' boxes."""
        d = self.dim
        if d is None or len(dest_offsets) <= d:
            return overlaps([(c.offsets, c.sizes) for c in self.chunks], dest_offsets, dest_sizes)
        lo = bisect_right(self.starts, dest_offsets[d] - self.reach)
        hi = bisect_left(self.starts, dest_offsets[d] + dest_sizes[d])
        out = []
        for i in range(lo, hi) if self.order is None else sorted(self.order[lo:hi]):
            c = self.chunks[i]
            ov = _overlap(i, c.offsets, c.sizes, dest_offsets, dest_sizes)
            if ov is not None:
                out.append(ov)
        return out
