"""DCP's plan-building helpers, made of distckpt's planners: the bodies of the DCP-named modules
``default_planner``, ``planner_helpers`` and ``_dedup_save_plans``.

The functions build plans with :class:`DefaultSavePlanner` and :class:`DefaultLoadPlanner` on an unflattened state
dict, so a custom planner written against DCP's helpers gets the plans distckpt's planners make. Names DCP keeps
private (``_validate_global_plan``, ...) are public here; the DCP-named modules give them DCP's names.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..errors import CheckpointError
from ..format.locations import check_cover, checked_chunk
from ..metadata import (
    STATE_DICT_TYPE,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from ..planner import LoadItemType, LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem, WriteItemType
from .dedup import dedup_and_balance
from .load_planner import DefaultLoadPlanner
from .resharding import overlaps
from .save_planner import DefaultSavePlanner, build_metadata
from .tensors import dtype_of, is_sharded_tensor

__all__ = [
    "create_default_local_save_plan",
    "create_default_global_save_plan",
    "create_default_local_load_plan",
    "create_default_global_load_plan",
    "validate_global_plan",
    "create_default_local_metadata",
    "create_read_items_for_chunk_list",
    "compare_save_plans",
    "merge_delta_local_plans",
    "dedup_save_plans",
]


def create_default_local_save_plan(state_dict: dict[str, Any], is_coordinator: bool) -> SavePlan:
    """One write item per tensor (per local shard) and per value of ``state_dict`` (keys used as they are)."""
    planner = DefaultSavePlanner(flatten_state_dict=False)
    planner.set_up_planner(state_dict, is_coordinator=is_coordinator)
    return planner.create_local_plan()


def create_default_global_save_plan(all_plans: list[SavePlan], rewrite_index_hints: bool = True) -> tuple[list[SavePlan], Metadata]:
    """The metadata of ``all_plans`` (no deduplication); with ``rewrite_index_hints`` each tensor item's index
    hint is set to its chunk's position in the metadata."""
    metadata = build_metadata(all_plans)
    if not rewrite_index_hints:
        return all_plans, metadata
    out = []
    for plan in all_plans:
        items = []
        for item in plan.items:
            md = metadata.state_dict_metadata.get(item.index.fqn)
            if isinstance(md, TensorStorageMetadata) and item.index.offset is not None:
                hint = next(i for i, c in enumerate(md.chunks) if tuple(c.offsets) == tuple(item.index.offset))
                item = replace(item, index=MetadataIndex(item.index.fqn, item.index.offset, hint))
            items.append(item)
        out.append(replace(plan, items=items))
    return out, metadata


def create_default_local_load_plan(state_dict: dict[str, Any], metadata: Metadata, strict: bool = True) -> LoadPlan:
    """The reads that fill ``state_dict`` (keys used as they are) from a checkpoint described by ``metadata``;
    with ``strict=False`` keys the checkpoint lacks are skipped."""
    planner = DefaultLoadPlanner(flatten_state_dict=False, allow_partial_load=not strict)
    planner.set_up_planner(state_dict, metadata, is_coordinator=False)
    return planner.create_local_plan()


def create_default_global_load_plan(all_plans: list[LoadPlan]) -> list[LoadPlan]:
    """Loads need no global coordination: the plans as they are."""
    return all_plans


def validate_global_plan(global_plan: list[SavePlan], metadata: Metadata) -> bool:
    """Whether every tensor of ``metadata`` is covered exactly once by chunks inside its bounds (DCP's check;
    distckpt's writers run the same check, raising, before any commit)."""
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        try:
            for chunk in entry.chunks:
                checked_chunk(chunk, entry.size, f"key {fqn!r}")
            check_cover(entry.chunks, entry.size, f"key {fqn!r}")
        except CheckpointError:
            return False
    return True


def create_default_local_metadata(state_dict: STATE_DICT_TYPE) -> Metadata:
    """The metadata of a checkpoint of ``state_dict`` saved with the default planner, as far as this rank can
    tell: a ShardedTensor's every shard (its metadata lists them all), other tensors' local blocks."""
    plan = create_default_local_save_plan(state_dict, True)
    items = [i for i in plan.items if not is_sharded_tensor(state_dict.get(i.index.fqn))]
    for fqn, obj in state_dict.items():
        if is_sharded_tensor(obj):
            dtype, requires_grad = dtype_of(obj)
            props = TensorProperties(dtype=dtype, requires_grad=requires_grad)
            for shard in obj.metadata().shards_metadata:
                chunk = ChunkStorageMetadata(torch.Size(shard.shard_offsets), torch.Size(shard.shard_sizes))
                items.append(WriteItem(MetadataIndex(fqn, shard.shard_offsets), WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(chunk, props, torch.Size(obj.metadata().size))))
    _, metadata = create_default_global_save_plan([replace(plan, items=items)])
    return metadata


def create_read_items_for_chunk_list(fqn: str, checkpoint_md: TensorStorageMetadata,
                                     local_chunks: list[ChunkStorageMetadata]) -> list[ReadItem]:
    """The reads that fill ``local_chunks`` of tensor ``fqn`` from the chunks ``checkpoint_md`` lists: one per
    non-empty intersection, in local-chunk then stored-chunk order."""
    saved = [(c.offsets, c.sizes) for c in checkpoint_md.chunks]
    items = []
    for idx, chunk in enumerate(local_chunks):
        for ov in overlaps(saved, chunk.offsets, chunk.sizes):
            stored = checkpoint_md.chunks[ov.chunk_index]
            items.append(ReadItem(LoadItemType.TENSOR, MetadataIndex(fqn, chunk.offsets, idx), torch.Size(ov.dest_offsets),
                                  MetadataIndex(fqn, stored.offsets, ov.chunk_index), torch.Size(ov.storage_offsets),
                                  torch.Size(ov.lengths)))
    return items


def compare_save_plans(plan: SavePlan, other_plan: SavePlan) -> bool:
    """Whether two save plans write the same items the same way (their storage data aside)."""
    if plan.usable != other_plan.usable or len(plan.items) != len(other_plan.items):
        return False
    return all(a.index == b.index and a.type == b.type and a.tensor_data == b.tensor_data
               for a, b in zip(plan.items, other_plan.items)) and plan.planner_data == other_plan.planner_data


def merge_delta_local_plans(cached_plans: list[SavePlan], delta_plans: list[SavePlan]) -> list[SavePlan]:
    """Each rank's plan: the new one where the rank sent one, the cached one where it sent ``usable=False``."""
    return [cached if not delta.usable else delta for cached, delta in zip(cached_plans, delta_plans)]


def dedup_save_plans(all_plans: list[SavePlan], save_to_lowest_rank: bool = False) -> list[SavePlan]:
    """Keep one copy of each item several ranks hold: on the least loaded holder, or with
    ``save_to_lowest_rank`` on the lowest-numbered one (DCP's option)."""
    if not save_to_lowest_rank:
        return dedup_and_balance(all_plans)
    kept: set = set()
    out = []
    for plan in all_plans:
        items = [item for item in plan.items if item.index not in kept]
        kept.update(item.index for item in items)
        out.append(replace(plan, items=items))
    return out
