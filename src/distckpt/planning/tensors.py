"""Where a tensor's local data sits in its global tensor: plain tensors and DTensors."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CheckpointError
from .resharding import local_box

try:  # DTensor ships with torch.distributed, which some builds lack
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
except ImportError:  # pragma: no cover - torch without distributed
    DTensor = None  # type: ignore[assignment,misc]

__all__ = ["is_dtensor", "local_tensor", "local_view"]


def is_dtensor(obj: Any) -> bool:
    return DTensor is not None and isinstance(obj, DTensor)


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


def local_view(fqn: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Size, tuple[int, ...], tuple[int, ...]]:
    """``(local_tensor, global_size, offsets, sizes)`` of the data this rank holds."""
    if not is_dtensor(tensor):
        return tensor, tensor.shape, (0,) * tensor.dim(), tuple(tensor.shape)
    mesh = tensor.device_mesh
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
    local = local_tensor(tensor)
    if simple:
        offsets, sizes = local_box(tuple(tensor.shape), tuple(mesh.shape), tuple(coord), placements)
    else:  # strided and other composite shardings: torch's own arithmetic
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offs = compute_local_shape_and_global_offset(tensor.shape, mesh, tensor.placements)
        offsets, sizes = tuple(offs), tuple(shape)
    if tuple(local.shape) != sizes:
        raise CheckpointError(f"{fqn}: DTensor local shard has shape {tuple(local.shape)}, expected {sizes} from its placements")
    return local, tensor.shape, offsets, sizes
