"""Default planners and the pure planning math behind them."""

from .flatten import RankLocal, flatten_state_dict
from .load_planner import DefaultLoadPlanner
from .save_planner import DefaultSavePlanner

__all__ = ["DefaultSavePlanner", "DefaultLoadPlanner", "RankLocal", "flatten_state_dict"]
