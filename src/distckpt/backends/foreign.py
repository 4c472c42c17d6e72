"""The storage reader of checkpoints other programs wrote: a layout (distckpt.layouts) read by distckpt's engine.

A :class:`LayoutReader` lists the checkpoint's files on its store (a local directory, or any store registered by
scheme: ``s3://bucket/prefix``, ``memory://name``, ...),
asks its layout for the metadata, and hands every read to the read engine, as distckpt's own readers do: the
same checks, memory budget, lanes and progress. Subclasses say how their layout is read (``describe``).
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Optional, Union

from torch.futures import Future

from .. import knobs
from ..capabilities import SHARED_READS, SHARED_VERIFICATION, keeps_plans
from ..engine.blobs import BlobStore
from ..engine.read import read_items
from ..engine.shared_reads import SharedReads
from ..engine.shared_verification import SharedVerification
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, MissingKeyError, ShapeMismatchError
from ..format.records import ForeignStorageData
from ..metadata import Metadata
from ..planner import LoadPlan, LoadPlanner
from ..storage import StorageReader
from .blob_storage import done, store_at
from .filesystem import FsStore
from .schemes import FILE, scheme_of

__all__ = ["LayoutReader"]


class LayoutReader(SharedReads, SharedVerification, StorageReader):
    """Reads another program's checkpoint through a layout (see the module docstring).

    Args:
        path: the checkpoint (a directory, or a URL of any registered store, ``s3://bucket/prefix``; may also be
            given as ``checkpoint_id``).
        thread_count: reader threads per rank (default: the DISTCKPT_IO_THREADS knob).
        store_options: for a URL, the options its scheme's reader takes (for ``s3://``, :class:`~distckpt.S3Reader`'s
            ``endpoint_url=``, ``client=``...).
    """

    kind = "foreign"  # how errors name the checkpoint
    # nothing of another program's checkpoint is verified on read (it records no checksums), so verification is
    # trivially shared: the load keeps every rank's plan where it made it, with no plan exchanged
    capabilities = frozenset({SHARED_READS, SHARED_VERIFICATION})
    verify_checksums = False

    def __init__(self, path: Union[str, os.PathLike, None] = None, *, thread_count: Optional[int] = None,
                 shared_reads: Optional[bool] = None, **store_options: Any):
        self.path = None if path is None else os.fspath(path)
        self.shared_reads = shared_reads  # as BlobStorageReader's
        self.shares = None
        self.thread_count = thread_count
        self.store_options = store_options
        self.load_id = uuid.uuid4().hex
        self.metadata: Optional[Metadata] = None
        self.is_coordinator = True
        self.store: Optional[BlobStore] = None  # from set_up_storage_reader

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self.load_id = uuid.uuid4().hex
        self.metadata = None

    def where(self) -> str:
        return f"{self.kind} checkpoint {self.path!r}"

    def _store(self) -> BlobStore:
        if self.path is None:
            raise CheckpointError(f"{type(self).__name__} needs the checkpoint: {type(self).__name__}(path) or checkpoint_id=")
        if scheme_of(self.path) != FILE:
            return store_at(self.path, self.store_options)
        path = self.path[len("file://"):] if self.path.startswith("file://") else self.path
        if not os.path.isdir(path):
            raise CheckpointNotFoundError(f"{self.where()} does not exist (no such directory); check the path")
        if os.path.islink(os.path.normpath(path)):
            raise CheckpointError(f"{self.where()} is a symbolic link; distckpt reads only directories it can see are "
                                  "real. Pass the directory it points to.")
        return FsStore(path)

    def describe(self, store: BlobStore, sizes: dict[str, int]) -> Metadata:
        """The checkpoint's metadata (its storage_data a ForeignStorageData), from its regular files' ``sizes``."""
        raise NotImplementedError

    def read_small(self, store: BlobStore, name: str, cap: int, sizes: dict[str, int]) -> bytes:
        """The whole of file ``name``, a regular file of at most ``cap`` bytes."""
        if name not in sizes:
            raise CheckpointNotFoundError(f"{self.where()}: {name} is missing, or not a regular file")
        blob = store.open(name)
        try:
            if blob.size > cap:
                raise CorruptCheckpointError(f"{self.where()}: {name} is {blob.size} bytes, over the cap of {cap}")
            raw = blob.pread(blob.size, 0)
        finally:
            blob.close()
        if len(raw) != sizes[name]:
            raise CorruptCheckpointError(f"{self.where()}: {name} changed while it was read")
        return raw

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        store = self._store()
        md = self.describe(store, store.sizes())
        for name, info in md.storage_data.files.items():  # bind the layout to the files it was read from
            if name in md.storage_data.identities:  # bound by describe, when it parsed the file
                continue
            blob = store.open(name)
            try:
                if blob.size != info.size:
                    raise CorruptCheckpointError(f"{self.where()}: {name} changed while its layout was read")
                md.storage_data.identities[name] = blob.identity()
            finally:
                blob.close()
        self.metadata = md
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not isinstance(metadata.storage_data, ForeignStorageData):
            raise CorruptCheckpointError(f"{self.where()}: the metadata given was not read by {type(self).__name__}")
        self.metadata = metadata
        self.is_coordinator = is_coordinator
        self.store = self._store()
        self.shares = None

    def skip_verification(self, chunks: set) -> None:
        """Nothing to skip: nothing is verified (see ``capabilities``)."""

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    @keeps_plans
    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        self._check_planned(planner)
        read_items(self.store, self.metadata, plan, planner, str(self.path), verify=False,
                   threads=self.thread_count or knobs.io_threads(), is_coordinator=self.is_coordinator, shares=self.shares)
        return done(None)

    def _check_planned(self, planner: LoadPlanner) -> None:
        """Where the planner planned on metadata of its own (DynamicMetaLoadPlanner), its keys and shapes must be
        the checkpoint's: the engine reads by the checkpoint's."""
        theirs = getattr(planner, "metadata", None)
        if theirs is None or theirs is self.metadata:
            return
        ours = self.metadata.state_dict_metadata
        for fqn, entry in theirs.state_dict_metadata.items():
            stored = ours.get(fqn)
            if stored is None:
                raise MissingKeyError(f"{self.where()}: key {fqn!r} is not in the checkpoint (Missing key in checkpoint); "
                                      "leave it out of the state dict")
            if getattr(stored, "size", None) != getattr(entry, "size", None):
                raise ShapeMismatchError(f"{self.where()}: key {fqn!r} has shape {tuple(stored.size)}, the state dict "
                                         f"{tuple(entry.size)} (Size mismatch)")
