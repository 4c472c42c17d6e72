"""The objects of an S3-compatible store: clients, streaming multipart uploads, ranged reads.

What :mod:`distckpt.backends.s3` builds its blob store from. Every call that
fails becomes a typed distckpt error naming the object (``_s3_error``).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Iterable, Optional

from .. import events, faults, knobs, process_state
from ..engine.blobs import BlobReader, BlobWriter
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, StorageIOError
from ..extras import import_or_explain

MIN_PART_BYTES = 5 << 20  # S3's smallest part, except the last
_MAX_PARTS = 10_000
NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
LOST_RACE = {"412", "PreconditionFailed", "409", "ConditionalRequestConflict"}


# ---- clients: one per process and effective configuration (boto3 clients are thread-safe, not fork-safe)

_CLIENTS: dict[tuple, Any] = {}
_CLIENTS_LOCK = threading.Lock()

# what, besides the arguments, decides which endpoint, credentials and retries a new client gets
_CLIENT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "AWS_REGION",
               "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
               "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_RETRY_MODE", "AWS_CA_BUNDLE",
               "AWS_S3_ADDRESSING_STYLE", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy")


def _fresh_lock_in_child() -> None:
    global _CLIENTS_LOCK
    _CLIENTS_LOCK = threading.Lock()  # a parent's thread may have held it at the fork; the child has no such thread


process_state.on_fork_child(_fresh_lock_in_child)


def client_settings() -> dict[str, Any]:
    """Timeouts and retries of the clients distckpt builds, from the knobs (see knobs.py)."""
    return {"connect_timeout": knobs.s3_connect_timeout_s(), "read_timeout": knobs.s3_read_timeout_s(),
            "retries": {"mode": os.environ.get("AWS_RETRY_MODE", "standard") or "standard",
                        "total_max_attempts": knobs.s3_max_attempts()}}


def botocore_exceptions() -> Any:
    """botocore's exceptions module, or the MissingDependencyError that names the extra to install."""
    return import_or_explain("botocore.exceptions", "s3:// checkpoints", "s3", package="boto3")


def client_for(endpoint_url: Optional[str], region_name: Optional[str]):
    """This process's client for the effective configuration: the arguments, the AWS environment
    (hashed, so no secret is kept in the key) and the timeout and retry knobs."""
    settings = client_settings()
    environment = hashlib.sha256(repr([os.environ.get(k) for k in _CLIENT_ENV]).encode()).hexdigest()
    key = (os.getpid(), endpoint_url, region_name, repr(settings), environment)
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            boto3 = import_or_explain("boto3", "s3:// checkpoints", "s3")
            botocore_config = import_or_explain("botocore.config", "s3:// checkpoints", "s3", package="boto3")
            config = botocore_config.Config(max_pool_connections=64, **settings)
            client = _CLIENTS[key] = boto3.session.Session().client(
                "s3", endpoint_url=endpoint_url, region_name=region_name, config=config)
            client.meta.events.register("after-call.s3", _count_retries)  # botocore retries on its own
        return client


def _count_retries(parsed: Optional[dict] = None, **_: Any) -> None:
    """Count the retries botocore made of a request that ended with an answer (distckpt.events)."""
    attempts = (parsed or {}).get("ResponseMetadata", {}).get("RetryAttempts", 0)
    if isinstance(attempts, int) and attempts > 0:
        events.add_retry(attempts)


class S3Session:
    """The requests of one save or one load: a deadline over them all (``DISTCKPT_S3_DEADLINE_S``), and,
    once the endpoint stopped answering after every attempt, no more waiting on it. Cleanup after such a
    failure is skipped rather than waited for: what it would have removed is removed later by the lease
    rules (``remove_incomplete_below``)."""

    def __init__(self, deadline_s: Optional[float] = None):
        deadline_s = knobs.s3_deadline_s() if deadline_s is None else deadline_s
        self.deadline_s = deadline_s
        self.deadline = time.monotonic() + deadline_s if deadline_s else None
        self.unreachable: Optional[str] = None

    def check(self, action: str) -> None:
        if self.unreachable is not None:
            raise StorageIOError(f"S3 {action} skipped: the endpoint stopped answering earlier in this operation "
                                 f"({self.unreachable}); check the endpoint (AWS_ENDPOINT_URL_S3) and the network")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise StorageIOError(f"S3 {action} not started: this operation passed its deadline of {self.deadline_s:.0f}s "
                                 "(DISTCKPT_S3_DEADLINE_S); raise it for larger checkpoints or a slower store")


class SessionClient:
    """A boto3 client whose every call first checks its session (see S3Session)."""

    def __init__(self, client: Any, session: S3Session):
        self._client = client
        self._session = session

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if name.startswith("_") or name in ("meta", "exceptions") or not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self._session.check(name)
            try:
                return attr(*args, **kwargs)
            except unreachable_errors() as exc:
                self._session.unreachable = f"{name}: {type(exc).__name__}: {exc}"
                raise

        return call


def unreachable_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean the endpoint did not answer in time, after botocore's own attempts."""
    exceptions = botocore_exceptions()
    return (exceptions.ConnectionError, exceptions.ReadTimeoutError)


def stream_errors() -> tuple[type[BaseException], ...]:
    """Errors of a response body cut short: worth asking again for the bytes still missing."""
    exceptions = botocore_exceptions()
    from urllib3.exceptions import HTTPError as Urllib3Error  # botocore's own dependency

    return (exceptions.ConnectionClosedError, exceptions.IncompleteReadError, exceptions.ReadTimeoutError,
            exceptions.ResponseStreamingError, Urllib3Error, ConnectionError, TimeoutError)


def list_pages(client: Any, **kwargs: Any) -> Iterable[dict]:
    """The pages of ``list_objects_v2`` (one call per page, each through ``client``'s checks)."""
    token = None
    while True:
        page = client.list_objects_v2(**kwargs, **({"ContinuationToken": token} if token else {}))
        yield page
        token = page.get("NextContinuationToken")
        if not page.get("IsTruncated") or not token:
            return


def error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def s3_error(action: str, where: str, exc: BaseException) -> CheckpointError:
    """A typed error for a failed S3 call, naming the object and, where one is known, the fix."""
    code = error_code(exc)
    if code in NOT_FOUND:
        return CheckpointNotFoundError(f"{where} does not exist; the checkpoint is incomplete or damaged")
    if code == "NoSuchBucket":
        return StorageIOError(f"{action} {where} failed: the bucket does not exist; create it or fix the checkpoint id")
    if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        return StorageIOError(f"{action} {where} failed: access denied ({code}); check the credentials and the bucket policy")
    if isinstance(exc, OSError) and not code:
        return StorageIOError(f"{action} {where} failed: {exc.strerror or exc}", exc.errno)
    name = type(exc).__name__
    return StorageIOError(f"{action} {where} failed: {code or name}: {exc}; check the endpoint "
                          "(AWS_ENDPOINT_URL_S3), the network and the credentials")


def s3_failures() -> tuple[type[BaseException], ...]:
    exceptions = botocore_exceptions()
    return (exceptions.ClientError, exceptions.BotoCoreError, OSError)


_POOLS: dict[int, ThreadPoolExecutor] = {}


def _pool() -> ThreadPoolExecutor:
    """This process's threads for part uploads and range reads (shared by every object in flight)."""
    with _CLIENTS_LOCK:
        pool = _POOLS.get(os.getpid())
        if pool is None:
            pool = _POOLS[os.getpid()] = ThreadPoolExecutor(knobs.s3_pool_threads(), thread_name_prefix="distckpt-s3")
        return pool


class ObjectWriter(BlobWriter):
    """Streams one object in order as a multipart upload; small objects go up in one PUT.

    Full parts upload in the background, up to ``concurrency`` at once per
    object (each a buffer of ``part_size`` bytes), while the next part fills.
    Writes must arrive in ascending offsets (a gap is zero-filled), which is
    how distckpt writes data files: header first, then items in file order.
    """

    def __init__(self, store: Any, key: str, part_size: int, concurrency: int):
        self.store = store  # an S3Objects: its bucket, and its client of the moment
        self.key = key
        self.where = store.url(key)
        self.part_size = max(MIN_PART_BYTES, part_size)
        self.concurrency = max(1, concurrency)
        self.buf = bytearray()
        self.pos = 0
        self.flushed = 0
        self.parts: list[Future] = []
        self.upload_id: Optional[str] = None
        self.lock = threading.Lock()
        self.closed = False

    def pwrite(self, data: memoryview, offset: int) -> None:
        self.pwritev([data], offset)

    def pwritev(self, buffers: list, offset: int) -> None:
        with self.lock:
            try:
                faults.point("write", self.where)
                if offset < self.pos:
                    raise CheckpointError(f"{self.where}: object stores take bytes in order; a write at byte {offset} "
                                          f"came after {self.pos} bytes were written")
                if offset > self.pos:
                    self._append(memoryview(bytes(offset - self.pos)))
                for b in buffers:
                    self._append(memoryview(b).cast("B"))
            except CheckpointError:
                raise
            except s3_failures() as exc:
                raise s3_error("writing", self.where, exc) from exc

    def _append(self, view: memoryview) -> None:
        while len(view):
            room = self._current_part_size() - len(self.buf)
            self.buf += view[:room]
            view = view[room:]
            if len(self.buf) >= self._current_part_size():
                self._send_part()
        self.pos = self.flushed + len(self.buf)

    def _current_part_size(self) -> int:
        # parts grow so that an object of any size fits in S3's 10,000 parts
        return self.part_size * (1 + len(self.parts) // (_MAX_PARTS // 10))

    def _send_part(self) -> None:
        """Hand the buffer to an upload thread; wait while ``concurrency`` parts are already in flight."""
        client = self.store.client
        if self.upload_id is None:
            self.upload_id = client.create_multipart_upload(Bucket=self.store.bucket, Key=self.key)["UploadId"]
        in_flight = [f for f in self.parts if not f.done()]
        if len(in_flight) >= self.concurrency:
            in_flight[0].result()
        for f in self.parts:
            if f.done():
                f.result()  # an upload that failed stops the object here
        number, body = len(self.parts) + 1, self.buf
        self.parts.append(_pool().submit(self._upload, client, number, body))
        self.flushed += len(body)
        self.buf = bytearray()

    def _upload(self, client, number: int, body: bytearray) -> dict:
        reply = client.upload_part(Bucket=self.store.bucket, Key=self.key, UploadId=self.upload_id,
                                   PartNumber=number, Body=body)
        return {"PartNumber": number, "ETag": reply["ETag"]}

    def close(self, sync: bool) -> None:
        """Upload what is buffered and complete the object (S3 makes it durable before answering)."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            client = self.store.client
            try:
                faults.point("fsync", self.where)
                if self.upload_id is None:
                    client.put_object(Bucket=self.store.bucket, Key=self.key, Body=self.buf)
                else:
                    if self.buf:
                        self._send_part()
                    parts = [f.result() for f in self.parts]
                    client.complete_multipart_upload(Bucket=self.store.bucket, Key=self.key, UploadId=self.upload_id,
                                                     MultipartUpload={"Parts": parts})
            except s3_failures() as exc:
                self._abort_upload()
                raise s3_error("uploading", self.where, exc) from exc
            finally:
                self.buf = bytearray()

    def abort(self) -> None:
        with self.lock:
            self.closed = True
            self.buf = bytearray()
            self._abort_upload()

    def _abort_upload(self) -> None:
        for f in self.parts:
            f.cancel()
        wait(self.parts)
        if self.upload_id is not None:
            try:
                self.store.client.abort_multipart_upload(Bucket=self.store.bucket, Key=self.key, UploadId=self.upload_id)
            except s3_failures():
                pass  # the staging prefix is discarded, and a bucket lifecycle rule clears stale uploads
            self.upload_id = None


class ObjectReader(BlobReader):
    """Ranged GETs of one object, each conditional on the ETag it had when opened.

    A large read into one buffer is split into pieces fetched in parallel.
    """

    def __init__(self, store: Any, key: str, missing: Callable[[Optional[BaseException]], CheckpointError]):
        self.store = store  # an S3Objects: its bucket, and its client of the moment
        self.key = key
        self.where = store.url(key)
        self.missing = missing
        try:
            head = store.client.head_object(Bucket=store.bucket, Key=self.key)
        except s3_failures() as exc:
            if error_code(exc) in NOT_FOUND:
                raise missing(exc) from exc
            raise s3_error("opening", self.where, exc) from exc
        self.size = int(head["ContentLength"])
        self.etag = head.get("ETag")

    def identity(self) -> Optional[tuple]:
        return (self.etag,) if self.etag else None

    def readinto(self, buf: memoryview, offset: int) -> int:
        return self.readv([buf], offset)

    def readv(self, views: list, offset: int) -> int:
        """Fill ``views`` from ``offset``: a large read in pieces (DISTCKPT_S3_READ_PIECE_BYTES) fetched in
        parallel, each piece the views' bytes it covers."""
        views = [memoryview(v).cast("B") for v in views]
        want = min(sum(len(v) for v in views), max(0, self.size - offset))
        piece = knobs.s3_read_piece_bytes()
        if want < 2 * piece:
            return self._get(views, offset)
        futures = [_pool().submit(self._get, part, offset + start) for start, part in _pieces(views, want, piece)]
        for f in futures:  # every piece ends before any failure is raised: none writes into the views after
            f.exception()
        return sum(f.result() for f in futures)

    def _get(self, views: list, offset: int) -> int:
        """Fill ``views`` from ``offset`` with one ranged GET; a body cut short is asked for again from where it
        stopped, up to the request attempts (DISTCKPT_S3_MAX_ATTEMPTS), each conditional on the same ETag."""
        views = [memoryview(v).cast("B") for v in views]
        want = min(sum(len(v) for v in views), max(0, self.size - offset))
        if want == 0:
            return 0
        extra = {"IfMatch": self.etag} if self.etag else {}
        total = 0
        attempts = knobs.s3_max_attempts()
        for attempt in range(attempts):
            try:
                reply = self.store.client.get_object(Bucket=self.store.bucket, Key=self.key,
                                                     Range=f"bytes={offset + total}-{offset + want - 1}", **extra)
                body = reply["Body"]
                progress = [0]
                try:
                    ended = _fill(body, views, total, want, progress)
                except stream_errors():
                    if attempt + 1 == attempts:
                        raise
                    time.sleep(min(2.0, 0.1 * 2 ** attempt))
                    continue
                finally:
                    total += progress[0]
                    body.close()
                if ended or total >= want:
                    return total
            except s3_failures() as exc:
                if error_code(exc) in LOST_RACE:
                    raise CorruptCheckpointError(f"{self.where} changed while it was being read (its ETag no longer "
                                                 "matches); another save replaced this checkpoint. Load again.") from exc
                if error_code(exc) in NOT_FOUND:
                    raise self.missing(exc) from exc
                raise s3_error("reading", self.where, exc) from exc
            except stream_errors() as exc:
                raise s3_error("reading", self.where, exc) from exc
        return total


def _pieces(views: list, want: int, piece: int) -> list[tuple[int, list]]:
    """The first ``want`` bytes of ``views`` (seen as one buffer) cut into pieces of ``piece`` bytes: (where each
    starts, the slices of the views it covers)."""
    out: list[tuple[int, list]] = []
    at, current, held, start = 0, [], 0, 0
    for v in views:
        v = v[: max(0, want - at)]
        while len(v):
            take = min(len(v), piece - held)
            current.append(v[:take])
            v, at, held = v[take:], at + take, held + take
            if held == piece:
                out.append((start, current))
                current, held, start = [], 0, at
    if current:
        out.append((start, current))
    return out


BODY_PIECE_BYTES = 1 << 20
"""Most bytes asked of a response body at once. urllib3's ``readinto`` reads into a temporary ``bytes`` of the
size asked and copies it over (http.client and urllib3's buffer add a copy or two of their own), so asking for a
whole 32 MiB slab made each request hold 2-3 transient copies of it, beyond the memory budget
(bench/load_memory.py); in pieces of 1 MiB, a request holds a few MiB."""


def _fill(body: Any, views: list, start: int, want: int, progress: list[int]) -> bool:
    """Copy ``body`` into ``views`` seen as one buffer, from byte ``start`` up to ``want``, counting the bytes
    copied in ``progress[0]`` as they arrive (so a stream error leaves the count of what did); whether the
    body ended early. The body is read :data:`BODY_PIECE_BYTES` at a time."""
    skip = start
    for v in views:
        if skip >= len(v):
            skip -= len(v)
            continue
        v = v[skip: skip + max(0, want - start - progress[0])]
        skip = 0
        filled = 0
        while filled < len(v):
            n = body.readinto(v[filled: filled + BODY_PIECE_BYTES])
            if not n:
                return True
            filled += n
            progress[0] += n
        if start + progress[0] >= want:
            break
    return False
