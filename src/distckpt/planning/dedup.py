"""Global save planning: dedup of replicated items and balancing of write load.

Runs on the coordinator only, in O(n log n) over all items of all ranks.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from ..errors import CheckpointError
from ..planner import SavePlan, WriteItem


def item_bytes(item: WriteItem) -> int:
    size = item.chunk_storage_size()
    if size is not None:
        return size
    return item.bytes_io_data.nbytes if item.bytes_io_data is not None else 0


def dedup_and_balance(all_plans: list[SavePlan]) -> list[SavePlan]:
    """Keep one copy of every item held by several ranks, giving it to the least loaded holder.

    Items unique to one rank stay there. Shared items are placed largest
    first, each on whichever of its holders has the fewest bytes so far.
    """
    holders: dict = defaultdict(list)
    first: dict = {}
    for rank, plan in enumerate(all_plans):
        for item in plan.items:
            holders[item.index].append(rank)
            if item.index not in first:
                first[item.index] = item
            else:
                _check_consistent(first[item.index], item, holders[item.index][0], rank)
    load = [0] * len(all_plans)
    shared = []
    for index, ranks in holders.items():
        if len(ranks) == 1:
            load[ranks[0]] += item_bytes(first[index])
        else:
            shared.append(index)
    shared.sort(key=lambda ix: (-item_bytes(first[ix]), ix.fqn))
    owner: dict = {}
    for index in shared:
        ranks = holders[index]
        best = min(ranks, key=lambda r: (load[r], r))
        owner[index] = best
        load[best] += item_bytes(first[index])
    out = []
    for rank, plan in enumerate(all_plans):
        kept = [it for it in plan.items if owner.get(it.index, rank) == rank]
        out.append(replace(plan, items=kept))
    return out


def _check_consistent(a: WriteItem, b: WriteItem, rank_a: int, rank_b: int) -> None:
    ta, tb = a.tensor_data, b.tensor_data
    same = a.type == b.type and (ta is None) == (tb is None)
    if same and ta is not None:
        same = ta.size == tb.size and ta.chunk == tb.chunk and ta.properties.dtype == tb.properties.dtype
    if not same:
        desc = lambda it: "a non-tensor value" if it.tensor_data is None else (
            f"a {it.tensor_data.properties.dtype} tensor of size {list(it.tensor_data.size)}")
        raise CheckpointError(
            f"key {a.index.fqn!r} is {desc(a)} on rank {rank_a} but {desc(b)} on rank {rank_b}. "
            "Values under one key on several ranks are taken as replicas and written once; "
            "wrap rank-specific values in distckpt.RankLocal(...) to keep each rank's copy."
        )
