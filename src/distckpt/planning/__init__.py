"""Default planners, the re-layout planners, and the pure planning math behind them."""

from .flatten import RankLocal, flatten_state_dict
from .load_planner import DefaultLoadPlanner
from .relayout import Drop, Fuse, Relayout, Rename, Split, Stack, Unstack
from .relayout_planners import RelayoutLoadPlanner, RelayoutSavePlanner
from .save_planner import DefaultSavePlanner

__all__ = ["DefaultSavePlanner", "DefaultLoadPlanner", "RankLocal", "flatten_state_dict", "Relayout", "Rename", "Fuse", "Split",
           "Stack", "Unstack", "Drop", "RelayoutLoadPlanner", "RelayoutSavePlanner"]
