"""DCP's module of plan helpers: comparing and merging cached save plans, and the reads of a tensor's chunks.

Code written for DCP's planner helpers runs on these after an import change; the bodies live in
:mod:`distckpt.planning` (``dcp_helpers.py``).
"""

from .planning.dcp_helpers import compare_save_plans as _compare_save_plans
from .planning.dcp_helpers import create_read_items_for_chunk_list
from .planning.dcp_helpers import merge_delta_local_plans as _merge_delta_local_plans

__all__ = ["create_read_items_for_chunk_list", "_compare_save_plans", "_merge_delta_local_plans"]
