"""S3-compatible object stores: checkpoints at ``s3://bucket/prefix``.

The layout, the commit and the lifecycle of a run are :mod:`.objects`'s, over the primitives here. Without
``overwrite`` the commit is a conditional PUT (``If-None-Match: *``): of two saves racing to one prefix exactly
one wins. Reads are ranged GETs, conditional on the ETag seen when the object was opened, so an object replaced
during a load is an error, not a mix of two saves. Large objects go up as multipart uploads in parallel parts.

Endpoint, region and credentials come from the usual AWS configuration
(``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``, ``AWS_REGION``, the credential
chain) unless given to the writer/reader. Needs ``boto3`` (``pip install
distckpt[s3]``).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Iterable, Optional, Union

from .. import knobs
from ..engine.blobs import BlobReader, BlobWriter
from ..errors import CheckpointError, CheckpointNotFoundError, StorageIOError
from ..format import METADATA_FILE
from .blob_storage import BlobStorageReader, BlobStorageWriter
from .objects import ObjectClient, ObjectInfo, ObjectStore, Upload
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

__all__ = ["S3Writer", "S3Reader", "S3Store", "S3Objects"]

SCHEME = "s3://"
SAVE_ID_TAG = "distckpt-save-id"  # user metadata of an object put with a tag: the committed save, on metadata.json


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


def _age(when: Any) -> Optional[float]:
    return None if when is None else max(0.0, time.time() - when.timestamp())


class S3Objects(ObjectClient):
    """One bucket through boto3: the primitives of :class:`~distckpt.backends.objects.ObjectStore`."""

    def __init__(self, bucket: str, *, endpoint_url: Optional[str] = None, region_name: Optional[str] = None,
                 part_size: Optional[int] = None, upload_concurrency: Optional[int] = None, client: Any = None,
                 session: Optional[S3Session] = None):
        self.bucket = bucket
        self.endpoint_url = endpoint_url
        self.region_name = region_name
        self.part_size = part_size
        self.upload_concurrency = upload_concurrency
        self.given_client = client
        self.session = session

    @property
    def client(self):
        client = self.given_client or client_for(self.endpoint_url, self.region_name)
        return client if self.session is None else SessionClient(client, self.session)

    def url(self, key: str) -> str:
        return f"{SCHEME}{self.bucket}/{key}"

    def check(self) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except s3_failures() as exc:
            if error_code(exc) in NOT_FOUND | {"NoSuchBucket"}:
                raise StorageIOError(f"bucket {self.bucket!r} of {self.url('')} does not exist; create it first") from exc
            raise s3_error("checking the bucket of", self.url(""), exc) from exc

    def put(self, key: str, data: bytes, *, if_absent: bool = False, tag: Optional[str] = None) -> bool:
        extra: dict[str, Any] = {"IfNoneMatch": "*"} if if_absent else {}
        if tag is not None:
            extra["Metadata"] = {SAVE_ID_TAG: tag}
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=data, **extra)
        except s3_failures() as exc:
            if if_absent and error_code(exc) in LOST_RACE:
                return False
            raise s3_error("writing", self.url(key), exc) from exc
        return True

    def get(self, key: str, limit: Optional[int] = None) -> Optional[bytes]:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"]
            return body.read() if limit is None else body.read(limit)
        except s3_failures() as exc:
            if error_code(exc) in NOT_FOUND:
                return None
            raise s3_error("reading", self.url(key), exc) from exc

    def head(self, key: str) -> Optional[ObjectInfo]:
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=key)
        except s3_failures() as exc:
            if error_code(exc) in NOT_FOUND:
                return None
            raise s3_error("looking up", self.url(key), exc) from exc
        return ObjectInfo(key, int(head.get("ContentLength", 0)), _age(head.get("LastModified")),
                          head.get("Metadata", {}).get(SAVE_ID_TAG))

    def list(self, prefix: str, delimiter: bool = False) -> Iterable[ObjectInfo]:
        pages = list_pages(self.client, Bucket=self.bucket, Prefix=prefix, **({"Delimiter": "/"} if delimiter else {}))
        out = []
        try:
            for page in pages:
                out += [ObjectInfo(p["Prefix"]) for p in page.get("CommonPrefixes", [])]
                out += [ObjectInfo(o["Key"], o["Size"], _age(o.get("LastModified"))) for o in page.get("Contents", [])]
        except s3_failures() as exc:
            raise s3_error("listing", self.url(prefix), exc) from exc
        return out

    def delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):
            batch = keys[start: start + 1000]
            try:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
            except s3_failures() as exc:
                raise s3_error("deleting", self.url(batch[0]), exc) from exc

    def touch(self, key: str) -> None:
        """Copy the object onto itself: a copy of an object that was dropped meanwhile fails, where a read and a put
        would bring it back."""
        try:
            self.client.copy_object(Bucket=self.bucket, Key=key, CopySource={"Bucket": self.bucket, "Key": key},
                                    MetadataDirective="REPLACE")
        except s3_failures() as exc:
            raise s3_error("renewing", self.url(key), exc) from exc

    def _parts(self, buffer_bytes: Optional[int]) -> tuple[int, int]:
        """Part size, and parts uploading at once: within ``buffer_bytes`` with the part that fills,
        but always at least one (S3's parts are at least 5 MiB, so a tiny budget is exceeded)."""
        part = max(MIN_PART_BYTES, knobs.s3_part_bytes() if self.part_size is None else self.part_size)
        concurrency = knobs.s3_upload_concurrency() if self.upload_concurrency is None else self.upload_concurrency
        if buffer_bytes is not None:
            concurrency = max(1, min(concurrency, buffer_bytes // part - 1))
        return part, concurrency

    def writer(self, key: str, buffer_bytes: Optional[int] = None) -> BlobWriter:
        return ObjectWriter(self, key, *self._parts(buffer_bytes))

    def write_buffer_bytes(self, buffer_bytes: Optional[int] = None) -> int:
        part, concurrency = self._parts(buffer_bytes)
        return (concurrency + 1) * part

    def reader(self, key: str, missing: Callable[[Optional[BaseException]], CheckpointError]) -> BlobReader:
        return ObjectReader(self, key, missing)

    def uploads(self, prefix: str) -> list[Upload]:
        found: list[Upload] = []
        marker: dict[str, str] = {}
        try:
            while True:
                page = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=prefix, **marker)
                found += [Upload(u["Key"], u["UploadId"], _age(u.get("Initiated"))) for u in page.get("Uploads", [])]
                if not page.get("IsTruncated"):
                    return found
                marker = {"KeyMarker": page.get("NextKeyMarker", ""), "UploadIdMarker": page.get("NextUploadIdMarker", "")}
        except s3_failures() as exc:
            raise s3_error("listing the uploads under", self.url(prefix), exc) from exc

    def abort(self, upload: Upload) -> None:
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=upload.key, UploadId=upload.upload_id)
        except s3_failures() as exc:
            raise s3_error("aborting the upload of", self.url(upload.key), exc) from exc


class S3Store(ObjectStore):
    """One checkpoint prefix (or one save's data prefix) in a bucket."""

    def __init__(self, bucket: str, prefix: str, *, endpoint_url: Optional[str] = None, region_name: Optional[str] = None,
                 part_size: Optional[int] = None, upload_concurrency: Optional[int] = None, client: Any = None,
                 session: Optional[S3Session] = None):
        super().__init__(S3Objects(bucket, endpoint_url=endpoint_url, region_name=region_name, part_size=part_size,
                                   upload_concurrency=upload_concurrency, client=client, session=session), prefix)

    @property
    def bucket(self) -> str:
        return self.objects.bucket

    @property
    def client(self):
        return self.objects.client


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
