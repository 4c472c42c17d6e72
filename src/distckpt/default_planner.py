"""DCP's module of the default planners and of the plan-building functions they are made of.

The bodies live in :mod:`distckpt.planning` (``dcp_helpers.py``); this module keeps DCP's names.
"""

from .planning import DefaultLoadPlanner, DefaultSavePlanner
from .planning.dcp_helpers import (
    create_default_global_load_plan,
    create_default_global_save_plan,
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from .planning.dcp_helpers import create_default_local_metadata as _create_default_local_metadata  # noqa: F401 - DCP's private name
from .planning.dcp_helpers import validate_global_plan as _validate_global_plan  # noqa: F401 - DCP's private name

__all__ = [
    "DefaultSavePlanner",
    "DefaultLoadPlanner",
    "create_default_local_save_plan",
    "create_default_global_save_plan",
    "create_default_local_load_plan",
    "create_default_global_load_plan",
]
