"""DCP's module of plan helpers: comparing and merging cached save plans, and the reads of a tensor's chunks.

Code written for DCP's planner helpers runs on these after an import change; distckpt's own planners
do the same work in :mod:`distckpt.planning`.
"""

from __future__ import annotations

import torch

from .metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from .planner import LoadItemType, ReadItem, SavePlan
from .planning.resharding import overlaps

__all__ = ["create_read_items_for_chunk_list", "_compare_save_plans", "_merge_delta_local_plans"]


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


def _compare_save_plans(plan: SavePlan, other_plan: SavePlan) -> bool:
    """Whether two save plans write the same items the same way (their storage data aside)."""
    if plan.usable != other_plan.usable or len(plan.items) != len(other_plan.items):
        return False
    return all(a.index == b.index and a.type == b.type and a.tensor_data == b.tensor_data
               for a, b in zip(plan.items, other_plan.items)) and plan.planner_data == other_plan.planner_data


def _merge_delta_local_plans(cached_plans: list[SavePlan], delta_plans: list[SavePlan]) -> list[SavePlan]:
    """Each rank's plan: the new one where the rank sent one, the cached one where it sent ``usable=False``."""
    return [cached if not delta.usable else delta for cached, delta in zip(cached_plans, delta_plans)]
