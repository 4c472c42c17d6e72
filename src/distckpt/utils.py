"""DCP's ``torch.distributed.checkpoint.utils`` lookups, for planners and storage layers written against it: the
object of a state dict that a :class:`~distckpt.metadata.MetadataIndex` names (a DTensor's or ShardedTensor's local
shard at the index's offsets)."""

from __future__ import annotations

from typing import Any

import torch

from .errors import StateDictLookupError
from .metadata import STATE_DICT_TYPE, MetadataIndex
from .planning.tensors import is_sharded_tensor, local_tensor

__all__ = ["find_state_dict_object", "find_tensor_shard"]


def find_state_dict_object(state_dict: STATE_DICT_TYPE, index: MetadataIndex) -> Any:
    """The object ``index`` names in the flat ``state_dict``: a value, a tensor, or a sharded tensor's local shard."""
    if index.fqn not in state_dict:
        raise StateDictLookupError(f"Could not find FQN: {index.fqn!r} in the state dict (its keys are the flat, dotted ones)")
    obj = state_dict[index.fqn]
    if isinstance(obj, torch.Tensor):
        return find_tensor_shard(obj, index)
    if index.offset is not None:
        raise StateDictLookupError(f"FQN {index.fqn!r} is a {type(obj).__name__}, not a ShardedTensor: it has no shard at "
                                   f"offset {list(index.offset)}")
    return obj


def find_tensor_shard(tensor: torch.Tensor, index: MetadataIndex) -> torch.Tensor:
    """The local data of ``tensor`` that ``index`` names: a ShardedTensor's shard at ``index.offset`` (``index.index``
    tried first), a DTensor's local shard, or a plain tensor itself (at offset 0 only)."""
    if is_sharded_tensor(tensor):
        if index.offset is None:
            raise StateDictLookupError(f"Cannot look up {index.fqn!r}: it is a ShardedTensor and no offset was provided")
        shards = tensor.local_shards()
        want = torch.Size(index.offset)
        if index.index is not None and 0 <= index.index < len(shards) and torch.Size(shards[index.index].metadata.shard_offsets) == want:
            return shards[index.index].tensor
        for shard in shards:
            if torch.Size(shard.metadata.shard_offsets) == want:
                return shard.tensor
        raise StateDictLookupError(f"Could not find shard at {list(want)} for FQN {index.fqn!r} among this rank's local shards")
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        return local_tensor(tensor)
    if index.offset is not None and any(index.offset):
        raise StateDictLookupError(f"FQN {index.fqn!r} is not a ShardedTensor, can't find a shard by offset {list(index.offset)}")
    return tensor
