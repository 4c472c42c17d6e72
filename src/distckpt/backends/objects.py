"""Checkpoints on an object store, and the whole lifecycle of a run of them, written once over a few primitives.

An object store has no rename, so a checkpoint cannot be built aside and moved into place. Every save writes its
data objects under a prefix of its own, and one conditional PUT of the metadata document commits it::

    <prefix>/metadata.json                          the commit: written last, tagged with its save id
    <prefix>/saves/<save id>/data-00000.safetensors each save's data objects
    <prefix>/leases/<save id>                       the lease of a save in flight (leases.py)
    <prefix>/retired/<save id>                      marker: what is left of that save is a deleted step's, kept
                                                    because later steps reference it

A reader sees a checkpoint only once ``metadata.json`` exists, and the metadata names the save whose objects it
reads, so a half-written save is never visible. Without ``overwrite`` the commit is created only where no object
is: of two saves racing to one prefix exactly one wins. With ``overwrite`` the old checkpoint stays whole until the
new metadata replaces it; its objects go after that, except those later steps of the run reference.

:class:`ObjectStore` is that lifecycle (commit, overwrite, retire, mark and sweep of retired steps, cleanup of dead
saves, leases), for any :class:`ObjectClient`: the store-specific part is only the client's primitives. The S3
store and the in-memory store are two clients; a new store passes :mod:`distckpt.testing.blob_store_suite` with
nothing more than a client.
"""

from __future__ import annotations

import abc
import copy
import logging
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from .. import faults, knobs
from ..engine.blobs import LEASES, REFERENCES, RUNS, BlobReader, BlobStore, BlobWriter, Keep, keep_now
from ..engine.references import SaveFiles, referenced_by_siblings
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, StorageIOError
from ..format import METADATA_FILE
from ..format.codec import stored_files
from .leases import Lease, save_is_dead
from .run_guard import deleting

__all__ = ["ObjectClient", "ObjectInfo", "ObjectStore", "Upload"]

SAVES = "saves"
LEASE_DIR = "leases"
RETIRED = "retired"
_SAVE_ID = re.compile(r"[0-9A-Za-z_-]{1,64}\Z")
log = logging.getLogger("distckpt")


@dataclass(frozen=True)
class ObjectInfo:
    """One object (or, from a delimited listing, one deeper prefix: ``key`` ends in ``/``)."""

    key: str
    size: int = 0
    age_s: Optional[float] = None  # seconds since it was written; None where the store cannot tell
    tag: Optional[str] = None  # what ``put(..., tag=)`` kept with it


@dataclass(frozen=True)
class Upload:
    """An upload in progress that holds storage but is no object yet (an S3 multipart upload)."""

    key: str
    upload_id: str
    age_s: Optional[float] = None


class ObjectClient(abc.ABC):
    """One namespace of objects (a bucket, a container, a dict): the primitives of a store.

    Keys are full keys in the namespace. Every method raises only typed distckpt errors
    (:class:`~distckpt.errors.StorageIOError` naming the key and the fix, for what the service refused), and
    answers None or False, not an error, for an object that is not there.
    """

    @abc.abstractmethod
    def url(self, key: str) -> str:
        """``key`` as users name it (``s3://bucket/key``), for messages."""

    def check(self) -> None:
        """Raise StorageIOError, naming the fix, unless the namespace exists and answers."""

    @abc.abstractmethod
    def put(self, key: str, data: bytes, *, if_absent: bool = False, tag: Optional[str] = None) -> bool:
        """Store ``data`` whole as ``key``: a reader sees the old object or all of the new one. With ``if_absent``,
        only where no object is, decided by the service in one step (False: one was, and nothing was written).
        ``tag``, a short identifier, is kept with the object (``head`` returns it)."""

    @abc.abstractmethod
    def get(self, key: str, limit: Optional[int] = None) -> Optional[bytes]:
        """The object's bytes (at most ``limit`` of them), or None if there is none."""

    @abc.abstractmethod
    def head(self, key: str) -> Optional[ObjectInfo]:
        """What the store knows of ``key`` without reading it, or None if there is none."""

    @abc.abstractmethod
    def list(self, prefix: str, delimiter: bool = False) -> Iterable[ObjectInfo]:
        """The objects whose keys start with ``prefix``. With ``delimiter``, only those with no ``/`` after the
        prefix, and one entry (its key ending in ``/``) for each deeper prefix instead of the objects under it."""

    @abc.abstractmethod
    def delete(self, keys: list[str]) -> None:
        """Delete ``keys``; one that is gone already is no error."""

    @abc.abstractmethod
    def touch(self, key: str) -> None:
        """Make ``key``'s age zero; raise CheckpointNotFoundError if it is gone (never bring it back)."""

    @abc.abstractmethod
    def writer(self, key: str, buffer_bytes: Optional[int] = None) -> BlobWriter:
        """Stream a new object ``key``, visible only once the writer is closed (within ``buffer_bytes`` of
        buffers, as :meth:`BlobStore.create` says)."""

    def write_buffer_bytes(self, buffer_bytes: Optional[int] = None) -> int:
        """The most bytes of buffers one writer from ``writer(key, buffer_bytes)`` holds."""
        return 0

    @abc.abstractmethod
    def reader(self, key: str, missing: Callable[[Optional[BaseException]], CheckpointError]) -> BlobReader:
        """Read ``key``; the bytes of the object as it was opened, or an error. Where the object is not there (at
        the open, or gone during a read), raise ``missing(cause)``. The reader's ``identity()`` names the version
        read (an ETag, a generation): an incremental save references an earlier step only when it can tell that
        the step's metadata is the version it remembers, so a store whose readers have none saves every step whole."""

    def uploads(self, prefix: str) -> list[Upload]:
        """Uploads in progress under ``prefix`` (a store with none: none)."""
        return []

    def abort(self, upload: Upload) -> None:
        """Give up an upload in progress and what it holds."""


def _fault(kind: str, action: str, where: str) -> None:
    """Fault point ``kind`` (distckpt.faults) of a call to the store: an injected OSError fails as the call would."""
    try:
        faults.point(kind, where)
    except OSError as exc:
        raise StorageIOError(f"{action} {where} failed: {exc.strerror or exc}", exc.errno) from exc


def checked_save_id(save_id: str, where: str) -> str:
    if not isinstance(save_id, str) or not _SAVE_ID.match(save_id):
        raise CorruptCheckpointError(f"{where}: save id {str(save_id)!r:.80} is not a plain identifier")
    return save_id


class ObjectStore(BlobStore):
    """One checkpoint prefix (or one save's data prefix) of an :class:`ObjectClient`'s namespace."""

    capabilities = frozenset({RUNS, LEASES, REFERENCES})

    def __init__(self, objects: ObjectClient, prefix: str):
        self.objects = objects
        self.prefix = prefix.strip("/")
        if not self.prefix:
            raise CheckpointError(f"{objects.url('')!r} names no checkpoint: give it a name, as in "
                                  f"{objects.url('run-1/step-100')!r}")
        self._checkpoint: Optional[ObjectStore] = None  # for a save's data store: the checkpoint, to explain objects
        self._save_id: Optional[str] = None  # that vanish during a load (see data_store)
        self._a_save = False  # one save's data store (staging), not a checkpoint

    def write_streams(self) -> int:
        return knobs.object_write_streams()

    def _sub(self, prefix: str) -> "ObjectStore":
        sub = copy.copy(self)
        sub.prefix, sub._checkpoint, sub._save_id, sub._a_save = prefix.strip("/"), None, None, False
        return sub

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def describe(self, name: str = "") -> str:
        return self.objects.url(self.key(name) if name else self.prefix)

    def prepare(self) -> None:
        self.objects.check()

    def _check_placement(self) -> None:
        """Raise CheckpointError where this checkpoint would sit inside another's layout (``<ckpt>/saves/<name>``):
        that checkpoint's cleanup would take it for one of its own dead saves."""
        parts = self.prefix.split("/")
        if not self._a_save and len(parts) >= 3 and parts[-2] in (SAVES, LEASE_DIR, RETIRED):
            holder = self._sub("/".join(parts[:-2]))
            if holder.exists(METADATA_FILE):
                raise CheckpointError(
                    f"{self.describe()} is inside the layout of checkpoint {holder.describe()!r} ({parts[-2]}/ holds its "
                    "saves, leases and retired files, which its cleanup removes): save to another name")

    # ---- blobs

    def create(self, name: str, buffer_bytes: Optional[int] = None) -> BlobWriter:
        return self.objects.writer(self.key(name), buffer_bytes)

    def write_buffer_bytes(self, buffer_bytes: Optional[int] = None) -> int:
        return self.objects.write_buffer_bytes(buffer_bytes)

    def open(self, name: str) -> BlobReader:
        return self.objects.reader(self.key(name), lambda cause: self.missing(name, cause))

    def put_atomic(self, name: str, data: bytes, sync: bool) -> None:
        self._put(name, data)

    def _put(self, name: str, data: bytes, if_absent: bool = False, tag: Optional[str] = None) -> bool:
        _fault("write", "writing", self.describe(name))
        return self.objects.put(self.key(name), data, if_absent=if_absent, tag=tag)

    def exists(self, name: str) -> bool:
        return self.objects.head(self.key(name)) is not None

    def _keys(self, prefix: str, delimiter: bool = False) -> list[str]:
        return [o.key for o in self.objects.list(prefix, delimiter)]

    def list(self) -> Iterable[str]:
        start = len(self.prefix) + 1
        return sorted(k[start:] for k in self._keys(self.prefix + "/", True))

    def sizes(self) -> dict[str, int]:
        start = len(self.prefix) + 1
        return {o.key[start:]: o.size for o in self.objects.list(self.prefix + "/", True) if not o.key.endswith("/")}

    def _delete_keys(self, keys: list[str]) -> None:
        for key in keys:
            _fault("unlink", "deleting", self.objects.url(key))
        if keys:
            self.objects.delete(keys)

    def _delete_prefix(self, prefix: str) -> None:
        self._delete_keys(self._keys(prefix))

    # ---- commit: each save has its own prefix; the metadata PUT is the commit

    def staging(self, save_id: str) -> "ObjectStore":
        store = self._sub(f"{self.prefix}/{SAVES}/{checked_save_id(save_id, self.describe())}")
        store._a_save = True
        return store

    def data_store(self, save_id: str) -> "ObjectStore":
        store = self.staging(save_id)
        store._checkpoint, store._save_id = self, save_id  # to explain objects that vanish during a load
        return store

    def missing(self, name: str, cause: Optional[BaseException] = None) -> CheckpointError:
        """The error for object ``name``, found missing. Where this is a save's data store and the checkpoint's
        metadata now names another save (or none), the checkpoint was overwritten or removed while a load read it."""
        checkpoint = self._checkpoint
        if checkpoint is not None:
            now = checkpoint._committed_save_id()
            if now is None:
                return CheckpointNotFoundError(
                    f"{self.describe(name)} is gone: checkpoint {checkpoint.describe()!r} was removed while this load read it")
            if now != self._save_id:
                return CorruptCheckpointError(
                    f"{self.describe(name)} is gone: checkpoint {checkpoint.describe()!r} was overwritten by save {now} "
                    f"while this load read save {self._save_id}. Load again to read the new checkpoint.")
        return CheckpointNotFoundError(f"{self.describe(name)} does not exist; the checkpoint is incomplete or damaged")

    def _saved_as(self) -> str:
        """The save id of this save's data store (its prefix's last part)."""
        return self.prefix.rsplit("/", 1)[-1]

    def commit(self, staging: BlobStore, overwrite: bool, sync: bool) -> None:
        assert isinstance(staging, ObjectStore)
        document = self.objects.get(staging.key(METADATA_FILE))
        if document is None:
            raise CheckpointError(f"{staging.describe(METADATA_FILE)} is missing; the save cannot commit")
        new = staging._saved_as()
        old = self._committed_save_id() if overwrite else None
        if old is not None and old != new:
            # marked before it is replaced: a commit cut short before _drop_replaced leaves the replaced save's objects
            # to cleanup as a retired step's (kept while later steps reference them), not as a dead save's to delete
            self._put(f"{RETIRED}/{checked_save_id(old, self.describe())}", b"")
        _fault("rename", "committing", self.describe(METADATA_FILE))
        # the commit names its save on the object itself: finding the committed save needs no document
        if not self._put(METADATA_FILE, document, if_absent=not overwrite, tag=new):
            if self._committed_save_id() == new:
                pass  # our own PUT landed and its answer was lost: the retry found it there
            else:
                self.discard(staging)
                raise CheckpointError(
                    f"checkpoint {self.describe()!r} was committed by another save while this one was writing; "
                    "this save was discarded and the committed checkpoint left as it is")
        try:  # committed: what is left to tidy fails no save (cleanup finds it: a retired marker, a staged copy)
            self._delete_keys([staging.key(METADATA_FILE)])
            if old is not None and old != new:
                self._drop_replaced(old)
        except CheckpointError as exc:
            log.warning("distckpt: %s committed; tidying after it failed (%s): later cleanup removes what is left",
                        self.describe(), exc)

    def _drop_replaced(self, save_id: str) -> None:
        """Delete the objects of the save a commit replaced, or retire them where later steps of its run reference
        some (format 4.0): those stay where ``referenced`` finds them."""
        parent = self.parent()
        with deleting(parent) as guard:
            keep: Optional[set] = set()
            if parent is not None:
                keep = None  # with a save in flight that may come to reference any of it: the next deleter decides
                if not guard.savers_live():  # looked for first: a save it does not see commits after its record
                    keep = referenced_by_siblings(parent, self.prefix.rsplit("/", 1)[1], save_id)
            if keep == set():
                self._delete_prefix(self.staging(save_id).prefix + "/")
                self._delete_keys([self.key(f"{RETIRED}/{checked_save_id(save_id, self.describe())}")])
            elif keep is not None:
                self._prune_retired(save_id, keep)

    def _committed_save_id(self) -> Optional[str]:
        """The save id the commit tagged the metadata object with, or None (no checkpoint). A metadata object
        without a tag that is a save id names its save in the document's file table (None where the document cannot
        be read)."""
        head = self.objects.head(self.key(METADATA_FILE))
        if head is None:
            return None
        if head.tag is not None and _SAVE_ID.match(head.tag):
            return head.tag
        return self._document_save_id()  # no tag (another tool wrote the object), or one that is no save id

    def _document_save_id(self) -> Optional[str]:
        """The save id the committed document's file table names (None: no document, or one that cannot be read)."""
        document = self._metadata_document()
        try:
            files = None if document is None else stored_files(document, self.describe(METADATA_FILE))
        except CheckpointError:
            return None
        return None if files is None else files.save_id

    def _metadata_document(self) -> Optional[bytes]:
        """The committed document, read no further than the loader would (DISTCKPT_MAX_METADATA_BYTES)."""
        limit = knobs.max_metadata_bytes()
        document = self.objects.get(self.key(METADATA_FILE), limit + 1)
        if document is not None and len(document) > limit:
            raise CheckpointError(f"{self.describe(METADATA_FILE)} is over {limit} bytes (DISTCKPT_MAX_METADATA_BYTES); "
                                  "raise it if this checkpoint is yours")
        return document

    def check_replaceable(self) -> None:
        try:
            document = self._metadata_document()
            if document is None:
                return
            if stored_files(document, self.describe(METADATA_FILE)) is not None:
                return
        except CheckpointError as exc:
            raise CheckpointError(f"{self.describe()} holds a metadata document this distckpt cannot read ({exc}); an "
                                  "overwrite would drop objects that kept steps may reference. Save to a new name, or "
                                  "remove it yourself.") from None

    def discard(self, staging: BlobStore) -> None:
        assert isinstance(staging, ObjectStore)
        if staging._saved_as() == self._committed_save_id():
            return  # that save committed: its objects are the checkpoint's data now
        for upload in self.objects.uploads(staging.prefix + "/"):
            self.objects.abort(upload)
        self._delete_prefix(staging.prefix + "/")

    def incomplete_saves(self) -> list[str]:
        return [self.objects.url(f"{self.prefix}/{SAVES}/{save_id}/") for save_id in self._uncommitted_save_ids()]

    def _uncommitted_save_ids(self) -> list[str]:
        """Saves with objects, or only uploads in progress (killed before any object completed)."""
        committed = self._committed_save_id()
        base = f"{self.prefix}/{SAVES}/"
        found = {k[len(base):].rstrip("/") for k in self._keys(base, True)}
        found |= {u.key[len(base):].split("/", 1)[0] for u in self.objects.uploads(base)}
        return sorted(s for s in found if _SAVE_ID.match(s) and s != committed)

    # ---- a run of checkpoints under this prefix (CheckpointManager)

    def child(self, name: str) -> "ObjectStore":
        return self._sub(f"{self.prefix}/{name}")

    def children(self) -> list[str]:
        """Names under this prefix holding objects, or only the uploads of a save killed early."""
        start = len(self.prefix) + 1
        found = {k[start:].rstrip("/") for k in self._keys(self.prefix + "/", True) if k.endswith("/")}
        found |= {u.key[start:].split("/", 1)[0] for u in self.objects.uploads(self.prefix + "/") if "/" in u.key[start:]}
        return sorted(name for name in found if name)

    def remove(self) -> None:
        """Delete this checkpoint: its metadata first (it disappears whole), then its objects.

        The deletion holds a lease on the committed save meanwhile, so that a deletion cut short leaves objects
        that cleanup can tell are dead (their holder is gone), not ones it must wait on as a possibly live save's;
        the save's objects go before the leases. An earlier save of this name that retention retired keeps its
        objects: later steps reference them.
        """
        save_id = self._committed_save_id()
        lease = None
        if save_id is not None:
            try:
                lease = Lease(self, save_id)
            except CheckpointError:
                pass  # a lease is there already, left by the save itself: it names a dead process just the same
        try:
            self._delete_keys([self.key(METADATA_FILE)])
            start = len(self.prefix) + 1
            retired = {k[start:].split("/", 1)[1] for k in self._keys(f"{self.prefix}/{RETIRED}/")}
            kept = tuple(f"{SAVES}/{s}/" for s in retired) + (f"{RETIRED}/",)
            self._delete_keys([k for k in self._keys(f"{self.prefix}/{SAVES}/") if not k[start:].startswith(kept)])
            self._delete_keys([k for k in self._keys(self.prefix + "/") if not k[start:].startswith(kept)])
        except BaseException:
            if lease is not None:
                lease.abandon()  # a deletion cut short: what it left is a dead holder's, for the next cleanup
            raise
        if lease is not None:
            lease.release()

    # ---- references between the steps of a run

    def referenced(self, checkpoint: str, save_id: str) -> BlobStore:
        parent = self.prefix.rsplit("/", 1)[0] if "/" in self.prefix else ""
        sibling = self._sub(f"{parent}/{checkpoint}" if parent else checkpoint)
        # a retired step keeps its referenced objects where its save put them: the save id is in every key
        return SaveFiles([sibling.staging(save_id)], save_id, f"{sibling.describe()} (save {save_id})", exact=True)

    def parent(self) -> Optional["ObjectStore"]:
        return self._sub(self.prefix.rsplit("/", 1)[0]) if "/" in self.prefix else None

    def retire(self, save_id: str, keep: set) -> None:
        """Uncommit (the metadata object goes first), then delete the save's objects that no kept step references.
        A marker (``retired/<save id>``) tells cleanup that what is left is kept on purpose, not a dead save's."""
        self._put(f"{RETIRED}/{checked_save_id(save_id, self.describe())}", b"")
        self._delete_keys([self.key(METADATA_FILE)])
        self._prune_retired(save_id, keep)

    def _prune_retired(self, save_id: str, keep: set) -> None:
        """Delete the objects of retired save ``save_id`` not in ``keep``; the marker goes with the last of them."""
        data = self.staging(save_id)
        start = len(data.prefix) + 1
        found = self._keys(data.prefix + "/")
        self._delete_keys([k for k in found if k[start:] not in keep])
        if not any(k[start:] in keep for k in found):
            self._delete_keys([self.key(f"{RETIRED}/{save_id}")])

    def remove_incomplete_below(self, prefix: str = "", keep: Keep = None) -> list[str]:
        removed = []
        found = [(name, self.child(name)) for name in self.children() if name.startswith(prefix)]
        found = [(name, child, child._uncommitted_save_ids()) for name, child in found]
        # a retired step's: no save is writing there
        retired = {(name, save_id) for name, child, ids in found for save_id in ids if child.exists(f"{RETIRED}/{save_id}")}
        keep = keep_now(keep) if retired else None  # the mark, read after the listing: a step retired since is not in it
        for name, child, ids in found:
            for save_id in ids:
                staging = child.staging(save_id)
                if (name, save_id) in retired:
                    if keep is not None:
                        child._prune_retired(save_id, keep.get((name, save_id), set()))
                    continue
                if not save_is_dead(child, save_id, staging._age()):
                    continue
                child.discard(staging)
                child.drop_lease(save_id)
                removed.append(staging.describe())
            committed = child._committed_save_id()
            for save_id in child.lease_ids():  # leases left by saves that ended without giving them back
                if (save_id == committed or not child.staging(save_id).sizes()) and save_is_dead(child, save_id, None):
                    child.drop_lease(save_id)
        return removed

    def _age(self) -> Optional[float]:
        """Seconds since the newest object (or upload) under this prefix was written; None where none is, or the
        store cannot tell."""
        ages = [o.age_s for o in self.objects.list(self.prefix + "/")]
        ages += [u.age_s for u in self.objects.uploads(self.prefix + "/")]  # a save killed before any object completed
        if not ages or any(a is None for a in ages):
            return None
        return max(0.0, min(ages))

    # ---- leases: one small object per save in flight, under <prefix>/leases/

    def _lease_name(self, save_id: str) -> str:
        return f"{LEASE_DIR}/{checked_save_id(save_id, self.describe())}"

    def lease_ids(self) -> list[str]:
        base = f"{self.prefix}/{LEASE_DIR}/"
        return sorted(k[len(base):] for k in self._keys(base) if _SAVE_ID.match(k[len(base):]))

    def put_lease(self, save_id: str, record: bytes) -> None:
        self._check_placement()  # a save begins here
        name = self._lease_name(save_id)
        if not self._put(name, record, if_absent=True) and self.objects.get(self.key(name), 4096) != record:
            # (the same record there: our own PUT landed and its answer was lost, and the retry found it)
            raise CheckpointError(f"{self.describe(name)}: save {save_id} holds a lease already")

    def renew_lease(self, save_id: str) -> None:
        self.objects.touch(self.key(self._lease_name(save_id)))

    def read_lease(self, save_id: str) -> Optional[tuple[bytes, Optional[float]]]:
        key = self.key(self._lease_name(save_id))
        head = self.objects.head(key)
        record = None if head is None else self.objects.get(key, 4096)
        return None if record is None else (record, head.age_s)

    def drop_lease(self, save_id: str) -> None:
        self._delete_keys([self.key(self._lease_name(save_id))])
