"""S3-compatible object stores: checkpoints at ``s3://bucket/prefix``.

Object stores have no rename, so a checkpoint cannot be built aside and moved
into place. Instead every save writes its data objects under a prefix of its
own, and one PUT of the metadata document commits it::

    <prefix>/metadata.json                          the commit: written last
    <prefix>/saves/<save id>/data-00000.safetensors each save's data objects

A reader sees a checkpoint only once ``metadata.json`` exists, and the
metadata names the save whose objects it reads, so a half-written save is
never visible. Without ``overwrite`` the commit is a conditional PUT
(``If-None-Match: *``): of two saves racing to one prefix exactly one wins.
With ``overwrite``, the old checkpoint stays whole until the new metadata
replaces it; its objects are deleted after that. Reads are ranged GETs,
conditional on the ETag seen when the object was opened, so an object
replaced during a load is an error, not a mix of two saves.

Endpoint, region and credentials come from the usual AWS configuration
(``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``, ``AWS_REGION``, the credential
chain) unless given to the writer/reader. Needs ``boto3`` (``pip install
distckpt[s3]``).
"""

from __future__ import annotations

import os
import re
import time
from typing import Any, Iterable, Optional, Union

from .. import faults, knobs
from ..engine import blobs
from ..engine.blobs import BlobReader, BlobStore, BlobWriter, Keep, keep_now
from ..engine.references import SaveFiles, referenced_by_siblings
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, StorageIOError
from ..format import METADATA_FILE
from ..format.codec import stored_files
from .blob_storage import BlobStorageReader, BlobStorageWriter
from .leases import Lease, save_is_dead
from .s3_objects import (
    LOST_RACE,
    MIN_PART_BYTES,
    NOT_FOUND,
    ObjectReader,
    ObjectWriter,
    S3Session,
    SessionClient,
    client_for,
    error_code,
    list_pages,
    s3_error,
    s3_failures,
)
from .schemes import register_store

__all__ = ["S3Writer", "S3Reader", "S3Store"]

SCHEME = "s3://"
SAVES = "saves"
SAVE_ID_TAG = "distckpt-save-id"  # user metadata of the committed metadata object: the save it commits
LEASES = "leases"
RETIRED = "retired"  # <prefix>/retired/<save id>: the save's objects left are a deleted step's, kept for references
_SAVE_ID = re.compile(r"[0-9A-Za-z_-]{1,64}\Z")


def parse_s3_url(checkpoint_id: Union[str, os.PathLike]) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix")``; raises CheckpointError on anything else."""
    text = os.fspath(checkpoint_id)
    if not isinstance(text, str) or not text.startswith(SCHEME):
        raise CheckpointError(f"{text!r} is not an s3:// checkpoint id")
    bucket, _, prefix = text[len(SCHEME):].partition("/")
    prefix = prefix.strip("/")
    if not bucket or not prefix:
        raise CheckpointError(
            f"checkpoint id {text!r} needs a bucket and a prefix inside it, as in s3://my-bucket/run-1/step-100; "
            "distckpt does not write at the top of a bucket")
    return bucket, prefix


class S3Store(BlobStore):
    """One checkpoint prefix (or one save's data prefix) in a bucket."""

    capabilities = frozenset({blobs.RUNS, blobs.LEASES, blobs.REFERENCES})

    def __init__(self, bucket: str, prefix: str, *, endpoint_url: Optional[str] = None, region_name: Optional[str] = None,
                 part_size: Optional[int] = None, upload_concurrency: Optional[int] = None, client: Any = None,
                 session: Optional[S3Session] = None):
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        self.region_name = region_name
        self.part_size = part_size
        self.upload_concurrency = upload_concurrency
        self._given_client = client
        self.session = session
        self._checkpoint: Optional[S3Store] = None  # for a save's data store: the checkpoint, to explain objects
        self._save_id: Optional[str] = None  # that vanish during a load (see data_store)

    @property
    def client(self):
        client = self._given_client or client_for(self.endpoint_url, self.region_name)
        return client if self.session is None else SessionClient(client, self.session)

    def _sub(self, prefix: str) -> "S3Store":
        return S3Store(self.bucket, prefix, endpoint_url=self.endpoint_url, region_name=self.region_name,
                       part_size=self.part_size, upload_concurrency=self.upload_concurrency, client=self._given_client,
                       session=self.session)

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def describe(self, name: str = "") -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}/{name}" if name else f"{SCHEME}{self.bucket}/{self.prefix}"

    def prepare(self) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except s3_failures() as exc:
            if error_code(exc) in NOT_FOUND | {"NoSuchBucket"}:
                raise StorageIOError(f"bucket {self.bucket!r} of {self.describe()} does not exist; create it first") from exc
            raise s3_error("checking the bucket of", self.describe(), exc) from exc

    def _parts(self, buffer_bytes: Optional[int]) -> tuple[int, int]:
        """Part size, and parts uploading at once: within ``buffer_bytes`` with the part that fills,
        but always at least one (S3's parts are at least 5 MiB, so a tiny budget is exceeded)."""
        part = max(MIN_PART_BYTES, knobs.s3_part_bytes() if self.part_size is None else self.part_size)
        concurrency = knobs.s3_upload_concurrency() if self.upload_concurrency is None else self.upload_concurrency
        if buffer_bytes is not None:
            concurrency = max(1, min(concurrency, buffer_bytes // part - 1))
        return part, concurrency

    def create(self, name: str, buffer_bytes: Optional[int] = None) -> BlobWriter:
        return ObjectWriter(self, name, *self._parts(buffer_bytes))

    def write_buffer_bytes(self, buffer_bytes: Optional[int] = None) -> int:
        part, concurrency = self._parts(buffer_bytes)
        return (concurrency + 1) * part

    def open(self, name: str) -> BlobReader:
        return ObjectReader(self, name)

    def put_atomic(self, name: str, data: bytes, sync: bool) -> None:
        try:
            self._put(name, data)
        except s3_failures() as exc:
            raise s3_error("writing", self.describe(name), exc) from exc

    def _put(self, name: str, data: bytes, **conditions: Any) -> None:
        faults.point("write", self.describe(name))
        self.client.put_object(Bucket=self.bucket, Key=self.key(name), Body=data, **conditions)

    def _get(self, name: str) -> Optional[bytes]:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self.key(name))["Body"].read()
        except s3_failures() as exc:
            if error_code(exc) in NOT_FOUND:
                return None
            raise s3_error("reading", self.describe(name), exc) from exc

    def exists(self, name: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self.key(name))
            return True
        except s3_failures() as exc:
            if error_code(exc) in NOT_FOUND:
                return False
            raise s3_error("looking up", self.describe(name), exc) from exc

    def _keys(self, prefix: str, delimiter: str = "") -> Iterable[str]:
        """Keys (or, with a delimiter, common prefixes) under ``prefix``."""
        pages = list_pages(self.client, Bucket=self.bucket, Prefix=prefix, **({"Delimiter": delimiter} if delimiter else {}))
        try:
            for page in pages:
                if delimiter:
                    yield from (p["Prefix"] for p in page.get("CommonPrefixes", []))
                yield from (o["Key"] for o in page.get("Contents", []))
        except s3_failures() as exc:
            raise s3_error("listing", self.describe(), exc) from exc

    def list(self) -> Iterable[str]:
        start = len(self.prefix) + 1
        return sorted(k[start:] for k in self._keys(self.prefix + "/", "/"))

    # ---- commit: each save has its own prefix; the metadata PUT is the commit

    def staging(self, save_id: str) -> "S3Store":
        return self._sub(f"{self.prefix}/{SAVES}/{_checked_save_id(save_id, self.describe())}")

    def data_store(self, save_id: str) -> "S3Store":
        store = self.staging(save_id)
        store._checkpoint, store._save_id = self, save_id  # to explain objects that vanish during a load
        return store

    def missing(self, name: str, exc: BaseException) -> CheckpointError:
        """The error for data object ``name``, found missing while a load reads this save's objects.

        If the checkpoint's metadata now names another save (or none), the
        checkpoint was overwritten or removed after this load read its metadata.
        """
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
        return s3_error("reading", self.describe(name), exc)

    def commit(self, staging: BlobStore, overwrite: bool, sync: bool) -> None:
        assert isinstance(staging, S3Store)
        document = staging._get(METADATA_FILE)
        if document is None:
            raise CheckpointError(f"{staging.describe(METADATA_FILE)} is missing; the save cannot commit")
        old_save = self._committed_save_id() if overwrite else None
        if old_save is not None and old_save != staging.prefix.rsplit("/", 1)[-1]:
            # marked before it is replaced: a commit cut short before _drop_replaced leaves the replaced save's objects
            # to cleanup as a retired step's (kept while later steps reference them), not as a dead save's to delete
            self._put(f"{RETIRED}/{_checked_save_id(old_save, self.describe())}", b"")
        where = self.describe(METADATA_FILE)
        try:
            faults.point("rename", where)
            # the commit names its save in the object's own metadata: finding the committed save needs no document
            tag = {"Metadata": {SAVE_ID_TAG: staging.prefix.rsplit("/", 1)[-1]}}
            if overwrite:
                self._put(METADATA_FILE, document, **tag)
            else:
                self._put(METADATA_FILE, document, IfNoneMatch="*", **tag)
        except s3_failures() as exc:
            if error_code(exc) in LOST_RACE:
                if self._committed_save_id() == staging.prefix.rsplit("/", 1)[-1]:
                    # our own PUT landed and its answer was lost: the retry found it there
                    self._delete_prefix(staging.key(METADATA_FILE), exact=True)
                    return
                self.discard(staging)
                raise CheckpointError(
                    f"checkpoint {self.describe()!r} was committed by another save while this one was writing; "
                    "this save was discarded and the committed checkpoint left as it is") from None
            raise s3_error("committing", where, exc) from exc
        self._delete_prefix(staging.key(METADATA_FILE), exact=True)
        if old_save is not None and old_save != staging.prefix.rsplit("/", 1)[-1]:
            self._drop_replaced(old_save)

    def _drop_replaced(self, save_id: str) -> None:
        """Delete the objects of the save this commit replaced, or retire them where later steps of its run reference
        some (format 4.0): those stay where ``referenced`` finds them."""
        keep: Optional[set] = set()
        if "/" in self.prefix:
            parent, name = self.prefix.rsplit("/", 1)
            keep = referenced_by_siblings(self._sub(parent), name, save_id)
        if keep == set():
            self._delete_prefix(self.staging(save_id).prefix + "/")
            self._delete_prefix(self.key(f"{RETIRED}/{_checked_save_id(save_id, self.describe())}"), exact=True)
            return
        if keep is not None:
            self._prune_retired(save_id, keep)

    def _committed_save_id(self) -> Optional[str]:
        """The save id the commit recorded on the metadata object, or None (no checkpoint).

        A metadata object without the record was committed by an earlier distckpt: its save id is read
        from the document's data-file table, or None where the document is damaged.
        """
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self.key(METADATA_FILE))
        except s3_failures() as exc:
            if error_code(exc) in NOT_FOUND:
                return None
            raise s3_error("looking up", self.describe(METADATA_FILE), exc) from exc
        recorded = head.get("Metadata", {}).get(SAVE_ID_TAG)
        if recorded is not None:
            return recorded if _SAVE_ID.match(recorded) else None
        document = self._get(METADATA_FILE)
        try:
            files = None if document is None else stored_files(document, self.describe(METADATA_FILE))
        except CheckpointError:
            return None
        return None if files is None else files.save_id

    def discard(self, staging: BlobStore) -> None:
        assert isinstance(staging, S3Store)
        if staging.prefix.rsplit("/", 1)[-1] == self._committed_save_id():
            return  # that save committed: its objects are the checkpoint's data now
        prefix = staging.prefix + "/"
        try:
            for up in self._uploads(prefix):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
        except s3_failures() as exc:
            raise s3_error("aborting the uploads under", f"{SCHEME}{self.bucket}/{prefix}", exc) from exc
        self._delete_prefix(prefix)

    def _delete_prefix(self, prefix: str, exact: bool = False) -> None:
        self._delete_keys([prefix] if exact else list(self._keys(prefix)), prefix)

    def _delete_keys(self, keys: list[str], prefix: str) -> None:
        for start in range(0, len(keys), 1000):
            batch = keys[start: start + 1000]
            for key in batch:
                faults.point("unlink", f"{SCHEME}{self.bucket}/{key}")
            try:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
            except s3_failures() as exc:
                raise s3_error("deleting", f"{SCHEME}{self.bucket}/{prefix}", exc) from exc

    def incomplete_saves(self) -> list[str]:
        return [f"{SCHEME}{self.bucket}/{self.prefix}/{SAVES}/{save_id}/" for save_id in self._uncommitted_save_ids()]

    def _uncommitted_save_ids(self) -> list[str]:
        """Saves with objects, or only open multipart uploads (killed before any object completed)."""
        committed = self._committed_save_id()
        base = f"{self.prefix}/{SAVES}/"
        found = {p[len(base):].rstrip("/") for p in self._keys(base, "/")}
        try:
            found |= {up["Key"][len(base):].split("/", 1)[0] for up in self._uploads(base)}
        except s3_failures() as exc:
            raise s3_error("listing the uploads of", self.describe(), exc) from exc
        return sorted(save_id for save_id in found if save_id and _SAVE_ID.match(save_id) and save_id != committed)

    def _uploads(self, prefix: str) -> list[dict]:
        """The multipart uploads in progress under ``prefix``."""
        uploads: list[dict] = []
        marker: dict[str, str] = {}
        while True:
            page = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=prefix, **marker)
            uploads.extend(page.get("Uploads", []))
            if not page.get("IsTruncated"):
                return uploads
            marker = {"KeyMarker": page.get("NextKeyMarker", ""), "UploadIdMarker": page.get("NextUploadIdMarker", "")}

    # ---- a run of checkpoints under this prefix (CheckpointManager)

    def child(self, name: str) -> "S3Store":
        return self._sub(f"{self.prefix}/{name}")

    def children(self) -> list[str]:
        """Names under this prefix holding objects, or only the open uploads of a save killed early."""
        start = len(self.prefix) + 1
        found = {p[start:].rstrip("/") for p in self._keys(self.prefix + "/", "/") if p.endswith("/")}
        try:
            page: dict = {"IsTruncated": True}
            marker: dict[str, str] = {}
            while page.get("IsTruncated"):
                page = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=self.prefix + "/", Delimiter="/", **marker)
                found |= {p["Prefix"][start:].rstrip("/") for p in page.get("CommonPrefixes", [])}
                found |= {u["Key"][start:].split("/", 1)[0] for u in page.get("Uploads", []) if "/" in u["Key"][start:]}
                marker = {"KeyMarker": page.get("NextKeyMarker", ""), "UploadIdMarker": page.get("NextUploadIdMarker", "")}
        except s3_failures() as exc:
            raise s3_error("listing the uploads of", self.describe(), exc) from exc
        return sorted(name for name in found if name)

    def remove(self) -> None:
        """Delete this checkpoint: its metadata first (it disappears whole), then its objects.

        The deletion holds a lease on the committed save meanwhile, so that a deletion cut short
        leaves objects that cleanup can tell are dead (their holder is gone), not ones it must
        wait on as a possibly live save's; the save's objects go before the leases.
        """
        save_id = self._committed_save_id()
        lease = None
        if save_id is not None:
            try:
                lease = Lease(self, save_id)
            except CheckpointError:
                pass  # a lease is there already, left by the save itself: it names a dead process just the same
        self._delete_prefix(self.key(METADATA_FILE), exact=True)
        # an earlier save of this name that retention retired keeps its objects: later steps reference them
        start = len(self.prefix) + 1
        retired = {k[start:].split("/", 1)[1] for k in self._keys(f"{self.prefix}/{RETIRED}/")}
        kept = tuple(f"{SAVES}/{save_id}/" for save_id in retired) + (f"{RETIRED}/",)
        self._delete_keys([k for k in self._keys(f"{self.prefix}/{SAVES}/") if not k[start:].startswith(kept)], self.prefix)
        self._delete_keys([k for k in self._keys(self.prefix + "/") if not k[start:].startswith(kept)], self.prefix)
        if lease is not None:
            lease.release()

    def referenced(self, checkpoint: str, save_id: str) -> BlobStore:
        parent = self.prefix.rsplit("/", 1)[0] if "/" in self.prefix else ""
        sibling = self._sub(f"{parent}/{checkpoint}" if parent else checkpoint)
        # a retired step keeps its referenced objects where its save put them: the save id is in every key
        return SaveFiles([sibling.staging(save_id)], save_id, f"{sibling.describe()} (save {save_id})", exact=True)

    def retire(self, save_id: str, keep: set) -> None:
        """Uncommit (the metadata object goes first), then delete the save's objects that no kept step references.
        A marker (``retired/<save id>``) tells cleanup that what is left is kept on purpose, not a dead save's."""
        self._put(f"{RETIRED}/{_checked_save_id(save_id, self.describe())}", b"")
        self._delete_prefix(self.key(METADATA_FILE), exact=True)
        self._prune_retired(save_id, keep)

    def _prune_retired(self, save_id: str, keep: set) -> None:
        """Delete the objects of retired save ``save_id`` not in ``keep``; the marker goes with the last of them."""
        data = self.staging(save_id)
        start = len(data.prefix) + 1
        found = list(self._keys(data.prefix + "/"))
        self._delete_keys([k for k in found if k[start:] not in keep], data.prefix + "/")
        if not any(k[start:] in keep for k in found):
            self._delete_prefix(self.key(f"{RETIRED}/{save_id}"), exact=True)

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
            for save_id in child._lease_ids():  # leases left by saves that ended without giving them back
                if (save_id == committed or not child.staging(save_id).sizes()) and save_is_dead(child, save_id, None):
                    child.drop_lease(save_id)
        return removed

    def _age(self) -> Optional[float]:
        """Seconds since the newest object under this prefix was written (None: no object)."""
        newest = None
        pages = list_pages(self.client, Bucket=self.bucket, Prefix=self.prefix + "/")
        try:
            for page in pages:
                for o in page.get("Contents", []):
                    t = o["LastModified"].timestamp()
                    newest = t if newest is None else max(newest, t)
            for up in self._uploads(self.prefix + "/"):  # a save killed before any object completed has only these
                t = up["Initiated"].timestamp()
                newest = t if newest is None else max(newest, t)
        except s3_failures() as exc:
            raise s3_error("listing", self.describe(), exc) from exc
        return None if newest is None else max(0.0, time.time() - newest)

    def sizes(self) -> dict[str, int]:
        start = len(self.prefix) + 1
        out = {}
        pages = list_pages(self.client, Bucket=self.bucket, Prefix=self.prefix + "/", Delimiter="/")
        try:
            for page in pages:
                out.update({o["Key"][start:]: o["Size"] for o in page.get("Contents", [])})
        except s3_failures() as exc:
            raise s3_error("listing", self.describe(), exc) from exc
        return out

    # ---- leases: one small object per save in flight, under <prefix>/leases/

    def _lease_name(self, save_id: str) -> str:
        return f"{LEASES}/{_checked_save_id(save_id, self.describe())}"

    def _lease_ids(self) -> list[str]:
        base = f"{self.prefix}/{LEASES}/"
        return sorted(k[len(base):] for k in self._keys(base) if _SAVE_ID.match(k[len(base):]))

    def put_lease(self, save_id: str, record: bytes) -> None:
        try:
            self._put(self._lease_name(save_id), record, IfNoneMatch="*")
        except s3_failures() as exc:
            if error_code(exc) in LOST_RACE and self._get(self._lease_name(save_id)) == record:
                return  # our own PUT landed and its answer was lost: the retry found our record there
            raise s3_error("creating the lease", self.describe(self._lease_name(save_id)), exc) from exc

    def renew_lease(self, save_id: str) -> None:
        """Refresh the lease object's LastModified by copying it onto itself: a copy of an object that was
        dropped meanwhile fails, where a read and a put would bring a released lease back to life."""
        key = self.key(self._lease_name(save_id))
        self.client.copy_object(Bucket=self.bucket, Key=key, CopySource={"Bucket": self.bucket, "Key": key},
                                MetadataDirective="REPLACE")

    def read_lease(self, save_id: str) -> Optional[tuple[bytes, Optional[float]]]:
        try:
            got = self.client.get_object(Bucket=self.bucket, Key=self.key(self._lease_name(save_id)))
            record = got["Body"].read(4096)
        except s3_failures() as exc:
            if error_code(exc) in NOT_FOUND:
                return None
            raise s3_error("reading", self.describe(self._lease_name(save_id)), exc) from exc
        modified = got.get("LastModified")
        return record, (None if modified is None else max(0.0, time.time() - modified.timestamp()))

    def drop_lease(self, save_id: str) -> None:
        self._delete_prefix(self.key(self._lease_name(save_id)), exact=True)


def _checked_save_id(save_id: str, where: str) -> str:
    if not isinstance(save_id, str) or not _SAVE_ID.match(save_id):
        raise CorruptCheckpointError(f"{where}: save id {str(save_id)!r:.80} is not a plain identifier")
    return save_id


def s3_store(checkpoint_id: str) -> S3Store:
    """The store of ``s3://bucket/prefix``, configured from the environment (the factory of scheme ``s3``)."""
    bucket, prefix = parse_s3_url(checkpoint_id)
    return S3Store(bucket, prefix)


class _AtUrl:
    """An S3 writer or reader names its checkpoint by its URL, as ``url``, and opens it with its options."""

    def _init_s3(self, endpoint_url, region_name, client, part_size=None, upload_concurrency=None) -> None:
        self.endpoint_url = endpoint_url
        self.region_name = region_name
        self.client = client
        self.part_size = part_size
        self.upload_concurrency = upload_concurrency
        self._session: Optional[S3Session] = None  # the deadline of the save or load in progress

    @property
    def url(self) -> Optional[str]:
        return self.checkpoint_id  # type: ignore[attr-defined]

    def canonical(self, checkpoint_id) -> str:
        parse_s3_url(checkpoint_id)
        return os.fspath(checkpoint_id)

    def open_store(self, checkpoint_id: str) -> S3Store:
        bucket, prefix = parse_s3_url(checkpoint_id)
        return S3Store(bucket, prefix, endpoint_url=self.endpoint_url, region_name=self.region_name,
                       part_size=self.part_size, upload_concurrency=self.upload_concurrency, client=self.client,
                       session=self._session)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        try:
            return os.fspath(checkpoint_id).startswith(SCHEME)
        except TypeError:
            return False


class S3Writer(_AtUrl, BlobStorageWriter):
    """Writes a checkpoint to an S3-compatible object store at ``s3://bucket/prefix``.

    Args:
        url: the checkpoint's location (may also be given as ``checkpoint_id``).
        endpoint_url, region_name: override the AWS configuration (e.g. a MinIO or Ceph endpoint).
        client: a ready boto3 S3 client to use instead.
        thread_count: objects uploaded in parallel per rank (default: the DISTCKPT_IO_THREADS knob).
        part_size: multipart-upload part size in bytes (default: the DISTCKPT_S3_PART_BYTES
            knob, 16 MiB; at least 5 MiB).
        upload_concurrency: parts of one object uploading at once (default: the
            DISTCKPT_S3_UPLOAD_CONCURRENCY knob, 4); memory per object in flight is about
            ``part_size * (upload_concurrency + 1)``.
        overwrite: replace a committed checkpoint at ``url``; the old one stays intact
            until the new metadata replaces it, then its objects are deleted.
        compression, compression_level: byte-grouped zstd of every chunk, as
            :class:`~distckpt.backends.blob_storage.BlobStorageWriter` says.
    """

    def __init__(self, url: Union[str, os.PathLike, None] = None, *, endpoint_url: Optional[str] = None,
                 region_name: Optional[str] = None, client: Any = None, thread_count: Optional[int] = None,
                 part_size: Optional[int] = None, upload_concurrency: Optional[int] = None,
                 overwrite: Optional[bool] = None, compression: Optional[str] = None, compression_level: Optional[int] = None):
        super().__init__(url, sync_files=True, thread_count=thread_count, overwrite=overwrite, compression=compression,
                         compression_level=compression_level)
        self._init_s3(endpoint_url, region_name, client, part_size, upload_concurrency)

    def set_up_storage_writer(self, *args: Any, **kwargs: Any) -> None:
        self._session = S3Session()  # the save's deadline starts here (DISTCKPT_S3_DEADLINE_S)
        super().set_up_storage_writer(*args, **kwargs)


class S3Reader(_AtUrl, BlobStorageReader):
    """Reads a checkpoint written by :class:`S3Writer` (same arguments, plus ``verify_checksums`` and
    ``shared_reads``, as :class:`~distckpt.backends.BlobStorageReader`'s)."""

    def __init__(self, url: Union[str, os.PathLike, None] = None, *, endpoint_url: Optional[str] = None,
                 region_name: Optional[str] = None, client: Any = None, verify_checksums: bool = True,
                 thread_count: Optional[int] = None, shared_reads: Optional[bool] = None):
        super().__init__(url, verify_checksums=verify_checksums, thread_count=thread_count, shared_reads=shared_reads)
        self._init_s3(endpoint_url, region_name, client)

    def read_metadata(self, *args: Any, **kwargs: Any):
        self._session = S3Session()  # the load's deadline starts here (DISTCKPT_S3_DEADLINE_S)
        store = self._store()
        if not store.exists(METADATA_FILE):
            pending = store.incomplete_saves()
            if pending:
                raise CheckpointNotFoundError(
                    f"checkpoint {self.url!r} is incomplete: its save never committed (uncommitted data under "
                    f"{pending[0]!r}). Load an earlier checkpoint.")
        return super().read_metadata(*args, **kwargs)


register_store("s3", s3_store, writer=S3Writer, reader=S3Reader)
