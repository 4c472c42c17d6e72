"""Test helpers shipped with distckpt: a multi-rank process runner, a fault-injecting HTTP proxy and the storage test suite."""

from .fault_proxy import FaultProxy, Rule
from .multiprocess import RankError, RankFailure, run_ranks

__all__ = ["run_ranks", "RankError", "RankFailure", "FaultProxy", "Rule"]
