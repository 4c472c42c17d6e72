"""Test helpers shipped with distckpt: a multi-rank process runner and the storage test suite."""

from .multiprocess import RankError, run_ranks

__all__ = ["run_ranks", "RankError"]
