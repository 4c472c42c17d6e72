"""Azure Blob Storage: checkpoints at ``az://container/prefix`` (also spelled ``abfs://`` and ``abfss://``, as adlfs
and fsspec do), through the official SDK (azure-storage-blob).

The layout, the commit and the lifecycle of a run are :mod:`.objects`'s, over the primitives here. Without
``overwrite`` the commit is a Put Blob with ``If-None-Match: *`` (created only where no blob is, decided by the
service): of two saves racing to one prefix exactly one wins. Reads are ranged downloads conditional on the ETag
seen when the blob was opened, so a blob replaced during a load is an error, not a mix of two saves. A blob larger
than one part goes up as blocks staged in parallel and committed by one Put Block List; blocks of a save killed
before its commit are its uploads in progress (``uploads``), which cleanup removes.

The account comes from the environment as adlfs reads it: ``AZURE_STORAGE_CONNECTION_STRING``, or
``AZURE_STORAGE_ACCOUNT_NAME`` (or ``abfs://container@account.dfs.core.windows.net/prefix``) with
``AZURE_STORAGE_ACCOUNT_KEY``, ``AZURE_STORAGE_SAS_TOKEN`` or, with neither, azure-identity's
DefaultAzureCredential. Needs ``azure-storage-blob`` (``pip install distckpt[azure]``).
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
from .objects import ObjectClient, ObjectInfo, ObjectStore, Upload
from .s3_objects import _pool
from .schemes import register_store

__all__ = ["AzureStore", "AzureObjects", "AzureWriter", "AzureReader", "azure_store", "parse_az_url"]

SCHEMES = ("az", "abfs", "abfss")
SAVE_ID_TAG = "distckpt_save_id"  # blob metadata of a blob put with a tag (metadata names are C# identifiers)
FEATURE, EXTRA, PACKAGE = "az:// checkpoints", "azure", "azure-storage-blob"
MIN_PART_BYTES = 1 << 20
FIX = ("check the account (AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_ACCOUNT_NAME), the network and the "
       "credentials")
_ENV = ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY",
        "AZURE_STORAGE_SAS_TOKEN", "AZURE_CLIENT_ID", "AZURE_TENANT_ID", "AZURE_CLIENT_SECRET", "HTTPS_PROXY",
        "https_proxy", "HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy")

_CLIENTS: dict[tuple, Any] = {}
_CLIENTS_LOCK = threading.Lock()


def _fresh_lock_in_child() -> None:
    global _CLIENTS_LOCK
    _CLIENTS_LOCK = threading.Lock()  # a parent's thread may have held it at the fork


process_state.on_fork_child(_fresh_lock_in_child)


def parse_az_url(checkpoint_id: Union[str, os.PathLike]) -> tuple[str, Optional[str], str, str]:
    """``az://container/some/prefix`` -> ``("container", None, "some/prefix", "az")``; the account where the id
    names one (``abfs://container@account.dfs.core.windows.net/prefix``). Raises CheckpointError on anything else."""
    text = os.fspath(checkpoint_id)
    scheme, sep, rest = text.partition("://") if isinstance(text, str) else ("", "", "")
    if not sep or scheme not in SCHEMES:
        raise CheckpointError(f"{text!r} is not an az:// (or abfs://) checkpoint id")
    container, _, prefix = rest.partition("/")
    container, _, host = container.partition("@")
    account = host or None  # the host as the id gives it: the account and its cloud (chinacloudapi.cn, usgovcloudapi.net)
    prefix = prefix.strip("/")
    if not container or not prefix:
        raise CheckpointError(f"checkpoint id {text!r} needs a container and a prefix inside it, as in "
                              f"{scheme}://my-container/run-1/step-100; distckpt does not write at the top of a container")
    return container, account, prefix, scheme


def _sdk(module: str = "azure.storage.blob") -> Any:
    return import_or_explain(module, FEATURE, EXTRA, package=PACKAGE)


def _service(account: Optional[str]) -> Any:
    """A new BlobServiceClient for ``account`` (None: the environment's), with no retries of its own (``Requests``
    bounds them) and the knobs' timeouts."""
    blob = _sdk()
    connect, read = timeouts()
    options = {"retry_total": 0, "connection_timeout": connect, "read_timeout": read}
    connection_string = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
    if connection_string and account is None:
        return blob.BlobServiceClient.from_connection_string(connection_string, **options)
    account = account or os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")
    if not account:
        raise StorageIOError("az:// needs an account: set AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_ACCOUNT_NAME, "
                             "or name it in the id (abfs://container@account.dfs.core.windows.net/prefix)")
    credential = os.environ.get("AZURE_STORAGE_ACCOUNT_KEY") or os.environ.get("AZURE_STORAGE_SAS_TOKEN")
    if credential is None:
        identity = import_or_explain("azure.identity", FEATURE, EXTRA, package="azure-identity")
        credential = identity.DefaultAzureCredential()
    return blob.BlobServiceClient(_blob_endpoint(account), credential=credential, **options)


def _blob_endpoint(account: str) -> str:
    """The blob endpoint of ``account``: a name alone is in Azure's public cloud; a host (``acct.dfs.core.chinacloudapi.cn``,
    as an abfs:// id names it) keeps its cloud, with the blob service in place of the one named."""
    name, dot, rest = account.partition(".")
    if not dot:
        return f"https://{name}.blob.core.windows.net"
    _, _, suffix = rest.partition(".")  # the service (dfs, blob) goes, the cloud's domain stays
    return f"https://{name}.blob.{suffix}"


def _bounds() -> dict[str, Any]:
    """Each request's own bounds, also on a service client a user gave (whose settings are its own): the knobs'
    timeouts, and no retries of the SDK's (``Requests`` makes them, within the knobs' attempts)."""
    connect, read = timeouts()
    return {"retry_total": 0, "connection_timeout": connect, "read_timeout": read}


def azure_service(account: Optional[str] = None) -> Any:
    """This process's client for ``account`` and the environment (clients are kept per process: not fork-safe)."""
    environment = hashlib.sha256(repr([os.environ.get(k) for k in _ENV] + list(timeouts())).encode()).hexdigest()
    key = (os.getpid(), account, environment)
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            client = _CLIENTS[key] = _service(account)
        return client


# ---- failures: which are worth another attempt, which mean no answer, and the typed error of each

def _failures() -> tuple:
    core = _sdk("azure.core.exceptions")
    return (core.AzureError, http.client.HTTPException, OSError)


def _status(exc: Optional[BaseException]) -> Optional[int]:
    status = getattr(exc, "status_code", None)
    return status if isinstance(status, int) else None


def _no_answer(exc: BaseException) -> bool:
    core = _sdk("azure.core.exceptions")
    return isinstance(exc, (core.ServiceRequestError, core.ServiceResponseTimeoutError, core.ServiceRequestTimeoutError,
                            ConnectionError, TimeoutError))


def _transient(exc: BaseException) -> bool:
    core = _sdk("azure.core.exceptions")
    status = _status(exc)
    return (status is not None and (status in (408, 429) or status >= 500)) or _no_answer(exc) or isinstance(
        exc, (core.ServiceResponseError, core.IncompleteReadError, http.client.HTTPException))


def azure_error(action: str, where: str, exc: BaseException) -> CheckpointError:
    """A typed error for a failed request, naming the blob and, where one is known, the fix."""
    status, code = _status(exc), getattr(exc, "error_code", None)
    if status == 404 and code == "ContainerNotFound":
        return StorageIOError(f"{action} {where} failed: the container does not exist; create it first "
                              "(az storage container create), or fix the checkpoint id")
    if status == 404:
        return CheckpointNotFoundError(f"{where} does not exist; the checkpoint is incomplete or damaged")
    if status in (401, 403) or type(exc).__name__ in ("ClientAuthenticationError", "CredentialUnavailableError"):
        return StorageIOError(f"{action} {where} failed: access denied ({code or type(exc).__name__}); check the "
                              "credentials (AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_TOKEN, az login) and the "
                              "container's role assignments")
    if _no_answer(exc):
        return StorageIOError(f"{action} {where} failed: the endpoint did not answer ({type(exc).__name__}: {exc}); {FIX}")
    first = str(exc).splitlines()[0] if str(exc) else ""
    return StorageIOError(f"{action} {where} failed: {status or type(exc).__name__} {code or ''}: {first}; {FIX}")


def _age(when: Any) -> Optional[float]:
    return None if when is None else max(0.0, time.time() - when.timestamp())


class AzureObjects(ObjectClient):
    """One container through azure-storage-blob: the primitives of :class:`~distckpt.backends.objects.ObjectStore`."""

    def __init__(self, container: str, *, account: Optional[str] = None, scheme: str = "az", service: Any = None,
                 part_size: Optional[int] = None, upload_concurrency: Optional[int] = None):
        self.container_name, self.account, self.scheme = container, account, scheme
        self.given_service = service
        self.part_size, self.upload_concurrency = part_size, upload_concurrency
        self.requests = Requests("Azure", FIX, _transient, _no_answer, azure_error, _failures)

    @property
    def container(self) -> Any:
        return (self.given_service or azure_service(self.account)).get_container_client(self.container_name)

    def _blob(self, key: str) -> Any:
        return self.container.get_blob_client(key)

    def url(self, key: str) -> str:
        where = self.container_name if self.account is None else f"{self.container_name}@{self.account}"
        return f"{self.scheme}://{where}/{key}"

    def _run(self, action: str, key: str, call: Callable[[], Any]) -> Any:
        return self.requests.run(action, self.url(key), call)

    def check(self) -> None:
        try:
            found = self._run("checking the container of", "", lambda: self.container.exists(**_bounds()))
        except StorageIOError as exc:
            if _status(exc.__cause__) == 403:
                return  # a credential for blobs alone may not see the container; its first request will tell
            raise
        if not found:
            raise StorageIOError(f"container {self.container_name!r} of {self.url('')} does not exist; create it first "
                                 "(az storage container create), or fix the checkpoint id")

    def put(self, key: str, data: bytes, *, if_absent: bool = False, tag: Optional[str] = None) -> bool:
        metadata = None if tag is None else {SAVE_ID_TAG: tag}
        try:  # overwrite=False is Put Blob with If-None-Match: *
            self._run("writing", key, lambda: self._blob(key).upload_blob(bytes(data), overwrite=not if_absent,
                                                                          metadata=metadata, **_bounds()))
        except StorageIOError as exc:
            if if_absent and _status(exc.__cause__) in (409, 412):
                return False  # a blob is there (or our own Put Blob landed and its answer was lost)
            raise
        return True

    def get(self, key: str, limit: Optional[int] = None) -> Optional[bytes]:
        try:
            return self._run("reading", key, lambda: self._blob(key).download_blob(offset=0 if limit else None,
                                                                                  length=limit or None,
                                                                                  **_bounds()).readall())
        except CheckpointNotFoundError:
            return None
        except StorageIOError as exc:
            if _status(exc.__cause__) == 416:
                return b""  # a range of an empty blob
            raise

    def head(self, key: str) -> Optional[ObjectInfo]:
        try:
            props = self._run("looking up", key, lambda: self._blob(key).get_blob_properties(**_bounds()))
        except CheckpointNotFoundError:
            return None
        return ObjectInfo(key, int(props.size or 0), _age(props.last_modified), (props.metadata or {}).get(SAVE_ID_TAG))

    def list(self, prefix: str, delimiter: bool = False) -> Iterable[ObjectInfo]:
        def listing() -> list[ObjectInfo]:
            container = self.container
            if not delimiter:
                return [ObjectInfo(b.name, int(b.size or 0), _age(b.last_modified)) for b in
                        container.list_blobs(name_starts_with=prefix, **_bounds())]
            return [ObjectInfo(b.name) if not hasattr(b, "size") else ObjectInfo(b.name, int(b.size or 0), _age(b.last_modified))
                    for b in container.walk_blobs(name_starts_with=prefix, delimiter="/", **_bounds())]

        return sorted(self._run("listing", prefix, listing), key=lambda o: o.key)

    def delete(self, keys: list[str]) -> None:
        def one(key: str) -> None:
            try:
                self._run("deleting", key, lambda: self._blob(key).delete_blob(**_bounds()))
            except CheckpointNotFoundError:
                pass  # gone already

        for future in [_pool().submit(one, key) for key in keys]:
            future.result()

    def touch(self, key: str) -> None:
        """Set the blob's metadata to what it is: Last-Modified becomes now, and a blob that is gone answers 404
        (a read and a put would bring it back)."""
        blob = self._blob(key)

        def renew() -> None:
            props = blob.get_blob_properties(**_bounds())
            blob.set_blob_metadata(props.metadata or {}, etag=props.etag,
                                   match_condition=_sdk("azure.core").MatchConditions.IfNotModified, **_bounds())

        self._run("renewing", key, renew)

    def _parts(self, buffer_bytes: Optional[int]) -> tuple[int, int]:
        """Block size, and blocks staging at once: within ``buffer_bytes`` with the block that fills."""
        part = max(MIN_PART_BYTES, knobs.s3_part_bytes() if self.part_size is None else self.part_size)
        concurrency = knobs.s3_upload_concurrency() if self.upload_concurrency is None else self.upload_concurrency
        if buffer_bytes is not None:
            part = max(MIN_PART_BYTES, min(part, buffer_bytes // 2))
            concurrency = max(1, min(concurrency, buffer_bytes // part - 1))
        return part, concurrency

    def writer(self, key: str, buffer_bytes: Optional[int] = None) -> BlobWriter:
        return AzureBlobWriter(self, key, *self._parts(buffer_bytes))

    def write_buffer_bytes(self, buffer_bytes: Optional[int] = None) -> int:
        part, concurrency = self._parts(buffer_bytes)
        return (concurrency + 1) * part

    def reader(self, key: str, missing: Callable[[Optional[BaseException]], CheckpointError]) -> BlobReader:
        return AzureBlobReader(self, key, missing)

    def uploads(self, prefix: str) -> list[Upload]:
        """Blobs under ``prefix`` with staged blocks and no committed content: what a writer killed before its Put
        Block List left (Azure discards such blocks after a week; they are billed until then)."""
        def listing() -> list[Upload]:
            container = self.container
            committed = {b.name for b in container.list_blobs(name_starts_with=prefix, **_bounds())}
            return [Upload(b.name, b.name, _age(b.last_modified))
                    for b in container.list_blobs(name_starts_with=prefix, include=["uncommittedblobs"], **_bounds())
                    if b.name not in committed]

        return self._run("listing the uploads under", prefix, listing)

    def abort(self, upload: Upload) -> None:
        """Drop the staged blocks of ``upload``: delete the blob; where the service knows no blob of only staged
        blocks, commit an empty block list first (which discards them), then delete."""
        blob = self._blob(upload.key)
        try:
            self._run("aborting the upload of", upload.key, lambda: blob.delete_blob(**_bounds()))
        except CheckpointNotFoundError:
            try:
                self._run("aborting the upload of", upload.key, lambda: blob.commit_block_list(
                    [], match_condition=_sdk("azure.core").MatchConditions.IfMissing, **_bounds()))
            except StorageIOError as exc:
                if _status(exc.__cause__) not in (409, 412):
                    raise
                return  # a committed blob is there now: not an upload any more
            self.delete([upload.key])


class AzureBlobWriter(InOrderWriter):
    """One blob: whole in one Put Blob when it is smaller than a part, else blocks staged in parallel (at most
    ``concurrency`` at once, each a part) and committed in order by one Put Block List."""

    def __init__(self, objects: AzureObjects, key: str, part_size: int, concurrency: int):
        super().__init__(objects.url(key), part_size)
        self.objects, self.key, self.concurrency = objects, key, concurrency
        self.upload = uuid.uuid4().hex[:16]  # block ids of one blob must all have one length
        self.blocks: list[tuple[str, Future]] = []

    def _whole(self, data: bytes) -> None:
        self.objects.put(self.key, data)

    def _send(self, part: bytearray) -> None:
        in_flight = [f for _, f in self.blocks if not f.done()]
        if len(in_flight) >= self.concurrency:
            in_flight[0].result()
        for _, f in self.blocks:
            if f.done():
                f.result()  # a block that failed stops the blob here
        block = f"{self.upload}-{len(self.blocks):08d}"
        blob = self.objects._blob(self.key)
        self.blocks.append((block, _pool().submit(self.objects._run, "uploading", self.key,
                                                  lambda: blob.stage_block(block, part, length=len(part), **_bounds()))))

    def _finish(self) -> None:
        for _, f in self.blocks:
            f.result()
        ids = [block for block, _ in self.blocks]
        self.objects._run("uploading", self.key, lambda: self.objects._blob(self.key).commit_block_list(ids, **_bounds()))

    def _give_up(self) -> None:
        for _, f in self.blocks:
            f.cancel()
        wait([f for _, f in self.blocks])
        if self.blocks and self.objects.requests.gone is None:
            try:
                self.objects.abort(Upload(self.key, self.key))
            except CheckpointError:
                pass  # the save is discarded, and cleanup finds the blocks left (uploads) by the lease rules
        self.blocks = []


class AzureBlobReader(PiecewiseReader):
    """Ranged downloads conditional on the ETag the blob had when it was opened."""

    def __init__(self, objects: AzureObjects, key: str, missing: Callable[[Optional[BaseException]], CheckpointError]):
        self.objects, self.key, self.missing = objects, key, missing
        self.where = objects.url(key)
        try:
            props = objects._run("opening", key, lambda: objects._blob(key).get_blob_properties(**_bounds()))
        except CheckpointNotFoundError as exc:
            raise missing(exc) from exc
        self.size, self.etag = int(props.size or 0), props.etag

    def identity(self) -> Optional[tuple]:
        return ("azure", self.etag) if self.etag else None

    def _read_range(self, views: list, offset: int) -> None:
        sink = ViewSink(views)
        blob = self.objects._blob(self.key)
        unchanged = _sdk("azure.core").MatchConditions.IfNotModified

        def download() -> None:
            sink.seek(0)  # an attempt after a body cut short starts the piece again
            blob.download_blob(offset=offset, length=sink.size, etag=self.etag, match_condition=unchanged,
                               max_concurrency=1, validate_content=False, **_bounds()).readinto(sink)

        try:
            self.objects._run("reading", self.key, download)
        except CheckpointNotFoundError as exc:
            raise self.missing(exc) from exc
        except StorageIOError as exc:
            if _status(exc.__cause__) == 412:
                raise CorruptCheckpointError(f"{self.where} changed while it was being read (its ETag no longer "
                                             "matches); another save replaced this checkpoint. Load again.") from exc
            raise
        if sink.filled != sink.size:
            raise StorageIOError(f"reading {self.where} failed: {sink.filled} of {sink.size} bytes at offset {offset} "
                                 f"arrived; {FIX}")


class AzureStore(ObjectStore):
    """One checkpoint prefix (or one save's data prefix) in a container."""

    def __init__(self, container: str, prefix: str, *, account: Optional[str] = None, scheme: str = "az",
                 service: Any = None, part_size: Optional[int] = None, upload_concurrency: Optional[int] = None):
        super().__init__(AzureObjects(container, account=account, scheme=scheme, service=service, part_size=part_size,
                                      upload_concurrency=upload_concurrency), prefix)


def azure_store(checkpoint_id: str) -> AzureStore:
    """The store of ``az://container/prefix`` (or ``abfs://``), configured from the environment (the factory of
    schemes ``az``, ``abfs`` and ``abfss``)."""
    container, account, prefix, scheme = parse_az_url(checkpoint_id)
    return AzureStore(container, prefix, account=account, scheme=scheme)


class _AtAzUrl:
    """What the Azure writer and reader share: the store of their checkpoint id, with their service and part options."""

    service: Any = None
    part_size: Optional[int] = None
    upload_concurrency: Optional[int] = None

    def canonical(self, checkpoint_id: Union[str, os.PathLike]) -> str:
        parse_az_url(checkpoint_id)
        return os.fspath(checkpoint_id)

    def open_store(self, checkpoint_id: str) -> AzureStore:
        container, account, prefix, scheme = parse_az_url(checkpoint_id)
        return AzureStore(container, prefix, account=account, scheme=scheme, service=self.service,
                          part_size=self.part_size, upload_concurrency=self.upload_concurrency)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        try:
            return os.fspath(checkpoint_id).partition("://")[0] in SCHEMES
        except TypeError:
            return False


class AzureWriter(_AtAzUrl, BlobStorageWriter):
    """Writes a checkpoint at ``az://container/prefix`` (or ``abfs://``); ``service``: a ready
    ``azure.storage.blob.BlobServiceClient`` (default: one from the environment, see the module text); ``part_size``,
    ``upload_concurrency``: as :class:`~distckpt.S3Writer`'s. A CheckpointManager on ``az://`` passes its
    ``**storage_options`` here."""

    def __init__(self, url: Union[str, os.PathLike, None] = None, *, service: Any = None,
                 thread_count: Optional[int] = None, part_size: Optional[int] = None,
                 upload_concurrency: Optional[int] = None, overwrite: Optional[bool] = None,
                 compression: Optional[str] = None, compression_level: Optional[int] = None):
        super().__init__(url, sync_files=True, thread_count=thread_count, overwrite=overwrite, compression=compression,
                         compression_level=compression_level)
        self.service, self.part_size, self.upload_concurrency = service, part_size, upload_concurrency


class AzureReader(_AtAzUrl, BlobStorageReader):
    """Reads a checkpoint at ``az://container/prefix`` (``service`` as :class:`AzureWriter`'s)."""

    def __init__(self, url: Union[str, os.PathLike, None] = None, *, service: Any = None, verify_checksums: bool = True,
                 thread_count: Optional[int] = None, shared_reads: Optional[bool] = None):
        super().__init__(url, verify_checksums=verify_checksums, thread_count=thread_count, shared_reads=shared_reads)
        self.service = service


for _scheme in SCHEMES:
    register_store(_scheme, azure_store, writer=AzureWriter, reader=AzureReader)
