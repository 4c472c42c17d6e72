"""Google Cloud Storage: checkpoints at ``gs://bucket/prefix``, through the official SDK (google-cloud-storage).

The layout, the commit and the lifecycle of a run are :mod:`.objects`'s, over the primitives here. Without
``overwrite`` the commit is an upload conditional on ``ifGenerationMatch=0`` (created only where no live object
is, decided by the service): of two saves racing to one prefix exactly one wins. Reads are ranged downloads of the
generation seen when the object was opened, so an object replaced during a load is an error, not a mix of two
saves. An object larger than one part goes up in parts uploaded in parallel and composed into it.

Credentials and project come from the usual Google configuration (Application Default Credentials,
``GOOGLE_CLOUD_PROJECT``); ``STORAGE_EMULATOR_HOST`` points the client at an emulator (anonymous credentials).
Needs ``google-cloud-storage`` (``pip install distckpt[gcs]``).
"""

from __future__ import annotations

import hashlib
import http.client
import os
import threading
import time
import uuid
from concurrent.futures import Future, wait
from typing import Any, Callable, Iterable, Optional, Union

from .. import knobs, process_state
from ..engine.blobs import BlobReader, BlobWriter
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, StorageIOError
from ..extras import import_or_explain
from .blob_storage import BlobStorageReader, BlobStorageWriter
from .object_requests import InOrderWriter, PiecewiseReader, Requests, ViewSink, timeouts
from .objects import ObjectClient, ObjectInfo, ObjectStore
from .s3_objects import _pool
from .schemes import register_store

__all__ = ["GcsStore", "GcsObjects", "GcsWriter", "GcsReader", "gcs_store", "parse_gs_url"]

SCHEME = "gs://"
SAVE_ID_TAG = "distckpt-save-id"  # custom metadata of an object put with a tag: the committed save, on metadata.json
FEATURE, EXTRA, PACKAGE = "gs:// checkpoints", "gcs", "google-cloud-storage"
MIN_PART_BYTES = 1 << 20
MAX_COMPOSE = 32  # sources of one compose request
FIX = "check the endpoint (STORAGE_EMULATOR_HOST, where set), the network and the credentials"
_ENV = ("STORAGE_EMULATOR_HOST", "GOOGLE_CLOUD_PROJECT", "GOOGLE_APPLICATION_CREDENTIALS", "HTTPS_PROXY", "https_proxy",
        "HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy")

_CLIENTS: dict[tuple, Any] = {}
_CLIENTS_LOCK = threading.Lock()


def _fresh_lock_in_child() -> None:
    global _CLIENTS_LOCK
    _CLIENTS_LOCK = threading.Lock()  # a parent's thread may have held it at the fork


process_state.on_fork_child(_fresh_lock_in_child)


def parse_gs_url(checkpoint_id: Union[str, os.PathLike]) -> tuple[str, str]:
    """``gs://bucket/some/prefix`` -> ``("bucket", "some/prefix")``; raises CheckpointError on anything else."""
    text = os.fspath(checkpoint_id)
    if not isinstance(text, str) or not text.startswith(SCHEME):
        raise CheckpointError(f"{text!r} is not a gs:// checkpoint id")
    bucket, _, prefix = text[len(SCHEME):].partition("/")
    prefix = prefix.strip("/")
    if not bucket or not prefix:
        raise CheckpointError(f"checkpoint id {text!r} needs a bucket and a prefix inside it, as in gs://my-bucket/run-1/"
                              "step-100; distckpt does not write at the top of a bucket")
    return bucket, prefix


def _sdk(module: str = "google.cloud.storage") -> Any:
    return import_or_explain(module, FEATURE, EXTRA, package=PACKAGE)


def gcs_client() -> Any:
    """This process's client for the environment: the emulator's (anonymous) where ``STORAGE_EMULATOR_HOST`` is set,
    else one with Application Default Credentials. Clients are kept per process (they are not fork-safe)."""
    environment = hashlib.sha256(repr([os.environ.get(k) for k in _ENV]).encode()).hexdigest()
    key = (os.getpid(), environment)
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            storage = _sdk()
            if os.environ.get("STORAGE_EMULATOR_HOST"):
                credentials = _sdk("google.auth.credentials").AnonymousCredentials()
                client = storage.Client(project=os.environ.get("GOOGLE_CLOUD_PROJECT") or "distckpt", credentials=credentials)
            else:
                client = storage.Client()
            _CLIENTS[key] = client
        return client


# ---- failures: which are worth another attempt, which mean no answer, and the typed error of each

def _cause(exc: BaseException) -> BaseException:
    """The failure under the SDK's RetryError (which wraps the last attempt's)."""
    cause = getattr(exc, "cause", None)
    return cause if type(exc).__name__ == "RetryError" and isinstance(cause, BaseException) else exc


def _status(exc: BaseException) -> Optional[int]:
    exc = _cause(exc)
    code = getattr(exc, "code", None)
    if isinstance(code, int):
        return code
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


def _failures() -> tuple:
    core = _sdk("google.api_core.exceptions")
    requests = import_or_explain("requests", FEATURE, EXTRA, package=PACKAGE)
    auth = _sdk("google.auth.exceptions")
    media = _sdk("google.cloud.storage.exceptions")
    return (core.GoogleAPICallError, core.RetryError, requests.RequestException, auth.GoogleAuthError,
            media.InvalidResponse, _cut_short(), OSError)


def _cut_short() -> type:
    """What a response body cut short raises from under the SDK (urllib3's, a dependency of requests)."""
    return import_or_explain("urllib3.exceptions", FEATURE, EXTRA, package=PACKAGE).HTTPError


def _no_answer(exc: BaseException) -> bool:
    exc = _cause(exc)
    requests = import_or_explain("requests", FEATURE, EXTRA, package=PACKAGE)
    auth = _sdk("google.auth.exceptions")
    return isinstance(exc, (requests.ConnectionError, requests.Timeout, auth.TransportError, ConnectionError, TimeoutError))


def _transient(exc: BaseException) -> bool:
    requests = import_or_explain("requests", FEATURE, EXTRA, package=PACKAGE)
    status = _status(exc)
    return (status is not None and (status in (408, 429) or status >= 500)) or _no_answer(exc) or isinstance(
        _cause(exc), (requests.exceptions.ChunkedEncodingError, _cut_short(), http.client.IncompleteRead))


def gcs_error(action: str, where: str, exc: BaseException) -> CheckpointError:
    """A typed error for a failed request, naming the object and, where one is known, the fix."""
    status = _status(exc)
    inner = _cause(exc)
    if status == 404:
        return CheckpointNotFoundError(f"{where} does not exist; the checkpoint is incomplete or damaged")
    if status in (401, 403) or type(inner).__name__ in ("DefaultCredentialsError", "RefreshError"):
        return StorageIOError(f"{action} {where} failed: access denied ({type(inner).__name__}: {inner}); check the "
                              "credentials (GOOGLE_APPLICATION_CREDENTIALS, gcloud auth application-default login) and "
                              "the bucket's IAM permissions")
    if _no_answer(exc):
        return StorageIOError(f"{action} {where} failed: the endpoint did not answer ({type(inner).__name__}: {inner}); {FIX}")
    return StorageIOError(f"{action} {where} failed: {status or type(inner).__name__}: {inner}; {FIX}")


def _retry() -> Any:
    """The SDK's retry of the requests it repeats itself (downloads, resumed where they stopped): bounded in time to
    about the attempts knob's worth of read timeouts."""
    retry = _sdk("google.api_core.retry")
    budget = (knobs.s3_max_attempts() - 1) * (knobs.s3_read_timeout_s() + 2.0) + 0.1
    return retry.Retry(predicate=_transient, initial=0.1, maximum=2.0, multiplier=2.0, timeout=budget)


def _age(when: Any) -> Optional[float]:
    return None if when is None else max(0.0, time.time() - when.timestamp())


class GcsObjects(ObjectClient):
    """One bucket through google-cloud-storage: the primitives of :class:`~distckpt.backends.objects.ObjectStore`."""

    def __init__(self, bucket: str, *, client: Any = None, part_size: Optional[int] = None,
                 upload_concurrency: Optional[int] = None):
        self.bucket_name = bucket
        self.given_client = client
        self.part_size, self.upload_concurrency = part_size, upload_concurrency
        self.requests = Requests("GCS", FIX, _transient, _no_answer, gcs_error, _failures)

    @property
    def bucket(self) -> Any:
        return (self.given_client or gcs_client()).bucket(self.bucket_name)

    def url(self, key: str) -> str:
        return f"{SCHEME}{self.bucket_name}/{key}"

    def _run(self, action: str, key: str, call: Callable[[], Any]) -> Any:
        return self.requests.run(action, self.url(key), call)

    def check(self) -> None:
        try:
            found = self._run("checking the bucket of", "", lambda: self.bucket.exists(timeout=timeouts(), retry=None))
        except StorageIOError as exc:
            if _status(exc.__cause__) == 403:
                return  # a credential for objects alone may not see the bucket; its first request will tell
            raise
        if not found:
            raise self._no_bucket()

    def _no_bucket(self) -> StorageIOError:
        return StorageIOError(f"bucket {self.bucket_name!r} of {self.url('')} does not exist; create it first "
                              "(gcloud storage buckets create), or fix the checkpoint id")

    def put(self, key: str, data: bytes, *, if_absent: bool = False, tag: Optional[str] = None) -> bool:
        def upload() -> None:
            blob = self.bucket.blob(key)
            if tag is not None:
                blob.metadata = {SAVE_ID_TAG: tag}
            blob.upload_from_string(bytes(data), if_generation_match=0 if if_absent else None, timeout=timeouts(),
                                    retry=None, checksum=None)

        try:
            self._run("writing", key, upload)
        except CheckpointNotFoundError:
            raise self._no_bucket() from None  # an upload answered 404: the bucket is not there
        except StorageIOError as exc:
            if if_absent and _status(exc.__cause__) == 412:
                return False  # a live object is there (or our own upload landed and its answer was lost)
            raise
        return True

    def get(self, key: str, limit: Optional[int] = None) -> Optional[bytes]:
        def download() -> bytes:
            end = None if limit is None else max(0, limit - 1)
            return self.bucket.blob(key).download_as_bytes(start=0, end=end, raw_download=True, checksum=None,
                                                           timeout=timeouts(), retry=None)

        try:
            return self._run("reading", key, download)
        except CheckpointNotFoundError:
            return None
        except StorageIOError as exc:
            if _status(exc.__cause__) == 416:
                return b""  # a range of an empty object
            raise

    def _blob(self, key: str) -> Any:
        return self._run("looking up", key, lambda: self.bucket.get_blob(key, timeout=timeouts(), retry=None))

    def head(self, key: str) -> Optional[ObjectInfo]:
        blob = self._blob(key)
        if blob is None:
            return None
        return ObjectInfo(key, int(blob.size or 0), _age(blob.updated), (blob.metadata or {}).get(SAVE_ID_TAG))

    def list(self, prefix: str, delimiter: bool = False) -> Iterable[ObjectInfo]:
        def listing() -> list[ObjectInfo]:
            pages = self.bucket.list_blobs(prefix=prefix, delimiter="/" if delimiter else None, timeout=timeouts(), retry=None)
            found = [ObjectInfo(b.name, int(b.size or 0), _age(b.updated)) for b in pages]
            return sorted([ObjectInfo(p) for p in pages.prefixes] + found, key=lambda o: o.key)

        return self._run("listing", prefix, listing)

    def delete(self, keys: list[str]) -> None:
        def one(key: str) -> None:
            try:
                self._run("deleting", key, lambda: self.bucket.delete_blob(key, timeout=timeouts(), retry=None))
            except CheckpointNotFoundError:
                pass  # gone already

        for future in [_pool().submit(one, key) for key in keys]:
            future.result()

    def touch(self, key: str) -> None:
        """Copy the object onto itself (a new generation, written now): a copy of an object that was dropped
        meanwhile fails, where a read and a put would bring it back."""
        bucket = self.bucket
        self._run("renewing", key, lambda: bucket.copy_blob(bucket.blob(key), bucket, key, timeout=timeouts(), retry=None))

    def _parts(self, buffer_bytes: Optional[int]) -> tuple[int, int]:
        """Part size, and parts uploading at once: each part in flight is held twice (its bytes, and the SDK's copy
        in the request), the one that fills once, all within ``buffer_bytes``, but always at least one."""
        part = max(MIN_PART_BYTES, knobs.s3_part_bytes() if self.part_size is None else self.part_size)
        concurrency = knobs.s3_upload_concurrency() if self.upload_concurrency is None else self.upload_concurrency
        if buffer_bytes is not None:
            part = max(MIN_PART_BYTES, min(part, buffer_bytes // 3))
            concurrency = max(1, min(concurrency, (buffer_bytes // part - 1) // 2))
        return part, concurrency

    def writer(self, key: str, buffer_bytes: Optional[int] = None) -> BlobWriter:
        return GcsObjectWriter(self, key, *self._parts(buffer_bytes))

    def write_buffer_bytes(self, buffer_bytes: Optional[int] = None) -> int:
        part, concurrency = self._parts(buffer_bytes)
        return (2 * concurrency + 1) * part

    def reader(self, key: str, missing: Callable[[Optional[BaseException]], CheckpointError]) -> BlobReader:
        return GcsObjectReader(self, key, missing)


class GcsObjectWriter(InOrderWriter):
    """One object: whole in one upload when it is smaller than a part, else parts uploaded in parallel as objects of
    their own beside it (``<key>.part-<upload>-<n>``, at most ``concurrency`` at once), composed into the object at
    close (32 sources a compose, in a tree) and then deleted. Parts of a save killed meanwhile are objects under its
    prefix like its others: cleanup of dead saves removes them."""

    def __init__(self, objects: GcsObjects, key: str, part_size: int, concurrency: int):
        super().__init__(objects.url(key), part_size)
        self.objects, self.key, self.concurrency = objects, key, concurrency
        self.upload = uuid.uuid4().hex[:12]
        self.parts: list[tuple[str, Future]] = []
        self.made: list[str] = []  # every part and intermediate object written, to delete at the end

    def _whole(self, data: bytes) -> None:
        self.objects.put(self.key, data)

    def _send(self, part: bytearray) -> None:
        in_flight = [f for _, f in self.parts if not f.done()]
        if len(in_flight) >= self.concurrency:
            in_flight[0].result()
        for _, f in self.parts:
            if f.done():
                f.result()  # a part that failed stops the object here
        name = f"{self.key}.part-{self.upload}-{len(self.parts):05d}"
        data = bytes(part)  # the SDK takes bytes; the bytearray goes when this returns
        self.made.append(name)
        self.parts.append((name, _pool().submit(self.objects.put, name, data)))

    def _finish(self) -> None:
        for _, f in self.parts:
            f.result()
        names = [name for name, _ in self.parts]
        bucket = self.objects.bucket
        level = 0
        while len(names) > MAX_COMPOSE:  # compose groups of 32 in parallel, then the groups, until one compose is left
            groups = [names[i: i + MAX_COMPOSE] for i in range(0, len(names), MAX_COMPOSE)]
            names = [f"{self.key}.part-{self.upload}-c{level}-{i:05d}" for i in range(len(groups))]
            self.made += names
            futures = [_pool().submit(self._compose, bucket, group, name) for group, name in zip(groups, names)]
            for future in futures:
                future.result()
            level += 1
        self._compose(bucket, names, self.key)
        self.objects.delete(self.made)  # a failure fails the save, whose discard removes what is left
        self.made, self.parts = [], []

    def _compose(self, bucket: Any, sources: list[str], name: str) -> None:
        self.objects._run("composing", name, lambda: bucket.blob(name).compose(
            [bucket.blob(s) for s in sources], timeout=timeouts(), retry=None))

    def _give_up(self) -> None:
        for _, f in self.parts:
            f.cancel()
        wait([f for _, f in self.parts])
        if self.made and self.objects.requests.gone is None:
            try:
                self.objects.delete(self.made)
            except CheckpointError:
                pass  # the save is discarded, and cleanup removes what is left under its prefix
        self.made, self.parts = [], []


class GcsObjectReader(PiecewiseReader):
    """Ranged downloads of the generation the object had when it was opened."""

    def __init__(self, objects: GcsObjects, key: str, missing: Callable[[Optional[BaseException]], CheckpointError]):
        self.objects, self.key, self.missing = objects, key, missing
        self.where = objects.url(key)
        blob = objects._run("opening", key, lambda: objects.bucket.get_blob(key, timeout=timeouts(), retry=None))
        if blob is None:
            raise missing(None)
        self.size, self.generation = int(blob.size or 0), blob.generation

    def identity(self) -> Optional[tuple]:
        return ("gcs", self.generation) if self.generation else None

    def _read_range(self, views: list, offset: int) -> None:
        sink = ViewSink(views)
        blob = self.objects.bucket.blob(self.key, generation=self.generation)

        def download() -> None:
            sink.seek(0)
            blob.download_to_file(sink, start=offset, end=offset + sink.size - 1, raw_download=True, checksum=None,
                                  timeout=timeouts(), retry=_retry())

        try:
            self.objects.requests.run("reading", self.where, download, attempts=1)  # the SDK resumes a body cut short
        except CheckpointNotFoundError as exc:
            now = self.objects.head(self.key)
            if now is not None:
                raise CorruptCheckpointError(f"{self.where} changed while it was being read (generation {self.generation} "
                                             "is gone); another save replaced this checkpoint. Load again.") from exc
            raise self.missing(exc) from exc
        if sink.filled != sink.size:
            raise StorageIOError(f"reading {self.where} failed: {sink.filled} of {sink.size} bytes at offset {offset} "
                                 f"arrived; {FIX}")


class GcsStore(ObjectStore):
    """One checkpoint prefix (or one save's data prefix) in a bucket."""

    def __init__(self, bucket: str, prefix: str, *, client: Any = None, part_size: Optional[int] = None,
                 upload_concurrency: Optional[int] = None):
        super().__init__(GcsObjects(bucket, client=client, part_size=part_size, upload_concurrency=upload_concurrency),
                         prefix)


def gcs_store(checkpoint_id: str) -> GcsStore:
    """The store of ``gs://bucket/prefix``, configured from the environment (the factory of scheme ``gs``)."""
    bucket, prefix = parse_gs_url(checkpoint_id)
    return GcsStore(bucket, prefix)


class _AtGsUrl:
    """What the gs:// writer and reader share: the store of their checkpoint id, with their client and part options."""

    client: Any = None
    part_size: Optional[int] = None
    upload_concurrency: Optional[int] = None

    def canonical(self, checkpoint_id: Union[str, os.PathLike]) -> str:
        parse_gs_url(checkpoint_id)
        return os.fspath(checkpoint_id)

    def open_store(self, checkpoint_id: str) -> GcsStore:
        bucket, prefix = parse_gs_url(checkpoint_id)
        return GcsStore(bucket, prefix, client=self.client, part_size=self.part_size,
                        upload_concurrency=self.upload_concurrency)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        try:
            return os.fspath(checkpoint_id).startswith(SCHEME)
        except TypeError:
            return False


class GcsWriter(_AtGsUrl, BlobStorageWriter):
    """Writes a checkpoint at ``gs://bucket/prefix``; ``client``: a ready ``google.cloud.storage.Client`` (default:
    one from the environment); ``part_size``, ``upload_concurrency``: as :class:`~distckpt.S3Writer`'s. A
    CheckpointManager on ``gs://`` passes its ``**storage_options`` here."""

    def __init__(self, url: Union[str, os.PathLike, None] = None, *, client: Any = None, thread_count: Optional[int] = None,
                 part_size: Optional[int] = None, upload_concurrency: Optional[int] = None, overwrite: Optional[bool] = None,
                 compression: Optional[str] = None, compression_level: Optional[int] = None):
        super().__init__(url, sync_files=True, thread_count=thread_count, overwrite=overwrite, compression=compression,
                         compression_level=compression_level)
        self.client, self.part_size, self.upload_concurrency = client, part_size, upload_concurrency


class GcsReader(_AtGsUrl, BlobStorageReader):
    """Reads a checkpoint at ``gs://bucket/prefix`` (``client`` as :class:`GcsWriter`'s)."""

    def __init__(self, url: Union[str, os.PathLike, None] = None, *, client: Any = None, verify_checksums: bool = True,
                 thread_count: Optional[int] = None, shared_reads: Optional[bool] = None):
        super().__init__(url, verify_checksums=verify_checksums, thread_count=thread_count, shared_reads=shared_reads)
        self.client = client


register_store("gs", gcs_store, writer=GcsWriter, reader=GcsReader)
