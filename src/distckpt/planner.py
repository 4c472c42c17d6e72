"""Plan types and planner base classes of the protocol.

A save or load runs in phases, on every rank of the group at once. The
planner decides *what* is written or read; the storage layer
(:mod:`distckpt.storage`) decides *how*. Both keep the protocol's names,
fields and call order, so a planner written for that protocol works with
distckpt after an import change.
"""

from __future__ import annotations

import abc
import io
import math
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, Optional, Union

import torch

from .metadata import (
    STATE_DICT_TYPE,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)

__all__ = [
    "WriteItemType",
    "LoadItemType",
    "BytesIOWriteData",
    "TensorWriteData",
    "WriteItem",
    "ReadItem",
    "SavePlan",
    "LoadPlan",
    "SavePlanner",
    "LoadPlanner",
]


class WriteItemType(Enum):
    TENSOR = auto()
    SHARD = auto()
    BYTE_IO = auto()


class LoadItemType(Enum):
    TENSOR = auto()
    BYTE_IO = auto()


@dataclass(frozen=True)
class BytesIOWriteData:
    nbytes: int


@dataclass(frozen=True)
class TensorWriteData:
    """What a tensor write stores: one chunk of a tensor of global ``size``."""

    chunk: ChunkStorageMetadata
    properties: TensorProperties
    size: torch.Size


@dataclass(frozen=True)
class WriteItem:
    """One thing to write: a tensor chunk or a non-tensor value."""

    index: MetadataIndex
    type: WriteItemType
    bytes_io_data: Optional[BytesIOWriteData] = None
    tensor_data: Optional[TensorWriteData] = None

    def tensor_storage_size(self) -> Optional[int]:
        """Bytes of the whole tensor this item belongs to, or None for a non-tensor write.

        This follows the protocol, which sizes the global tensor. The bytes of
        this item's own chunk are given by :meth:`chunk_storage_size`.
        """
        if self.tensor_data is None:
            return None
        return math.prod(self.tensor_data.size) * self.tensor_data.properties.dtype.itemsize

    def chunk_storage_size(self) -> Optional[int]:
        """Bytes of this item's chunk as stored, or None for a non-tensor write."""
        if self.tensor_data is None:
            return None
        return math.prod(self.tensor_data.chunk.sizes) * self.tensor_data.properties.dtype.itemsize


@dataclass(frozen=True)
class ReadItem:
    """One box to copy from a stored chunk into a destination.

    ``dest_offsets`` are relative to the destination tensor that
    ``LoadPlanner.resolve_tensor`` returns for ``dest_index``;
    ``storage_offsets`` are relative to the stored chunk ``storage_index``.
    """

    type: LoadItemType
    dest_index: MetadataIndex
    dest_offsets: torch.Size
    storage_index: MetadataIndex
    storage_offsets: torch.Size
    lengths: torch.Size


@dataclass(frozen=True)
class SavePlan:
    """The write items of one rank, plus data for the planner and the storage layer.

    A rank whose plan is unchanged since the previous save may send
    ``usable=False``: the coordinator then reuses the plan it cached.
    """

    items: list[WriteItem]
    storage_data: Any = None
    planner_data: Any = None
    usable: bool = True


@dataclass
class LoadPlan:
    """The read items of one rank, plus data for the planner and the storage layer."""

    items: list[ReadItem]
    storage_data: Any = None
    planner_data: Any = None


class SavePlanner(abc.ABC):
    """Decides what a save writes, and hands the storage layer the data.

    The save sequence calls, in order:

    1. ``set_up_planner(state_dict, storage_meta, is_coordinator)`` on every rank;
    2. ``create_local_plan()`` on every rank; the plans go to the coordinator;
    3. ``create_global_plan(all_plans)`` on the coordinator only; it returns one
       plan per rank and the checkpoint's :class:`Metadata`;
    4. ``finish_plan(new_plan)`` on every rank, with the plan the coordinator
       sent it;
    5. ``resolve_data(write_item)`` on every rank, any number of times per item,
       possibly from several threads, while the storage layer writes.

    Extend :class:`distckpt.DefaultSavePlanner` rather than this class. For
    example, a planner that prefixes every key::

        class PrefixPlanner(DefaultSavePlanner):
            def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
                renamed = {"model." + k: v for k, v in state_dict.items()}
                super().set_up_planner(renamed, storage_meta, is_coordinator)

    Plan caching is kept per planner object, not in class attributes shared
    by every planner of a class as in the protocol's ``_cached_*``
    dictionaries: two models saved alternately, or a save beside an
    async_save still in flight, can then never be given each other's cached
    plans. Pass the same planner object to every save to benefit from it
    (``DefaultSavePlanner(enable_plan_caching=True)``); the ``usable=False``
    marker of :class:`SavePlan` is how a rank says its plan is unchanged.
    A planner caches by having a ``plan_cache`` (a
    :class:`distckpt.planning.plan_cache.PlanCache`); None means no caching.
    """

    plan_cache: Any = None

    @abc.abstractmethod
    def set_up_planner(
        self,
        state_dict: STATE_DICT_TYPE,
        storage_meta: Optional[StorageMeta] = None,
        is_coordinator: bool = False,
    ) -> None:
        """Start a save of ``state_dict``; keep what later calls need. Every rank."""

    @abc.abstractmethod
    def create_local_plan(self) -> SavePlan:
        """Return this rank's write items. Every rank."""

    @abc.abstractmethod
    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """Make global decisions over all ranks' plans; return the final plans and metadata. Coordinator only."""

    @abc.abstractmethod
    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """Adopt the plan the coordinator decided for this rank. Every rank."""

    @abc.abstractmethod
    def resolve_data(self, write_item: WriteItem) -> Union[torch.Tensor, io.BytesIO]:
        """Return the tensor or bytes to store for ``write_item``.

        Must be idempotent and thread-safe. Tensors may be on any device, views,
        or non-contiguous; the storage layer stores the tensor's elements.
        Allocate lazily here rather than at planning time, to bound memory.
        """


class LoadPlanner(abc.ABC):
    """Decides what a load reads, and where the bytes go.

    The load sequence calls, in order:

    1. ``set_up_planner(state_dict, metadata, is_coordinator)`` on every rank;
    2. ``create_local_plan()`` on every rank; the plans go to the coordinator;
    3. ``create_global_plan(all_plans)`` on the coordinator only;
    4. ``finish_plan(central_plan)`` on every rank;
    5. while the storage layer reads: ``load_bytes(read_item, value)`` once per
       non-tensor value, and ``resolve_tensor(read_item)`` followed by
       ``commit_tensor(read_item, tensor)`` for each tensor read item.

    Load is in place: ``resolve_tensor`` returns a tensor that aliases the
    destination in the state dict. Where that is impossible (say the model
    lives on the meta device), return any tensor of the right shape and copy
    or install it in ``commit_tensor``::

        class MaterializeOnCPU(DefaultLoadPlanner):
            def resolve_tensor(self, read_item):
                return torch.empty_like(super().resolve_tensor(read_item), device="cpu")

            def commit_tensor(self, read_item, tensor):
                self.state_dict[read_item.dest_index.fqn] = tensor

    Extend :class:`distckpt.DefaultLoadPlanner` rather than this class.
    """

    @abc.abstractmethod
    def set_up_planner(
        self,
        state_dict: STATE_DICT_TYPE,
        metadata: Optional[Metadata] = None,
        is_coordinator: bool = False,
    ) -> None:
        """Start a load into ``state_dict`` from a checkpoint described by ``metadata``. Every rank."""

    @abc.abstractmethod
    def create_local_plan(self) -> LoadPlan:
        """Return this rank's read items. Every rank."""

    @abc.abstractmethod
    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        """Make global decisions over all ranks' load plans. Coordinator only."""

    @abc.abstractmethod
    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        """Adopt the plan the coordinator decided for this rank. Every rank."""

    @abc.abstractmethod
    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Decode a stored non-tensor value and put it in the state dict."""

    def resolve_bytes(self, read_item: ReadItem) -> io.BytesIO:
        """Return a BytesIO for the storage layer to fill for ``read_item``. Optional."""
        raise NotImplementedError(f"{type(self).__name__}.resolve_bytes is not implemented")

    @abc.abstractmethod
    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """Return the tensor (usually a view of the destination) to read ``read_item`` into."""

    @abc.abstractmethod
    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """Called after ``tensor`` (from ``resolve_tensor``) holds the read data."""
