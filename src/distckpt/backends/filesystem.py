"""Local (or network-mounted POSIX) filesystem storage: the default backend."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Iterable, Union

from ..errors import CheckpointNotFoundError, StorageIOError
from .blob_storage import BlobStorageReader, BlobStorageWriter
from .blobs import BlobReader, BlobStore, BlobWriter

__all__ = ["FileSystemWriter", "FileSystemReader", "FsStore"]


def _io_error(action: str, path: str, exc: OSError) -> StorageIOError:
    hint = ""
    if exc.errno == errno.ENOSPC:
        hint = "; free disk space or save elsewhere"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        hint = "; check the directory's permissions"
    return StorageIOError(f"{action} {path} failed: {exc.strerror or exc}{hint}", exc.errno)


class _FdWriter(BlobWriter):
    def __init__(self, path: str):
        self.path = path
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:
            raise _io_error("creating", path, exc) from exc

    def pwrite(self, data: memoryview, offset: int) -> None:
        view = memoryview(data).cast("B")
        try:
            while len(view):
                n = os.pwrite(self.fd, view, offset)
                view = view[n:]
                offset += n
        except OSError as exc:
            raise _io_error("writing", self.path, exc) from exc

    def close(self, sync: bool) -> None:
        try:
            if sync:
                os.fsync(self.fd)
        except OSError as exc:
            raise _io_error("fsync of", self.path, exc) from exc
        finally:
            os.close(self.fd)


class _FdReader(BlobReader):
    def __init__(self, path: str):
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path} does not exist; the checkpoint is incomplete or damaged") from None
        except OSError as exc:
            raise _io_error("opening", path, exc) from exc
        self.size = os.fstat(self.fd).st_size

    def readinto(self, buf: memoryview, offset: int) -> int:
        view = memoryview(buf).cast("B")
        total = 0
        try:
            while total < len(view):
                n = os.preadv(self.fd, [view[total:]], offset + total)
                if n == 0:
                    break
                total += n
        except OSError as exc:
            raise _io_error("reading", self.path, exc) from exc
        return total

    def close(self) -> None:
        os.close(self.fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FsStore(BlobStore):
    """Blobs as files in one directory."""

    supports_atomic_rename = True

    def __init__(self, root: Union[str, os.PathLike]):
        self.root = os.fspath(root)

    def _p(self, name: str) -> str:
        return os.path.join(self.root, name)

    def prepare(self) -> None:
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise _io_error("creating directory", self.root, exc) from exc

    def create(self, name: str) -> BlobWriter:
        return _FdWriter(self._p(name))

    def open(self, name: str) -> BlobReader:
        path = self._p(name)
        if os.path.islink(path):
            raise CheckpointNotFoundError(f"{path} is a symbolic link; distckpt does not follow links inside a checkpoint")
        return _FdReader(path)

    def put_atomic(self, name: str, data: bytes, sync: bool) -> None:
        final = self._p(name)
        tmp = f"{final}.tmp-{os.getpid()}"
        w = _FdWriter(tmp)
        try:
            w.pwrite(memoryview(data), 0)
        finally:
            w.close(sync)
        try:
            os.replace(tmp, final)
            if sync:
                _fsync_dir(self.root)
        except OSError as exc:
            raise _io_error("committing", final, exc) from exc

    def exists(self, name: str) -> bool:
        return os.path.exists(self._p(name))

    def list(self) -> Iterable[str]:
        try:
            return sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []

    def describe(self, name: str = "") -> str:
        return self._p(name) if name else self.root


def _is_local_path(checkpoint_id: Union[str, os.PathLike]) -> bool:
    text = os.fspath(checkpoint_id)
    return isinstance(text, str) and ("://" not in text or text.startswith("file://"))


def _strip_file_scheme(checkpoint_id: Union[str, os.PathLike, None]):
    if checkpoint_id is None:
        return None
    text = os.fspath(checkpoint_id)
    return text[len("file://"):] if text.startswith("file://") else text


class FileSystemWriter(BlobStorageWriter):
    """Writes a checkpoint into a directory: one safetensors data file per rank, plus metadata.json.

    Args:
        path: the checkpoint directory (may also be given as ``checkpoint_id``).
        sync_files: fsync data files, metadata and the directory (default: the DISTCKPT_FSYNC knob).
        thread_count: writer threads per rank (default: the DISTCKPT_IO_THREADS knob).
    """

    def __init__(self, path: Union[str, os.PathLike, None] = None, sync_files: bool | None = None, thread_count: int | None = None):
        super().__init__(sync_files=sync_files, thread_count=thread_count)
        self.path = _strip_file_scheme(path)

    def reset(self, checkpoint_id=None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id is not None:
            self.path = _strip_file_scheme(checkpoint_id)

    def _store(self) -> BlobStore:
        if self.path is None:
            raise CheckpointNotFoundError("FileSystemWriter has no path: pass checkpoint_id= to save, or FileSystemWriter(path)")
        return FsStore(self.path)

    def _checkpoint_id(self) -> str:
        return str(self.path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return _is_local_path(checkpoint_id)


class FileSystemReader(BlobStorageReader):
    """Reads a checkpoint directory written by :class:`FileSystemWriter`.

    Args:
        path: the checkpoint directory (may also be given as ``checkpoint_id``).
        verify_checksums: check the CRC-32C of every item read (default True).
        thread_count: reader threads per rank (default: the DISTCKPT_IO_THREADS knob).
    """

    def __init__(self, path: Union[str, os.PathLike, None] = None, verify_checksums: bool = True, thread_count: int | None = None):
        super().__init__(verify_checksums=verify_checksums, thread_count=thread_count)
        self.path = _strip_file_scheme(path)

    def reset(self, checkpoint_id=None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id is not None:
            self.path = _strip_file_scheme(checkpoint_id)

    def _store(self) -> BlobStore:
        if self.path is None:
            raise CheckpointNotFoundError("FileSystemReader has no path: pass checkpoint_id= to load, or FileSystemReader(path)")
        if not Path(self.path).is_dir():
            raise CheckpointNotFoundError(f"checkpoint {str(self.path)!r} does not exist (no such directory); check the path")
        return FsStore(self.path)

    def _checkpoint_id(self) -> str:
        return str(self.path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return _is_local_path(checkpoint_id)
