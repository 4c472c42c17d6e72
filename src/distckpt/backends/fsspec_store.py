"""Any fsspec URL as a store, for the schemes distckpt has no store of its own for (``hdfs://``, ``sftp://``,
``oci://``, a company's own filesystem): the object lifecycle of :mod:`.objects` over fsspec's filesystem calls.

What fsspec cannot give, distckpt does not pretend to: fsspec has no conditional create, so the commit of a
checkpoint (``metadata.json`` created only where none is) is a check followed by a write. Two saves racing to one
path can both commit there, the later one winning, and a save can replace a checkpoint another process committed
between the check and the write. Everything else holds: the metadata is written last, after every data object is
closed, so a reader never sees a half-written checkpoint, and the data of each save lives under a prefix of its
own. Where the filesystem has a native store here (``s3://``, ``gs://``, ``az://``, ``memory://``, a local path),
that store is used instead, with its atomic commit. A warning says so the first time a process uses this store.

Storage options (credentials, endpoints) are fsspec's: ``FsspecWriter(path, **storage_options)``, as DCP's, or
the ``DISTCKPT_FSSPEC_OPTIONS`` knob's JSON for saves and loads by ``checkpoint_id`` alone.
"""

from __future__ import annotations

import datetime
import threading
import time
import uuid
import warnings
from typing import Any, Callable, Iterable, Optional, Union

from .. import faults, knobs
from ..engine.blobs import BlobReader, BlobStore, BlobWriter
from ..errors import CheckpointError, CheckpointNotFoundError, StorageIOError
from .blob_storage import BlobStorageReader, BlobStorageWriter
from .objects import ObjectClient, ObjectInfo, ObjectStore
from .schemes import SchemeEntry, register_fallback

__all__ = ["FsspecObjects", "FsspecStore", "FsspecWriter", "FsspecReader"]

_WARNED: set = set()
_WARN_LOCK = threading.Lock()


def _io_error(action: str, where: str, exc: BaseException) -> StorageIOError:
    return StorageIOError(f"{where}: {action} failed through fsspec ({type(exc).__name__}: {exc}); check the URL, the "
                          "storage options (credentials, endpoint) and that the filesystem is reachable")


def _age_s(info: dict) -> Optional[float]:
    """Seconds since the object was written, from whichever time its filesystem reports; None where none."""
    for field in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(field)
        if value is None:
            continue
        if isinstance(value, datetime.datetime):
            value = value.timestamp()
        try:
            return max(0.0, time.time() - float(value))
        except (TypeError, ValueError):
            continue
    return None


class _SequentialWriter(BlobWriter):
    """Streams an object through an fsspec file opened for writing. Positional writes arrive in order from the
    write engine; one that arrives ahead of the end waits in memory until the bytes before it are written."""

    def __init__(self, fs: Any, path: str, where: str):
        self.where = where
        self.lock = threading.Lock()
        self.end = 0
        self.ahead: dict[int, bytes] = {}
        try:
            fs.makedirs(fs._parent(path), exist_ok=True)  # a filesystem with directories (ftp, sftp) needs them
            self.file = fs.open(path, "wb")
        except Exception as exc:  # noqa: BLE001 - any filesystem's failure, typed
            raise _io_error("opening for writing", where, exc) from exc

    def pwrite(self, data: memoryview, offset: int) -> None:
        faults.point("write", self.where)
        data = memoryview(data).cast("B")
        with self.lock:
            if offset < self.end:
                raise StorageIOError(f"{self.where}: a write at {offset} behind the end already written ({self.end}); "
                                     "an fsspec store writes each object once, in order")
            self.ahead[offset] = bytes(data)
            try:
                while self.end in self.ahead:
                    piece = self.ahead.pop(self.end)
                    self.file.write(piece)
                    self.end += len(piece)
            except Exception as exc:  # noqa: BLE001
                raise _io_error("writing", self.where, exc) from exc

    def close(self, sync: bool) -> None:
        with self.lock:
            if self.ahead:
                raise StorageIOError(f"{self.where}: closed with a gap before offset {min(self.ahead)} (written up to "
                                     f"{self.end})")
            try:
                self.file.close()
            except Exception as exc:  # noqa: BLE001
                raise _io_error("closing", self.where, exc) from exc

    def abort(self) -> None:
        with self.lock:
            self.ahead.clear()
            try:  # an upload not yet made is cancelled where fsspec can; else what was written is a dead save's,
                from fsspec.spec import AbstractBufferedFile  # which the save's cleanup removes

                if isinstance(self.file, AbstractBufferedFile):
                    self.file.discard()
                else:
                    self.file.close()
            except Exception:  # noqa: BLE001 - the save failed already; this is tidying
                pass


class _Reader(BlobReader):
    """Ranged reads of one object (fsspec's ``cat_file`` with start and end)."""

    def __init__(self, fs: Any, key: str, info: dict, where: str):
        self.fs, self.key, self.where = fs, key, where
        self.size = int(info.get("size") or 0)
        self._identity = tuple(str(info.get(f)) for f in ("ETag", "etag", "generation", "mtime", "created", "size")
                               if info.get(f) is not None)

    def identity(self) -> Optional[tuple]:
        return ("fsspec",) + self._identity if self._identity else None

    def readinto(self, buf: memoryview, offset: int) -> int:
        view = memoryview(buf).cast("B")
        end = min(self.size, offset + len(view))
        if end <= offset:
            return 0
        try:
            data = self.fs.cat_file(self.key, start=offset, end=end)
        except Exception as exc:  # noqa: BLE001
            raise _io_error("reading", self.where, exc) from exc
        if len(data) != end - offset:
            raise StorageIOError(f"{self.where}: a read of bytes {offset}-{end} returned {len(data)} bytes (a server "
                                 "that ignores ranges, or an object that changed while it was read); read it through a "
                                 "store that serves ranges")
        view[: len(data)] = data
        return len(data)


class FsspecObjects(ObjectClient):
    """The primitives of an object store over an fsspec filesystem. Keys are the filesystem's paths without the
    ``root`` they begin with (``/`` where its paths are absolute, as ftp's and sftp's), which
    :class:`~distckpt.backends.objects.ObjectStore` strips from its prefix."""

    def __init__(self, fs: Any, protocol: str, root: str = ""):
        self.fs, self.protocol, self.root = fs, protocol, root
        self._made: set = set()

    def _path(self, key: str, fresh: bool = False) -> str:
        """The filesystem's path of ``key``; ``fresh``: its listings cached by fsspec dropped first (ftp's, sftp's,
        http's), so that what another process wrote or deleted is seen."""
        path = self.root + key
        if fresh:
            self.fs.invalidate_cache(path)
            self.fs.invalidate_cache(self.fs._parent(path))
        return path

    def url(self, key: str) -> str:
        try:
            return self.fs.unstrip_protocol(self._path(key))  # with the host, where the URL named one
        except Exception:  # noqa: BLE001 - a filesystem that cannot say: the protocol and path
            return f"{self.protocol}://{self._path(key)}"

    def _parent_made(self, path: str) -> None:
        parent = self.fs._parent(path)
        if parent and parent not in self._made:
            self.fs.makedirs(parent, exist_ok=True)
            self._made.add(parent)

    def put(self, key: str, data: bytes, *, if_absent: bool = False, tag: Optional[str] = None) -> bool:
        # no conditional create in fsspec: a check, then the write (the module docstring says what that leaves). The
        # bytes go to a temporary name first and are moved into place, so that a document replaced (an overwrite's
        # commit) is never seen half-written where the filesystem renames in one step
        path = self._path(key, fresh=True)
        temporary = f"{path}.distckpt-tmp-{uuid.uuid4().hex[:12]}"
        try:
            if if_absent and self.fs.exists(path):
                return False
            self._parent_made(path)
            self.fs.pipe_file(temporary, bytes(data))
            try:
                self.fs.mv(temporary, path)
            except OSError:  # a rename that does not replace (sftp's): the old one goes first
                if not self.fs.exists(path):
                    raise
                self.fs.rm_file(path)
                self.fs.mv(temporary, path)
            return True
        except Exception as exc:  # noqa: BLE001
            try:
                self.fs.rm_file(temporary)
            except Exception:  # noqa: BLE001 - not made, or gone: the failure above is the one to report
                pass
            raise _io_error("writing", self.url(key), exc) from exc

    def get(self, key: str, limit: Optional[int] = None) -> Optional[bytes]:
        path = self._path(key, fresh=True)
        try:
            return self.fs.cat_file(path, start=0, end=limit) if limit is not None else self.fs.cat_file(path)
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001
            raise _io_error("reading", self.url(key), exc) from exc

    def _info(self, key: str) -> Optional[dict]:
        try:
            info = self.fs.info(self._path(key, fresh=True))
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001
            raise _io_error("looking up", self.url(key), exc) from exc
        return info if info.get("type", "file") == "file" else None

    def head(self, key: str) -> Optional[ObjectInfo]:
        info = self._info(key)
        return None if info is None else ObjectInfo(key, int(info.get("size") or 0), _age_s(info))

    def list(self, prefix: str, delimiter: bool = False) -> Iterable[ObjectInfo]:
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else prefix
        try:
            found = self.fs.find(self._path(base, fresh=True), detail=True) if base else {}
        except FileNotFoundError:
            found = {}
        except Exception as exc:  # noqa: BLE001
            raise _io_error("listing", self.url(prefix), exc) from exc
        out: dict[str, ObjectInfo] = {}
        for path, info in found.items():
            key = self.fs._strip_protocol(path)
            key = key[len(self.root):] if self.root and key.startswith(self.root) else key
            if not key.startswith(prefix) or info.get("type", "file") != "file":
                continue
            rest = key[len(prefix):]
            if delimiter and "/" in rest:
                folder = prefix + rest.split("/", 1)[0] + "/"
                out[folder] = ObjectInfo(folder)
            else:
                out[key] = ObjectInfo(key, int(info.get("size") or 0), _age_s(info))
        return [out[k] for k in sorted(out)]

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            path = self._path(key)
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass
            except Exception as exc:  # noqa: BLE001 - gone already is no error, whatever the filesystem calls it (ftp: 550)
                try:
                    gone = not self.fs.exists(self._path(key, fresh=True))
                except Exception:  # noqa: BLE001
                    gone = False
                if not gone:
                    raise _io_error("deleting", self.url(key), exc) from exc

    def touch(self, key: str) -> None:
        data = self.get(key)
        if data is None:
            raise CheckpointNotFoundError(f"{self.url(key)} does not exist")
        try:
            self.fs.touch(self._path(key), truncate=False)
        except (NotImplementedError, ValueError):  # a filesystem that cannot touch without truncating: write it again
            self.put(key, data)
        except Exception as exc:  # noqa: BLE001
            raise _io_error("renewing", self.url(key), exc) from exc

    def writer(self, key: str, buffer_bytes: Optional[int] = None) -> BlobWriter:
        return _SequentialWriter(self.fs, self._path(key), self.url(key))

    def reader(self, key: str, missing: Callable[[Optional[BaseException]], CheckpointError]) -> BlobReader:
        info = self._info(key)
        if info is None:
            raise missing(None)
        return _Reader(self.fs, self._path(key), info, self.url(key))


def _filesystem(url: str, protocol: str, options: dict[str, Any]) -> tuple[Any, str]:
    """The filesystem of ``url`` and the path in it: the host a URL names (``ftp://host/...``, ``hdfs://namenode/...``)
    is the filesystem's, as fsspec's own ``url_to_fs`` reads it."""
    import fsspec  # a dependency of torch: always there, imported only where an fsspec URL is used
    from fsspec.implementations.local import LocalFileSystem

    try:
        if issubclass(fsspec.get_filesystem_class(protocol), LocalFileSystem):
            # the disk store checks links, file kinds and ownership, and commits by rename; fsspec's would not
            raise CheckpointError(f"{protocol}:// is the local disk through fsspec; pass the path itself (or file://), "
                                  "which the disk store saves to and loads from")
        return fsspec.core.url_to_fs(url, **options)
    except CheckpointError:
        raise
    except ImportError as exc:  # the protocol's own package (hdfs, sftp...) is missing: fsspec names it
        raise CheckpointError(f"{protocol}:// needs a package fsspec could not import: {exc}") from exc
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"{protocol}://: fsspec could not open the filesystem ({type(exc).__name__}: {exc}); "
                              "check the storage options") from exc


class FsspecStore(ObjectStore):
    """The checkpoint at an fsspec URL (see the module docstring for what its commit can and cannot promise)."""

    def __init__(self, checkpoint_id: str, **storage_options: Any):
        protocol, sep, _ = checkpoint_id.partition("://")
        if not sep:
            raise CheckpointError(f"{checkpoint_id!r} is no URL; an fsspec store takes protocol://path")
        fs, path = _filesystem(checkpoint_id, protocol, storage_options)
        path = path.rstrip("/")
        root = "/" if path.startswith("/") else ""
        if not path.strip("/"):
            raise CheckpointError(f"{checkpoint_id!r} names no path under {protocol}://; add one, as "
                                  f"{protocol}://bucket/run/step-100")
        _warn_once(protocol)
        super().__init__(FsspecObjects(fs, protocol, root), path[len(root):])


def _warn_once(protocol: str) -> None:
    with _WARN_LOCK:
        if protocol in _WARNED:
            return
        _WARNED.add(protocol)
    warnings.warn(f"distckpt saves to {protocol}:// through fsspec, which has no conditional create: two saves racing "
                  "to one checkpoint path can both commit (the later wins). Give each save its own path, or use a "
                  "store with an atomic commit (docs/stores.md).", RuntimeWarning, stacklevel=3)


def _store(checkpoint_id: str) -> FsspecStore:
    return FsspecStore(checkpoint_id, **knobs.fsspec_options())


class _Options:
    """Writer and reader at an fsspec URL, with fsspec's storage options (as DCP's FsspecWriter takes them)."""

    storage_options: dict[str, Any] = {}

    def open_store(self, checkpoint_id: str) -> BlobStore:
        return FsspecStore(checkpoint_id, **(self.storage_options or knobs.fsspec_options()))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, Any]) -> bool:
        return _fsspec_entry(str(checkpoint_id).partition("://")[0]) is not None


class FsspecWriter(_Options, BlobStorageWriter):
    """Writes a checkpoint at any fsspec URL (``FsspecWriter("hdfs://nn/run/step-100", **storage_options)``)."""

    def __init__(self, path: Union[str, None] = None, *, thread_count: Optional[int] = None,
                 overwrite: Optional[bool] = None, **storage_options: Any):
        super().__init__(path, sync_files=False, thread_count=thread_count, overwrite=overwrite)
        self.storage_options = storage_options


class FsspecReader(_Options, BlobStorageReader):
    """Reads a checkpoint at any fsspec URL (``FsspecReader(path, **storage_options)``)."""

    def __init__(self, path: Union[str, None] = None, *, verify_checksums: bool = True,
                 thread_count: Optional[int] = None, **storage_options: Any):
        super().__init__(path, verify_checksums=verify_checksums, thread_count=thread_count)
        self.storage_options = storage_options


def _fsspec_entry(scheme: str) -> Optional[SchemeEntry]:
    """The fallback store of ``scheme``, where fsspec knows it (its package may still be missing: opening says so)."""
    import fsspec

    if not scheme:
        return None
    try:
        fsspec.get_filesystem_class(scheme)
    except ValueError:  # a protocol fsspec does not know
        return None
    except ImportError:  # known, its package missing: opening the store names it
        pass
    return SchemeEntry(_store, FsspecWriter, FsspecReader)


register_fallback(_fsspec_entry)
