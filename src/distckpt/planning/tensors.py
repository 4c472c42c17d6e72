"""Where a tensor's local data sits in its global tensor: plain tensors and DTensors."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from ..errors import CheckpointError
from .resharding import local_box

try:  # DTensor and ShardedTensor ship with torch.distributed, which some builds lack
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
except ImportError:  # pragma: no cover - torch without distributed
    DTensor = None  # type: ignore[assignment,misc]
try:
    from torch.distributed._shard.sharded_tensor import Shard as LocalShard
    from torch.distributed._shard.sharded_tensor import ShardedTensor
except ImportError:  # pragma: no cover
    ShardedTensor = None  # type: ignore[assignment,misc]

__all__ = ["is_dtensor", "is_sharded_tensor", "local_tensor", "local_view", "local_boxes", "local_pieces", "piece_at", "dtype_of",
           "with_local_shards",
           "check_no_aliasing"]

#: One block of a tensor this rank holds: its data, and where it sits in the global tensor.
Piece = tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]


def is_dtensor(obj: Any) -> bool:
    return DTensor is not None and isinstance(obj, DTensor)


def held_alone(obj: Any) -> bool:
    """Whether no other rank holds any element of ``obj``'s local part: a DTensor sharded along every mesh
    dimension of more than one rank, or a ShardedTensor (whose shards do not overlap)."""
    if is_sharded_tensor(obj):
        return True
    if not is_dtensor(obj):
        return False
    mesh = obj.device_mesh
    return all(p.is_shard() or mesh.size(dim) == 1 for dim, p in enumerate(obj.placements))


def is_sharded_tensor(obj: Any) -> bool:
    """A ShardedTensor (FSDP1's SHARDED_STATE_DICT, torch.distributed._shard): several local shards per rank."""
    return ShardedTensor is not None and isinstance(obj, ShardedTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory holds this rank's data: a DTensor's local shard, else ``tensor`` itself.

    Taken with autograd off: ``to_local()`` then skips building a graph node
    (0.1 us instead of 6 us, which adds up over tens of thousands of sharded
    optimizer-state tensors), and writes into the result land in the shard.
    """
    if not is_dtensor(tensor):
        return tensor
    with torch.no_grad():
        return tensor.to_local()


def local_boxes() -> dict:
    """A memo for :func:`local_pieces` over one state dict: DTensors of one mesh, placements and shape (a
    model's layers) hold the same box, worked out once."""
    return {}


def local_pieces(fqn: str, tensor: torch.Tensor, boxes: Optional[dict] = None) -> tuple[torch.Size, list[Piece]]:
    """``(global_size, pieces)``: every block of ``tensor`` this rank holds. A plain tensor is one piece; a
    DTensor one, or none on a rank outside its mesh; a ShardedTensor one per local shard. ``boxes``: a memo
    from :func:`local_boxes`, for the tensors of one state dict."""
    if is_sharded_tensor(tensor):
        pieces = []
        for shard in tensor.local_shards():
            offsets, sizes = tuple(shard.metadata.shard_offsets), tuple(shard.metadata.shard_sizes)
            if tuple(shard.tensor.shape) != sizes:
                raise CheckpointError(f"{fqn}: ShardedTensor local shard has shape {tuple(shard.tensor.shape)}, its "
                                      f"metadata says {sizes}")
            pieces.append((shard.tensor, offsets, sizes))
        return torch.Size(tensor.metadata().size), pieces
    if is_dtensor(tensor) and tensor.device_mesh.get_coordinate() is None:
        return tensor.shape, []  # a sub-mesh DTensor on a rank outside its mesh holds no shard
    local, global_size, offsets, sizes = local_view(fqn, tensor, boxes)
    return torch.Size(global_size), [(local, offsets, sizes)]


def with_local_shards(tensor: Any, local: list[torch.Tensor]) -> Any:
    """The ShardedTensor ``tensor`` with its local shards' data replaced by ``local`` (same order, same shapes)."""
    shards = [LocalShard(data, shard.metadata) for data, shard in zip(local, tensor.local_shards())]
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, tensor.metadata(),
                                                                     process_group=tensor._process_group)


def dtype_of(tensor: torch.Tensor) -> tuple[torch.dtype, bool]:
    """``(dtype, requires_grad)`` of a tensor, a DTensor or a ShardedTensor (whose attributes live in its metadata)."""
    if is_sharded_tensor(tensor):
        props = tensor.metadata().tensor_properties
        return props.dtype, props.requires_grad
    return tensor.dtype, tensor.requires_grad


def piece_at(fqn: str, tensor: torch.Tensor, offsets: Any) -> torch.Tensor:
    """The local data of ``tensor`` whose block starts at ``offsets`` (its only one, unless a ShardedTensor)."""
    if not is_sharded_tensor(tensor):
        return local_tensor(tensor)
    want = tuple(offsets or ())
    for shard in tensor.local_shards():
        if tuple(shard.metadata.shard_offsets) == want:
            return shard.tensor
    raise CheckpointError(f"{fqn}: this rank holds no shard of the ShardedTensor at offsets {list(want)}")


def local_view(fqn: str, tensor: torch.Tensor, boxes: Optional[dict] = None
               ) -> tuple[torch.Tensor, torch.Size, tuple[int, ...], tuple[int, ...]]:
    """``(local_tensor, global_size, offsets, sizes)`` of the data this rank holds (``boxes``: as for
    :func:`local_pieces`)."""
    if not is_dtensor(tensor):
        return tensor, tensor.shape, (0,) * tensor.dim(), tuple(tensor.shape)
    mesh = tensor.device_mesh
    box = key = None
    if boxes is not None:  # the mesh is alive while the memo is: its id names it
        try:
            key = (id(mesh), tensor.placements, tensor.shape)
            box = boxes.get(key)
        except TypeError:  # a placement that cannot be hashed: no memo
            key = None
    if box is None:
        box = _local_box(fqn, tensor, mesh)
        if key is not None:
            boxes[key] = box
    local = local_tensor(tensor)
    if tuple(local.shape) != box[1]:
        raise CheckpointError(f"{fqn}: DTensor local shard has shape {tuple(local.shape)}, expected {box[1]} from its placements")
    return local, tensor.shape, box[0], box[1]


def _local_box(fqn: str, tensor: torch.Tensor, mesh: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The offsets and sizes of the block of a DTensor this rank holds, from its placements."""
    coord = mesh.get_coordinate()
    if coord is None:
        raise CheckpointError(f"{fqn}: this rank is not part of the DTensor's device mesh")
    placements = []
    simple = True
    for p in tensor.placements:
        if isinstance(p, Partial):
            raise CheckpointError(f"{fqn}: DTensor has a Partial placement; reduce it (redistribute to Replicate or Shard) before saving")
        if type(p) is Shard:
            placements.append(("shard", p.dim))
        elif isinstance(p, Replicate):
            placements.append(("replicate",))
        else:
            simple = False
    if simple:
        return local_box(tuple(tensor.shape), tuple(mesh.shape), tuple(coord), placements)
    # strided and other composite shardings: torch's own arithmetic
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offs = compute_local_shape_and_global_offset(tensor.shape, mesh, tensor.placements)
    return tuple(offs), tuple(shape)


def check_no_aliasing(named: list[tuple[str, torch.Tensor]], spans: list = ()) -> None:
    """Raise CheckpointError if two destinations (local data: shards, not DTensors) share memory, unless they are the very same view
    (tied weights: one tensor under two keys loads the same bytes twice, harmlessly).

    Destinations that overlap otherwise would overwrite each other's bytes during a load, and
    a checksum computed on the destination would then fail on an intact checkpoint. ``spans``
    holds destinations already measured as (key, tensor, first byte, end): contiguous CPU tensors
    whose caller had them at hand (reading a tensor's fields costs most when it is read apart).
    """
    keys, tensors, lows, highs = (list(column) for column in zip(*spans)) if spans else ([], [], [], [])
    for key, t in named:
        if t.is_meta:
            continue
        nbytes = t.nbytes
        if not nbytes:
            continue
        if t.is_contiguous():
            lo = t.data_ptr()
            hi = lo + nbytes
        else:
            strides = t.stride()
            if min(strides) < 0:
                continue
            lo = t.data_ptr()
            hi = lo + (sum((n - 1) * s for n, s in zip(t.shape, strides)) + 1) * t.element_size()
        keys.append(key)
        tensors.append(t)
        lows.append(lo)
        highs.append(hi)
    if len(lows) < 2:
        return
    # sorted by start, a span that starts before the furthest end of those before it overlaps one of them
    lo_a, hi_a = np.array(lows, dtype=np.int64), np.array(highs, dtype=np.int64)
    order = np.argsort(lo_a, kind="stable")
    reach = np.maximum.accumulate(hi_a[order])
    suspects = np.flatnonzero(lo_a[order][1:] < reach[:-1]) + 1
    if not suspects.size:
        return
    spans = [(lows[i], highs[i], keys[i], tensors[i]) for i in order.tolist()]
    for i in suspects.tolist():
        _check_against_earlier(spans, i)


def _check_against_earlier(spans: list, i: int) -> None:
    lo, _, key, t = spans[i]
    for j in range(i - 1, -1, -1):
        o_lo, o_hi, other_key, other = spans[j]
        if o_hi > lo and other.device == t.device and _share_elements(other, t):
            raise CheckpointError(
                f"the destinations of keys {other_key!r} and {key!r} share memory (one is a view overlapping the "
                "other), so loading either would overwrite the other; load into separate tensors, then copy")


def _share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors whose memory extents overlap share an element (identical views do not count)."""
    if (a.data_ptr(), a.shape, a.stride(), a.dtype) == (b.data_ptr(), b.shape, b.stride(), b.dtype):
        return False
    if a.is_contiguous() and b.is_contiguous():
        return True
    k = a.element_size()
    base = min(a.data_ptr(), b.data_ptr())
    extent = (max(a.data_ptr() + (sum((n - 1) * s for n, s in zip(a.shape, a.stride())) + 1) * k,
                  b.data_ptr() + (sum((n - 1) * s for n, s in zip(b.shape, b.stride())) + 1) * b.element_size()) - base)
    if b.element_size() != k or (a.data_ptr() - base) % k or (b.data_ptr() - base) % k or extent > (256 << 20):
        return True  # interleaved views of different layouts: taken as sharing, to be safe
    count = torch.zeros(extent // k + 1, dtype=torch.int32)
    for t in (a, b):
        count.as_strided(t.shape, t.stride(), (t.data_ptr() - base) // k).add_(1)
    return bool(count.gt(1).any())
