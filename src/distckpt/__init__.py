"""distckpt: distributed checkpointing of PyTorch training state.

Fast, pickle-free, verifiable checkpoints of plain tensors, sharded DTensors,
non-tensor values and Stateful objects, across any number of ranks, loadable
at any other world size or sharding.
"""

from . import convert, metadata, planner, storage
from .backends import DCPReader, FileSystemReader, FileSystemWriter, MemoryReader, MemoryWriter
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DTypeMismatchError,
    FormatVersionError,
    InvalidStepError,
    MissingKeyError,
    NotRegularFileError,
    RankFailuresError,
    RemoteRankError,
    ShapeMismatchError,
    StagingMemoryError,
    StorageIOError,
    UnsafeValueError,
    UnsupportedTensorError,
    WrappedException,
)
from .format.stream_transforms import ExtensionRegistry, StreamTransformExtension, ZStandard
from .loading import load, load_state_dict, read_metadata
from .manager import CheckpointManager
from .metadata import BytesStorageMetadata, ChunkStorageMetadata, Metadata, TensorStorageMetadata
from .optim import init_optimizer_state
from .planner import LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner, WriteItem
from .planning import DefaultLoadPlanner, DefaultSavePlanner, RankLocal
from .saving import save, save_state_dict
from .staging import AsyncSaveHandle, async_save, release_buffers
from .stateful import Stateful
from .storage import StorageReader, StorageWriter
from .verification import VerifyReport, verify

#: DCP's name for the error every rank raises when a collective phase failed somewhere.
CheckpointException = RankFailuresError

__version__ = "0.1.0"

__all__ = [
    "save",
    "async_save",
    "AsyncSaveHandle",
    "release_buffers",
    "load",
    "read_metadata",
    "save_state_dict",
    "load_state_dict",
    "CheckpointManager",
    "verify",
    "VerifyReport",
    "DefaultSavePlanner",
    "DefaultLoadPlanner",
    "FileSystemWriter",
    "FileSystemReader",
    "DCPReader",
    "MemoryWriter",
    "MemoryReader",
    "ZStandard",
    "StreamTransformExtension",
    "ExtensionRegistry",
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
    "CheckpointException",
    "RemoteRankError",
    "WrappedException",
    "ShapeMismatchError",
    "StorageIOError",
    "UnsafeValueError",
    "UnsupportedTensorError",
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "SavePlanner",
    "LoadPlanner",
    "SavePlan",
    "LoadPlan",
    "WriteItem",
    "ReadItem",
    "StorageWriter",
    "StorageReader",
    "metadata",
    "planner",
    "storage",
    "convert",
]
