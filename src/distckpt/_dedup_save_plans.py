"""DCP's module name for deduplicating replicated items across ranks' save plans."""

from __future__ import annotations

from dataclasses import replace

from .planner import SavePlan
from .planning.dedup import dedup_and_balance

__all__ = ["dedup_save_plans"]


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
