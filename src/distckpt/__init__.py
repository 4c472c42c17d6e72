"""distckpt: distributed checkpointing of PyTorch training state.

Fast, pickle-free, verifiable checkpoints of plain tensors, sharded DTensors,
non-tensor values and Stateful objects, across any number of ranks, loadable
at any other world size or sharding.
"""

from . import metadata, planner, storage
from .backends import FileSystemReader, FileSystemWriter, MemoryReader, MemoryWriter
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DTypeMismatchError,
    FormatVersionError,
    InvalidStepError,
    MissingKeyError,
    NotRegularFileError,
    StagingMemoryError,
    RankFailuresError,
    ShapeMismatchError,
    StorageIOError,
    UnsafeValueError,
    UnsupportedTensorError,
)
from .loading import load, read_metadata
from .manager import CheckpointManager
from .optim import init_optimizer_state
from .planning import DefaultLoadPlanner, DefaultSavePlanner, RankLocal
from .saving import save
from .staging import AsyncSaveHandle, async_save, release_buffers
from .stateful import Stateful
from .verification import VerifyReport, verify

__version__ = "0.1.0"

__all__ = [
    "save",
    "async_save",
    "AsyncSaveHandle",
    "release_buffers",
    "load",
    "read_metadata",
    "CheckpointManager",
    "verify",
    "VerifyReport",
    "DefaultSavePlanner",
    "DefaultLoadPlanner",
    "FileSystemWriter",
    "FileSystemReader",
    "MemoryWriter",
    "MemoryReader",
    "Stateful",
    "RankLocal",
    "init_optimizer_state",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "DTypeMismatchError",
    "FormatVersionError",
    "InvalidStepError",
    "MissingKeyError",
    "NotRegularFileError",
    "StagingMemoryError",
    "RankFailuresError",
    "ShapeMismatchError",
    "StorageIOError",
    "UnsafeValueError",
    "UnsupportedTensorError",
    "metadata",
    "planner",
    "storage",
]
