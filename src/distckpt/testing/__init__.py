"""Test helpers shipped with distckpt: a multi-rank process runner and the storage test suite."""

from .multiprocess import RankError, RankFailure, run_ranks

__all__ = ["run_ranks", "RankError", "RankFailure"]
