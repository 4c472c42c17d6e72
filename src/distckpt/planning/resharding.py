"""Chunk and overlap arithmetic. Pure Python on integer tuples: no torch.distributed.

A *box* is ``(offsets, sizes)`` in the coordinates of a global tensor. Saved
chunks and the caller's local shards are boxes; a load reads, for each local
shard, the intersection with every saved chunk that meets it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

__all__ = ["shard_extent", "local_box", "intersect", "Overlap", "overlaps", "volume", "Placement"]

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


def overlaps(
    saved: Sequence[tuple[Sequence[int], Sequence[int]]],
    dest_offsets: Sequence[int],
    dest_sizes: Sequence[int],
) -> list[Overlap]:
    """Every non-empty intersection of the destination box with the saved chunks.

    Offsets in the result are relative to the saved chunk and to the
    destination box. For a 0-d tensor the single saved chunk overlaps fully.
    """
    out = []
    for i, (c_off, c_size) in enumerate(saved):
        box = intersect(c_off, c_size, dest_offsets, dest_sizes)
        if box is None:
            continue
        lo, lengths = box
        out.append(Overlap(
            i,
            tuple(x - c for x, c in zip(lo, c_off)),
            tuple(x - d for x, d in zip(lo, dest_offsets)),
            lengths,
        ))
    return out
