"""StorageWriter and StorageReader over any :class:`BlobStore`.

Each rank writes one data file (a safetensors file) holding all of its items,
in parallel from several threads; the coordinator commits by writing the
metadata document last. Reads validate every file they touch before any
destination is modified, then read each stored chunk once, straight into the
destination where its memory is contiguous.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any, Optional

from torch.futures import Future

from .. import knobs
from ..capabilities import COLUMNAR_COMMIT, SHARED_VERIFICATION, keeps_plans
from ..engine.blobs import BlobStore
from ..engine.commit import columns_document, objects_document, publish
from ..engine.read import read_items
from ..engine.write import identity_codec, write_file
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..format import METADATA_FILE
from ..format.chunk_codec import ChunkCodec
from ..format.codec import EncodedMetadata, lazy_metadata, parse_metadata
from ..format.records import FileStorageData
from ..item_columns import ResultColumns
from ..metadata import Metadata, StorageMeta
from ..planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from ..planning.columnar import PlannedMetadata
from ..storage import StorageReader, StorageWriter
from .leases import Lease


def done(value: Any) -> Future:
    """A future that holds ``value`` already (the protocol returns futures; these steps finish in the call)."""
    fut: Future = Future()
    fut.set_result(value)
    return fut


class BlobStorageWriter(StorageWriter):
    """The protocol's StorageWriter over a blob store; subclasses provide ``_store()``.

    It declares ``COLUMNAR_COMMIT`` (:mod:`distckpt.capabilities`): subclasses that wrap its methods keep
    the columnar save path, as long as ``prepare_global_plan`` and ``finish`` still end in these.
    """

    capabilities = frozenset({COLUMNAR_COMMIT})

    def __init__(self, sync_files: Optional[bool] = None, thread_count: Optional[int] = None,
                 overwrite: Optional[bool] = None):
        self.sync_files = sync_files
        self.thread_count = thread_count
        self.overwrite = overwrite
        self.rank = 0
        self.is_coordinator = True
        self.chunk_codec: Optional[ChunkCodec] = None  # how every item is stored, if not as it is (format/chunk_codec.py)

    # subclasses
    def _store(self) -> BlobStore:
        raise NotImplementedError

    def _checkpoint_id(self) -> str:
        raise NotImplementedError

    def blob_store(self) -> BlobStore:
        """The blob store at this writer's checkpoint id."""
        return self._store()

    def _replaces(self) -> bool:
        """Whether this save may replace a committed checkpoint: ``overwrite``, else the DISTCKPT_OVERWRITE setting."""
        return knobs.overwrite_committed() if self.overwrite is None else bool(self.overwrite)

    def _sync(self) -> bool:
        return knobs.fsync_enabled() if self.sync_files is None else self.sync_files

    def reset(self, checkpoint_id=None) -> None:
        self.save_id = None

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
        if getattr(self, "store", None) is None:  # prepare_global_plan called without set_up_storage_writer
            self.store = self._store()
        self._lease = Lease(self.store, save_id)
        return [replace(p, storage_data={"file": f"data-{i:05d}.safetensors", "save_id": save_id, "rank": i})
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        sd = plan.storage_data
        if not isinstance(sd, dict) or "file" not in sd:
            raise CheckpointError("the save plan has no storage data from prepare_global_plan; was the plan built by this writer?")
        self.save_id = sd["save_id"]
        staging = self.store.staging(self.save_id)
        staging.prepare()
        results = write_file(staging, sd["file"], sd["save_id"], sd["rank"], plan, planner,
                             threads=self.thread_count or knobs.io_threads(), sync=self._sync(),
                             is_coordinator=self.is_coordinator, codec_of=self._codec_of())
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
        lease = getattr(self, "_lease", None)
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
        if getattr(self, "save_id", None) and getattr(self, "committed_save_id", None) != self.save_id:
            try:
                self.store.discard(self.store.staging(self.save_id))
            except (OSError, CheckpointError):
                pass
        self._release_lease()


class BlobStorageReader(StorageReader):
    """The protocol's StorageReader over a blob store; subclasses provide ``_store()``.

    It declares ``SHARED_VERIFICATION`` (:mod:`distckpt.capabilities`), and that its
    ``prepare_global_plan`` keeps plans as they are.
    """

    capabilities = frozenset({SHARED_VERIFICATION})

    def __init__(self, verify_checksums: bool = True, thread_count: Optional[int] = None):
        self.verify_checksums = verify_checksums
        self.thread_count = thread_count
        self.load_id = uuid.uuid4().hex  # names this load to planners (StorageMeta.load_id); new at each reset

    def _store(self) -> BlobStore:
        raise NotImplementedError

    def _checkpoint_id(self) -> str:
        raise NotImplementedError

    def reset(self, checkpoint_id=None) -> None:
        self.metadata = None
        self.load_id = uuid.uuid4().hex

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
        return self._store().data_store(metadata.storage_data.save_id)

    def data_file_sizes(self, metadata: Metadata) -> dict[str, int]:
        """The data files of the checkpoint ``metadata`` describes, with their sizes as stored now."""
        if not isinstance(metadata.storage_data, FileStorageData):
            raise CorruptCheckpointError(f"checkpoint {self._checkpoint_id()!r}: metadata has no data-file table")
        found = self._store().data_store(metadata.storage_data.save_id).sizes()
        return {name: found[name] for name in metadata.storage_data.files if name in found}

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not isinstance(metadata.storage_data, FileStorageData):
            raise CorruptCheckpointError(f"checkpoint {self._checkpoint_id()!r}: metadata has no data-file table; it was not "
                                         "written by a distckpt storage layer")
        self.metadata = metadata
        self.is_coordinator = is_coordinator
        self.store = self._store().data_store(metadata.storage_data.save_id)
        self.verified_elsewhere: set = set()

    def skip_verification(self, chunks: set) -> None:
        """Chunks this rank reads only partly and another rank of the load verifies whole (from the load sequence)."""
        self.verified_elsewhere = set(chunks)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    @keeps_plans
    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        read_items(self.store, self.metadata, plan, planner, self._checkpoint_id(),
                   verify=self.verify_checksums, threads=self.thread_count or knobs.io_threads(),
                   verified_elsewhere=getattr(self, "verified_elsewhere", set()), is_coordinator=self.is_coordinator,
                   extension_registry=getattr(self, "extension_registry", None))
        return done(None)
