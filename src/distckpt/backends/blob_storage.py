"""StorageWriter and StorageReader over any :class:`BlobStore`.

Both take their store whole, or a checkpoint id whose scheme names a registered store
(:mod:`.schemes`), resolved again whenever ``reset`` names a new checkpoint id.

Each rank writes one data file (a safetensors file) holding all of its items,
in parallel from several threads; the coordinator commits by writing the
metadata document last. Reads validate every file they touch before any
destination is modified, then read each stored chunk once, straight into the
destination where its memory is contiguous.
"""

from __future__ import annotations

import inspect
import os
import uuid
from dataclasses import replace
from typing import Any, Optional, Union

from torch.futures import Future

from .. import knobs
from ..capabilities import COLUMNAR_COMMIT, OVERWRITE, SHARED_READS, SHARED_VERIFICATION, WRITES_WHILE_STAGING, keeps_plans
from ..engine.blobs import BlobStore
from ..engine.commit import columns_document, objects_document, publish
from ..engine.prefetched import PrefetchCache, PrefetchedStore
from ..engine.read import read_items
from ..engine.references import data_files
from ..engine.reuse import Reuse
from ..engine.shared_reads import SharedReads
from ..engine.shared_verification import SharedVerification
from ..engine.write import identity_codec, write_file
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..format import METADATA_FILE
from ..format.bytegroup import compression_codec
from ..format.chunk_codec import ChunkCodec
from ..format.codec import EncodedMetadata, lazy_metadata, parse_metadata
from ..format.records import FileStorageData
from ..item_columns import ResultColumns
from ..metadata import Metadata, StorageMeta
from ..planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from ..planning.columnar import PlannedMetadata
from ..storage import StorageReader, StorageWriter
from .leases import Lease
from .run_guard import Referencing, referencing
from .schemes import scheme_entry, store_for


def done(value: Any) -> Future:
    """A future that holds ``value`` already (the protocol returns futures; these steps finish in the call)."""
    fut: Future = Future()
    fut.set_result(value)
    return fut


Location = Union[BlobStore, str, os.PathLike, None]


class _Located:
    """Where a storage layer points: a store given whole, or a checkpoint id opened as a store on use.

    ``reset(checkpoint_id)`` re-targets it (DCP's semantics). Thin subclasses with store options of their own
    override ``open_store``; ones that spell checkpoint ids their own way override ``canonical``.
    """

    checkpoint_id: Optional[str] = None
    given_store: Optional[BlobStore] = None

    def _locate(self, where: Location) -> None:
        if isinstance(where, BlobStore):
            self.given_store, self.checkpoint_id = where, None
        elif isinstance(where, (str, os.PathLike)):
            self.given_store, self.checkpoint_id = None, self.canonical(where)
        elif where is not None:
            raise CheckpointError(f"{type(self).__name__}({where!r:.100}): pass a distckpt.backends.BlobStore or a checkpoint "
                                  f"id (a path or URL string), not a {type(where).__name__}")

    def canonical(self, checkpoint_id: Union[str, os.PathLike]) -> str:
        """``checkpoint_id`` as this layer names it (in errors and in the metadata's ``storage_meta``)."""
        return os.fspath(checkpoint_id)

    def open_store(self, checkpoint_id: str) -> BlobStore:
        """The store at ``checkpoint_id``: by default, from the factory registered for its scheme."""
        return store_for(checkpoint_id)

    def blob_store(self) -> BlobStore:
        """The blob store at this layer's checkpoint."""
        if self.given_store is not None:
            return self.given_store
        if self.checkpoint_id is None:
            raise CheckpointNotFoundError(f"{type(self).__name__} has no checkpoint: pass checkpoint_id=, or a store or "
                                          f"checkpoint id to {type(self).__name__}(...)")
        return self.open_store(self.checkpoint_id)

    def _store(self) -> BlobStore:
        return self.blob_store()

    def _checkpoint_id(self) -> str:
        if self.checkpoint_id is None and self.given_store is not None:
            return self.given_store.describe()
        return str(self.checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        """Whether a store is registered for the scheme of ``checkpoint_id``."""
        return scheme_entry(checkpoint_id) is not None


class BlobStorageWriter(_Located, StorageWriter):
    """The protocol's StorageWriter over any blob store.

    Args:
        store: a :class:`BlobStore`, or the checkpoint id of one (its scheme registered with
            :func:`~distckpt.backends.register_store`); may also be given later as ``checkpoint_id``.
        sync_files: make data and metadata durable before the commit (default: the DISTCKPT_FSYNC knob).
        thread_count: writer threads per rank (default: the DISTCKPT_IO_THREADS knob).
        overwrite: replace a committed checkpoint; the old one stays intact until the new one commits.
        compression: ``"zstd"`` stores every item byte-grouped and zstd-compressed, each chunk on its own (format
            4.0, docs/format.md "Compressed chunks"); None (the default) stores items as they are.
        compression_level: a zstd level, -7 to 22 (default: parameters tuned for byte planes, faster than level 1).

    It declares ``COLUMNAR_COMMIT`` (:mod:`distckpt.capabilities`): subclasses that wrap its methods keep
    the columnar save path, as long as ``prepare_global_plan`` and ``finish`` still end in these; and
    ``OVERWRITE``: a save's ``overwrite=`` sets its ``overwrite``.
    """

    capabilities = frozenset({COLUMNAR_COMMIT, OVERWRITE, WRITES_WHILE_STAGING})
    staging_fill: Any = None  # staging a writer process's training process is still filling (WRITES_WHILE_STAGING)

    def __init__(self, store: Location = None, *, sync_files: Optional[bool] = None, thread_count: Optional[int] = None,
                 overwrite: Optional[bool] = None, compression: Optional[str] = None,
                 compression_level: Optional[int] = None):
        self._locate(store)
        self.sync_files = sync_files
        self.thread_count = thread_count
        self.overwrite = overwrite
        self.rank = 0
        self.is_coordinator = True
        # how every item is stored, if not as it is (format/chunk_codec.py)
        self.chunk_codec: Optional[ChunkCodec] = compression_codec(compression, compression_level)
        self.store: Optional[BlobStore] = None  # this save's store, from set_up_storage_writer
        self.save_id: Optional[str] = None
        self.committed_save_id: Optional[str] = None
        # an incremental save (engine/reuse.py): unchanged chunks are referenced in the previous step, not written
        self.reuse: Optional[Reuse] = None
        self._lease: Optional[Lease] = None
        self._referencing: Optional[Referencing] = None  # this save's record among the run's (run_guard.py)

    def _replaces(self) -> bool:
        """Whether this save may replace a committed checkpoint: ``overwrite``, else the DISTCKPT_OVERWRITE setting."""
        return knobs.overwrite_committed() if self.overwrite is None else bool(self.overwrite)

    def _sync(self) -> bool:
        return knobs.fsync_enabled() if self.sync_files is None else self.sync_files

    def reset(self, checkpoint_id=None) -> None:
        self.save_id = None
        if checkpoint_id is not None:
            self._locate(checkpoint_id)
            self.store = None

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self._checkpoint_id())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, rank: int = 0, world_size: int = 1, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = rank
        self.store = self._store()
        if not self._replaces() and self.store.is_committed():
            raise CheckpointError(
                f"Checkpoint already exists and is committed at {self._checkpoint_id()!r} (DCP's words, which code "
                "written for it matches); distckpt does not replace it "
                "unless asked. Save to a new checkpoint_id, or pass overwrite=True to the storage writer, or set "
                "DISTCKPT_OVERWRITE=1 for DCP's behaviour "
                "(the old checkpoint stays intact until the new one commits).")
        if self._replaces() and is_coordinator:
            self.store.check_replaceable()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        save_id = self.save_id = uuid.uuid4().hex
        # before any rank can write a byte of this save: a cleaner must see it is alive (see leases.py)
        self._release_lease()
        if self.store is None:  # prepare_global_plan called without set_up_storage_writer
            self.store = self._store()
        self._lease = Lease(self.store, save_id)
        references = False
        if self.reuse is not None:  # an incremental save: it may reference earlier steps unless a deleter is at work
            self._referencing = referencing(self.store.parent())
            references = self._referencing.allowed and self._base_unchanged()
            if not references:
                self._referencing.release()  # it references nothing: no deleter need wait for it
        return [replace(p, storage_data={"file": f"data-{i:05d}.safetensors", "save_id": save_id, "rank": i,
                                         "references": references})
                for i, p in enumerate(plans)]

    def _base_unchanged(self) -> bool:
        """Whether the step this incremental save's fingerprints come from is committed still as it was when the save
        chose it: a deleter that ran whole between that choice and this save's record saw no save (run_guard.py)."""
        base = self.reuse.base if self.reuse is not None else None
        if base is None:
            return True  # nothing to reference
        parent = self.store.parent() if self.store is not None else None
        if parent is None:
            return False
        try:
            blob = parent.child(base[0]).open(METADATA_FILE)
        except (OSError, CheckpointError):
            return False
        try:
            return blob.identity() == base[1]
        finally:
            blob.close()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        sd = plan.storage_data
        if not isinstance(sd, dict) or "file" not in sd:
            raise CheckpointError("the save plan has no storage data from prepare_global_plan; was the plan built by this writer?")
        if self.store is None:
            raise CheckpointError(f"{type(self).__name__}.write_data: the writer was reset after planning (reset() forgets "
                                  "the save in progress); plan again after reset, or use one writer per save")
        self.save_id = sd["save_id"]
        if self.reuse is not None and not sd.get("references"):
            self.reuse.previous = {}  # the coordinator saw a deleter at work (run_guard.py): every chunk is written
        staging = self.store.staging(self.save_id)
        staging.prepare()
        results = write_file(staging, sd["file"], sd["save_id"], sd["rank"], plan, planner,
                             threads=self.thread_count or staging.write_streams(), sync=self._sync(),
                             is_coordinator=self.is_coordinator, codec_of=self._codec_of(), reuse=self.reuse,
                             filling=self.staging_fill)
        return done(results)

    def _codec_of(self):
        codec = self.chunk_codec
        return identity_codec if codec is None or codec.identity else (lambda item: codec)

    def finish(self, metadata: Metadata, results: list) -> Metadata:
        """Commit the save (coordinator) and return its metadata as committed.

        A save planned on columns comes as :class:`PlannedMetadata` with each rank's :class:`ResultColumns`
        (``COLUMNAR_COMMIT``); anything else as the protocol's Metadata and WriteResults. ``engine/commit.py``
        builds the document of either.
        """
        if isinstance(metadata, PlannedMetadata) and all(isinstance(r, ResultColumns) for r in results):
            document = columns_document(metadata.plan, results, self.save_id, self._checkpoint_id())
            self._publish(document)
            return lazy_metadata(document, "the save's metadata")
        if isinstance(metadata, EncodedMetadata) and metadata.document is not None:
            self._publish(metadata.document)  # a committed document, given again as it is
            return metadata
        self._publish(objects_document(metadata, results, self.save_id, self._checkpoint_id()))
        return metadata

    def _publish(self, document: bytes) -> None:
        publish(self.store, self.save_id, document, self._replaces(), self._sync(), self._checkpoint_id())
        self.committed_save_id = self.save_id
        self._release_lease()

    def _release_lease(self) -> None:
        guard, self._referencing = self._referencing, None
        if guard is not None:
            guard.release()
        lease = self._lease
        if lease is not None:
            self._lease = None
            try:
                lease.release()
            except (OSError, CheckpointError):
                pass  # a lease left behind names a process that will be seen dead

    def discard_incomplete(self) -> None:
        """Remove this save's uncommitted data after a failed save (coordinator, best effort).

        A save that failed after its commit (a rank lost in the last collective) keeps its data:
        on stores without rename, the committed checkpoint's data is where the save wrote it.
        """
        if self.save_id and self.committed_save_id != self.save_id and self.store is not None:
            try:
                self.store.discard(self.store.staging(self.save_id))
            except (OSError, CheckpointError):
                pass
        self._release_lease()


class BlobStorageReader(_Located, SharedReads, SharedVerification, StorageReader):
    """The protocol's StorageReader over any blob store.

    Args:
        store: a :class:`BlobStore`, or the checkpoint id of one (its scheme registered with
            :func:`~distckpt.backends.register_store`); may also be given later as ``checkpoint_id``.
        verify_checksums: check the CRC-32C of every item read (default True).
        thread_count: reader threads per rank (default: the DISTCKPT_IO_THREADS knob).
        shared_reads: in a load over a process group, read each chunk several ranks need on one of them, which
            sends it to the others (default: the DISTCKPT_SHARED_READS knob, on); every rank must agree.

    It declares ``SHARED_READS`` and ``SHARED_VERIFICATION`` (:mod:`distckpt.capabilities`; the steps are
    :class:`~distckpt.engine.shared_reads.SharedReads`' and
    :class:`~distckpt.engine.shared_verification.SharedVerification`'s), and that its
    ``prepare_global_plan`` keeps plans as they are.
    """

    capabilities = frozenset({SHARED_READS, SHARED_VERIFICATION})

    def __init__(self, store: Location = None, *, verify_checksums: bool = True, thread_count: Optional[int] = None,
                 shared_reads: Optional[bool] = None):
        self._locate(store)
        self.shared_reads = shared_reads
        self.shares = None
        self.verify_checksums = verify_checksums
        self.thread_count = thread_count
        self.load_id = uuid.uuid4().hex  # names this load to planners (StorageMeta.load_id); new at each reset
        self.metadata: Optional[Metadata] = None
        self.is_coordinator = True
        self.store: Optional[BlobStore] = None  # the store of the data files, from set_up_storage_reader
        self.verified_elsewhere: set = set()
        self.extension_registry: Any = None  # rebuilds the stream transforms items were written through (None: the default)
        self.prefetched: Optional[PrefetchCache] = None  # bytes a prefetch read of the checkpoint (distckpt.prefetching)

    def reset(self, checkpoint_id=None) -> None:
        self.metadata = None
        self.load_id = uuid.uuid4().hex
        if checkpoint_id is not None:
            self._locate(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        store = self._store()
        where = f"checkpoint {self._checkpoint_id()!r}"
        if not store.exists(METADATA_FILE):
            raise CheckpointNotFoundError(
                f"{where} has no {METADATA_FILE}: it does not exist, or its save never committed. Check the path, "
                "or load an earlier checkpoint.")
        blob = store.open(METADATA_FILE)
        try:
            cap = knobs.max_metadata_bytes()
            if blob.size > cap:
                raise CorruptCheckpointError(f"{where}: {METADATA_FILE} is {blob.size} bytes, over the cap of {cap} "
                                             "(DISTCKPT_MAX_METADATA_BYTES)")
            raw = blob.pread(blob.size, 0)
        finally:
            blob.close()
        md = parse_metadata(raw, f"{where}, file {METADATA_FILE}")
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.checkpoint_id = self._checkpoint_id()
        md.storage_meta.load_id = self.load_id
        return md

    def data_store(self, metadata: Metadata) -> BlobStore:
        """The store holding the data files of the checkpoint ``metadata`` describes."""
        if not isinstance(metadata.storage_data, FileStorageData):
            raise CorruptCheckpointError(f"checkpoint {self._checkpoint_id()!r}: metadata has no data-file table")
        return data_files(self._store(), metadata.storage_data)

    def _data_files(self, metadata: Metadata) -> BlobStore:
        """The data store, through the prefetched bytes where a prefetch read this very save."""
        store = data_files(self._store(), metadata.storage_data)
        cache = self.prefetched
        if (cache is not None and cache.save_id is not None and cache.save_id == metadata.storage_data.save_id
                and cache.checkpoint_id == self.checkpoint_id):
            return PrefetchedStore(store, cache)
        return store

    def data_file_sizes(self, metadata: Metadata) -> dict[str, int]:
        """The data files of the checkpoint ``metadata`` describes, with their sizes as stored now."""
        if not isinstance(metadata.storage_data, FileStorageData):
            raise CorruptCheckpointError(f"checkpoint {self._checkpoint_id()!r}: metadata has no data-file table")
        found = data_files(self._store(), metadata.storage_data).sizes()
        return {name: found[name] for name in metadata.storage_data.files if name in found}

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not isinstance(metadata.storage_data, FileStorageData):
            raise CorruptCheckpointError(f"checkpoint {self._checkpoint_id()!r}: metadata has no data-file table; it was not "
                                         "written by a distckpt storage layer")
        self.metadata = metadata
        self.is_coordinator = is_coordinator
        self.store = self._data_files(metadata)
        # chunks a prefetch of this save checked as it read them, from files that are still those it read
        self.verified_elsewhere = self.store.verified() if isinstance(self.store, PrefetchedStore) else set()
        self.shares = None

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    @keeps_plans
    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        if self.metadata is None or self.store is None:
            raise CheckpointError(f"{type(self).__name__}.read_data: no checkpoint is set up (set_up_storage_reader was not "
                                  "called, or reset() came after it); read the metadata and set up again")
        read_items(self.store, self.metadata, plan, planner, self._checkpoint_id(),
                   verify=self.verify_checksums, threads=self.thread_count or knobs.io_threads(),
                   verified_elsewhere=self.verified_elsewhere, is_coordinator=self.is_coordinator,
                   extension_registry=self.extension_registry, shares=self.shares)
        return done(None)


def accepted_options(cls: type, options: dict[str, Any]) -> dict[str, Any]:
    """The ``options`` that ``cls``'s constructor takes (all of them when it takes ``**kwargs``)."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return dict(options)
    return {k: v for k, v in options.items() if k in params}


def store_at(checkpoint_id: str, options: dict[str, Any]) -> BlobStore:
    """The store at ``checkpoint_id``, opened as the reader registered for its scheme opens it, with the ``options``
    that reader takes (``client=``, ``endpoint_url=`` for ``s3://``): how another program's checkpoint is found and
    read on any store."""
    entry = scheme_entry(checkpoint_id)
    if entry is None:
        raise CheckpointError(f"no store is registered for the scheme of {checkpoint_id!r}; register one with "
                              "distckpt.backends.register_store(scheme, factory)")
    cls = entry.reader or BlobStorageReader
    reader = cls(**accepted_options(cls, options))
    reader.reset(checkpoint_id)
    return reader.blob_store()

