"""DCP's module name for its error type, so ``from ...checkpoint.api import CheckpointException`` ports by
changing the package name alone."""

from .errors import RankFailuresError as CheckpointException
from .errors import WrappedException

__all__ = ["CheckpointException", "WrappedException"]
