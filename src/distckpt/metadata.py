"""Checkpoint metadata types of the protocol.

These are the types a checkpoint's global metadata is made of. They keep the
names and fields of the protocol so that planners and storage layers written
against it work unchanged. How they are stored on disk is decided by
:mod:`distckpt.format.codec` (JSON, never pickle).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch

__all__ = [
    "ChunkStorageMetadata",
    "TensorProperties",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "MetadataIndex",
    "StorageMeta",
    "Metadata",
    "STATE_DICT_TYPE",
    "STORAGE_TYPES",
]

STATE_DICT_TYPE = dict[str, Any]


@dataclass(slots=True)
class ChunkStorageMetadata:
    """A box of a tensor: its offsets in the global tensor and its sizes.

    Slotted: a checkpoint of thousands of ranks lists millions of chunks, and
    an instance without a ``__dict__`` takes less memory and is one object
    fewer for the garbage collector to walk.
    """

    offsets: torch.Size
    sizes: torch.Size


@dataclass
class TensorProperties:
    """Properties of a stored tensor. Only ``dtype`` affects the stored bytes.

    Not frozen on purpose: the protocol's fp16 planner pattern rewrites
    ``dtype`` on the write items of a local plan.
    """

    dtype: torch.dtype = field(default_factory=torch.get_default_dtype)
    layout: torch.layout = torch.strided
    requires_grad: bool = False
    memory_format: torch.memory_format = torch.contiguous_format
    pin_memory: bool = False

    @staticmethod
    def create_from_tensor(tensor: torch.Tensor) -> "TensorProperties":
        return TensorProperties(dtype=tensor.dtype, layout=tensor.layout, requires_grad=tensor.requires_grad)


@dataclass
class TensorStorageMetadata:
    """A stored tensor: its global size, properties and the chunks it was saved in."""

    properties: TensorProperties
    size: torch.Size
    chunks: list[ChunkStorageMetadata]


@dataclass
class BytesStorageMetadata:
    """A stored non-tensor value (an opaque byte string produced by the save planner)."""


STORAGE_TYPES = Union[TensorStorageMetadata, BytesStorageMetadata]


@dataclass(frozen=True)
class MetadataIndex:
    """Names one item of a checkpoint: a key, and for tensors the offsets of a chunk.

    ``index`` is only a lookup hint into ``TensorStorageMetadata.chunks``; it
    takes no part in equality or hashing.
    """

    fqn: str
    offset: Optional[torch.Size] = None
    index: Optional[int] = field(hash=False, compare=False, default=None)

    def __init__(self, fqn: str, offset: Optional[Sequence[int]] = None, index: Optional[int] = None):
        object.__setattr__(self, "fqn", fqn)
        object.__setattr__(self, "offset", offset if offset is None or type(offset) is torch.Size else torch.Size(offset))
        object.__setattr__(self, "index", index)

    def __hash__(self) -> int:
        # kept once computed: a load looks each index up in several tables, tens of thousands of times
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.fqn, self.offset))
            object.__setattr__(self, "_hash", h)
        return h

    def __reduce__(self):
        return MetadataIndex, (self.fqn, self.offset, self.index)  # not the hash: string hashes differ between processes


@dataclass
class StorageMeta:
    """Storage-level facts about one save or load, handed to planners."""

    checkpoint_id: Union[str, os.PathLike, None] = None
    save_id: Optional[str] = None
    load_id: Optional[str] = None
    modules: list[str] = field(default_factory=list)


@dataclass
class Metadata:
    """The global metadata of a checkpoint.

    ``state_dict_metadata`` maps every flattened key to how it is stored.
    ``planner_data`` and ``storage_data`` belong to the planner and storage
    layer that wrote the checkpoint; ``version`` is the on-disk format version.
    """

    state_dict_metadata: dict[str, STORAGE_TYPES]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: Optional[StorageMeta] = None
    version: Optional[str] = None
