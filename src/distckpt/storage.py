"""Storage layer interfaces of the protocol.

A storage layer decides *how* and *where* bytes are kept. The planner
(:mod:`distckpt.planner`) decides *what* they are. Backends shipped with
distckpt live in :mod:`distckpt.backends`; every one passes the storage test
suite in :mod:`distckpt.testing`.
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from typing import Any, Optional, Union

from torch.futures import Future

from .metadata import Metadata, MetadataIndex, StorageMeta
from .planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner

__all__ = ["WriteResult", "StorageWriter", "StorageReader"]


@dataclass(frozen=True)
class WriteResult:
    """Where one write item ended up. ``storage_data`` belongs to the storage layer."""

    index: MetadataIndex
    size_in_bytes: int
    storage_data: Any


class StorageWriter(abc.ABC):
    """Writes the bytes of a checkpoint.

    The same instance plays the coordinator or a follower; it learns which in
    ``set_up_storage_writer``. A save calls, in order:

    0. ``reset(checkpoint_id)`` on every rank, when the caller gave an id;
    1. ``set_up_storage_writer(is_coordinator, rank=..., world_size=...)`` on every rank
       (the keyword arguments are passed only if the method accepts them);
    2. ``prepare_local_plan(plan)`` on every rank;
    3. ``prepare_global_plan(plans)`` on the coordinator;
    4. ``write_data(plan, planner)`` on every rank, returning a Future of WriteResults;
    5. ``finish(metadata, results)`` on the coordinator: commit the checkpoint.

    If the save fails on any rank, the coordinator calls ``discard_incomplete()``.

    A minimal in-memory writer is a few dozen lines; see
    :mod:`distckpt.backends.memory`.
    """

    @abc.abstractmethod
    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        """Begin a new checkpoint write, optionally naming where it goes."""

    @abc.abstractmethod
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Initialise for this save; ``is_coordinator`` says whether this rank commits."""

    @abc.abstractmethod
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Storage-specific local planning; put extra data in ``plan.storage_data``."""

    @abc.abstractmethod
    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Storage-specific global planning. Coordinator only."""

    @abc.abstractmethod
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write every item of ``plan``, getting data from ``planner.resolve_data`` lazily."""

    @abc.abstractmethod
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write the metadata and mark the checkpoint complete. Coordinator only."""

    @classmethod
    @abc.abstractmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        """Whether this storage can handle ``checkpoint_id``; used to pick a storage automatically."""

    def storage_meta(self) -> Optional[StorageMeta]:
        """Storage-level facts passed to the save planner. None by default."""
        return None

    def discard_incomplete(self) -> None:
        """After a failed save, remove what this save wrote and never committed (coordinator, best effort).
        Nothing by default."""


class StorageReader(abc.ABC):
    """Reads the bytes of a checkpoint.

    A load calls, in order:

    0. ``reset(checkpoint_id)`` on every rank, when the caller gave an id;
    1. ``read_metadata()`` on every rank;
    2. ``set_up_storage_reader(metadata, is_coordinator)`` on every rank;
    3. ``prepare_local_plan(plan)`` on every rank;
    4. ``prepare_global_plan(plans)`` on the coordinator;
    5. ``read_data(plan, planner)`` on every rank, returning a Future.
    """

    @abc.abstractmethod
    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        """Begin a new checkpoint read, optionally naming where from."""

    @abc.abstractmethod
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Return the checkpoint's metadata."""

    @abc.abstractmethod
    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Initialise for this load."""

    @abc.abstractmethod
    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Storage-specific local planning."""

    @abc.abstractmethod
    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Storage-specific global planning. Coordinator only."""

    @abc.abstractmethod
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan``: bytes through ``planner.load_bytes``, tensors through
        ``planner.resolve_tensor`` / ``planner.commit_tensor``. Device copies are this layer's job."""

    @classmethod
    @abc.abstractmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        """Whether this storage can handle ``checkpoint_id``."""
