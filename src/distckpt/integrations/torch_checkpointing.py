"""distckpt's stores as a storage backend of torch_checkpointing (``pip install torch-checkpointing``).

torch_checkpointing reads and writes through a small filesystem-like ``Storage`` interface. This module
implements it on the stores distckpt registers by scheme (:func:`distckpt.backends.store_for`)::

    from torch_checkpointing import CheckpointManager
    from distckpt.integrations.torch_checkpointing import DistckptStorageConfig

    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = DistckptStorageConfig()
    manager = config.build()
    manager.save("s3://bucket/run/step_100", state)     # or a path, or memory://run/step_100

What a checkpoint gains over torch_checkpointing's own local-filesystem backend:

- every file written (``stream_write``/``write``) carries a CRC-32C per block of ``block_bytes``, kept beside
  it in a small JSON sidecar (``.<name>.distckpt-crc``); every read (``stream_read``/``read``, whole or ranged,
  torch_checkpointing's parallel fills included) checks the blocks it touches and raises
  :class:`~distckpt.errors.CorruptCheckpointError` naming the file and byte range of a block that fails;
- ``metadata.pkl`` holds distckpt's tagged JSON, not a pickle (torch_checkpointing still calls
  ``pickle.loads``: on bytes this backend made from that JSON, never on bytes from storage);
- the stores beyond local disk: ``memory://`` (one process) and ``s3://`` (and any store registered with
  :func:`distckpt.backends.register_store`). On an object store a directory rename, torch_checkpointing's
  commit, copies the temporary directory into a save area of the destination and commits it with one
  conditional PUT, so of two racing saves exactly one commits and a reader never sees half a checkpoint;
- on local disk: files are created exclusively under a hidden name and renamed into place, opened without
  following links, read only when regular, and directories are removed through descriptors (never through
  a link); every directory is reached one component at a time, a link on the way followed only where root or
  this user owns it (one another user planted is refused); a rename follows the table of ``Storage.rename``
  exactly, atomically (``renameat2``). A stream used after close or abort raises ValueError; a close after a
  failed write, or one that fails, commits nothing and leaves no hidden file.

Paths are torch_checkpointing's: a local path, or ``scheme://...`` (``pathlib.Path`` turns ``s3://b/x`` into
``s3:/b/x``; both spellings name the same place).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import pickle
import stat
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from torch_checkpointing.storage.base_storage import ReadArgs, Storage, StorageConfig

from .. import faults
from ..backends.filesystem import FileReader, FsStore
from ..backends.fs_objects import clear_dir, is_real_dir, open_regular, rmdir_at
from ..backends.rename import rename_noreplace_at
from ..backends.schemes import scheme_entry, scheme_of, store_for
from ..engine.blobs import RUNS, BlobReader, BlobStore
from ..errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    NotRegularFileError,
    StorageIOError,
    UnsafeLocationError,
    UnsafeValueError,
)
from ..format import METADATA_FILE
from ..format.checksum import crc32c, format_crc, parse_crc
from ..format.json_text import parse_json
from ..format.values import decode_value, encode_value

__all__ = ["DistckptStorageConfig", "DistckptStorage"]

CRC_SUFFIX = ".distckpt-crc"
DIR_MARKER = ".distckpt-dir"
PART_MARK = ".distckpt-part-"
METADATA_PKL = "metadata.pkl"  # torch_checkpointing's metadata file (metadata_serialization.METADATA_FILE_NAME)
MANIFEST_FORMAT = "distckpt.torch_checkpointing"
_COPY_BYTES = 64 << 20
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


@dataclass
class DistckptStorageConfig(StorageConfig):
    """torch_checkpointing's ``storage_config`` for distckpt's stores.

    ``block_bytes``: bytes per CRC-32C block (a power of two; torch_checkpointing's parallel fills read 64 MiB
    ranges, so blocks up to that size are never read twice). ``verify``: check CRCs on read. ``sync``: make
    files and renames durable (fsync) before returning. ``pickled_metadata``: store ``metadata.pkl`` as the
    pickle torch_checkpointing made (only for metadata holding objects other than plain data: trusted
    checkpoints only), and read a pickled one written by another backend.
    """

    block_bytes: int = 1 << 20
    verify: bool = True
    sync: bool = True
    pickled_metadata: bool = False

    def __post_init__(self) -> None:
        if self.block_bytes < 4096 or self.block_bytes & (self.block_bytes - 1):
            raise CheckpointError(f"block_bytes={self.block_bytes}: a power of two of at least 4096 bytes")

    def create_storage(self) -> "DistckptStorage":
        return DistckptStorage(self)


# ---------------------------------------------------------------- paths


def _url(path: Any) -> str:
    """``s3:/b/x`` (what ``Path`` made of ``s3://b/x``) back to ``s3://b/x``; a local path made absolute."""
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if "\x00" in text:
        raise OSError(errno.EINVAL, f"{text!r} holds a NUL byte, which no file or object name may hold")
    if "://" in text:
        scheme, _, rest = text.partition("://")
        return f"{scheme}://{rest.strip('/')}"
    head, sep, rest = text.partition(":/")
    if sep and "/" not in head and head and scheme_entry(f"{head}://x") is not None and head != "file":
        return f"{head}://{rest.strip('/')}"
    if text.startswith("file://"):
        text = text[len("file://"):]
    return os.path.abspath(text)


def _split(url: str) -> tuple[str, str]:
    parent, _, name = url.rpartition("/")
    return parent, name


def _is_local(url: str) -> bool:
    return scheme_of(url) == "file"


def _sidecar(name: str) -> str:
    head, sep, base = name.rpartition("/")
    return f"{head}{sep}.{base}{CRC_SUFFIX}"


def _hidden(name: str) -> bool:
    return name == DIR_MARKER or (name.startswith(".") and (name.endswith(CRC_SUFFIX) or PART_MARK in name))


def _occupied(src: str, dst: str, code: int) -> FileExistsError:
    return FileExistsError(code, f"refusing to rename {src} onto {dst}: the destination is occupied, and a rename "
                                 "commits onto unoccupied space. Remove it first if it is meant to be replaced.")


# ---------------------------------------------------------------- checksums


class _Crcs:
    """The CRC-32C of each block of a file, as its sidecar holds them."""

    def __init__(self, size: int, block: int, crcs: list[int]):
        self.size, self.block, self.crcs = size, block, crcs

    def encode(self) -> bytes:
        return json.dumps({"format": "distckpt.block-crc32c", "version": 1, "size": self.size, "block_bytes": self.block,
                           "crc32c": [format_crc(c) for c in self.crcs]}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes, where: str) -> "_Crcs":
        doc = parse_json(raw, where)
        try:
            if not isinstance(doc, dict) or doc.get("format") != "distckpt.block-crc32c" or doc.get("version") != 1:
                raise ValueError("not a distckpt block-checksum document of version 1")
            size, block, crcs = doc["size"], doc["block_bytes"], doc["crc32c"]
            if type(size) is not int or type(block) is not int or size < 0 or block < 4096 or not isinstance(crcs, list):
                raise ValueError("size, block_bytes or crc32c of the wrong type")
            if len(crcs) != -(-size // block):
                raise ValueError(f"{len(crcs)} checksums for {size} bytes in blocks of {block}")
            return cls(size, block, [parse_crc(c) for c in crcs])
        except (KeyError, ValueError) as exc:
            raise CorruptCheckpointError(f"{where}: {exc}; the checksum file is damaged") from None


class _ChecksummingWriter(io.RawIOBase):
    """A write stream into one blob: bytes go to the blob in order while each block's CRC is computed."""

    def __init__(self, blob, block: int, where: str, finish):
        self._blob, self._block, self._where, self._finish = blob, block, where, finish
        self._pos = 0
        self._crc = 0
        self._fill = 0
        self._crcs: list[int] = []
        self._done = False
        self._failed: Optional[BaseException] = None  # a write that failed: close then commits nothing

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def write(self, data) -> int:
        if self._done or self.closed:
            raise ValueError("I/O operation on closed file")
        view = memoryview(data)
        if not view.c_contiguous:
            view = memoryview(bytes(view))
        view = view.cast("B")
        n = len(view)
        if n:
            try:
                self._blob.pwrite(view, self._pos)
            except BaseException as exc:
                self._failed = exc  # the blob now holds an unknown part of these bytes: never committed
                raise
            at = 0
            while at < n:
                take = min(n - at, self._block - self._fill)
                self._crc = crc32c(view[at: at + take], self._crc)
                self._fill += take
                at += take
                if self._fill == self._block:
                    self._crcs.append(self._crc)
                    self._crc, self._fill = 0, 0
            self._pos += n
        return n

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()
        return super().__exit__(exc_type, exc, tb)

    def abort(self) -> None:
        if not self._done:
            self._done = True
            try:
                self._blob.abort()
            finally:
                self._finish(None)
        super().close()

    def close(self) -> None:
        if not self._done and self._failed is not None:
            failed = self._failed
            self.abort()
            code = failed.errno if isinstance(failed, OSError) and failed.errno else errno.EIO
            raise OSError(code, f"{self._where} was not written: a write to it failed ({failed}), so closing it "
                                "committed nothing and removed what was written") from None
        if not self._done:
            self._done = True
            if self._fill:
                self._crcs.append(self._crc)
            try:
                self._finish(_Crcs(self._pos, self._block, self._crcs))
            except BaseException:
                super().close()
                raise
        super().close()


class _VerifyingReader(io.RawIOBase):
    """A seekable read stream over one blob that checks the CRC of every block it hands out bytes of."""

    def __init__(self, blob: BlobReader, crcs: Optional[_Crcs], where: str):
        self._blob, self._crcs, self._where = blob, crcs, where
        self.size = blob.size
        self._pos = 0
        self._cached: tuple[int, Optional[bytearray]] = (-1, None)  # the last partly read block, verified
        if crcs is not None and crcs.size != blob.size:
            raise CorruptCheckpointError(f"{where} holds {blob.size} bytes, but its checksums were written for "
                                         f"{crcs.size}; the file is damaged or was replaced")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._checkClosed()
        if whence not in (io.SEEK_SET, io.SEEK_CUR, io.SEEK_END):
            raise ValueError(f"invalid whence ({whence!r}, should be {io.SEEK_SET}, {io.SEEK_CUR} or {io.SEEK_END})")
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise OSError(errno.EINVAL, f"seek before the start of {self._where}")
        self._pos = base + offset
        return self._pos

    def _check(self, index: int, data) -> None:
        want = self._crcs.crcs[index]
        got = crc32c(data)
        if got != want:
            start = index * self._crcs.block
            raise CorruptCheckpointError(
                f"{self._where}: bytes {start}-{start + len(data) - 1} fail their CRC-32C (stored {format_crc(want)}, "
                f"read {format_crc(got)}); the file is damaged. Load an intact checkpoint.")

    def _fill(self, view: memoryview, offset: int) -> None:
        got = self._blob.readinto(view, offset)
        if got != len(view):
            raise CorruptCheckpointError(f"{self._where}: {got} bytes where {len(view)} were expected at offset {offset}; "
                                         "the file is shorter than when it was written")

    def readinto(self, buffer) -> int:
        # Every view of the caller's buffer is released before an error leaves: torch_checkpointing fills an
        # mmap through this call and closes it on the way out, which a live view would turn into BufferError.
        if self.closed:
            raise ValueError("I/O operation on closed file")
        error = None
        with memoryview(buffer) as outer, outer.cast("B") as view:
            try:
                return self._readinto(view)
            except (CorruptCheckpointError, OSError) as exc:
                error = exc.with_traceback(None)
        raise error

    def _readinto(self, view: memoryview) -> int:
        n = max(0, min(len(view), self.size - self._pos))
        if n == 0:
            return 0
        if self._crcs is None:
            self._fill(view[:n], self._pos)
            self._pos += n
            return n
        block = self._crcs.block
        done = 0
        while done < n:
            at = self._pos + done
            index, start = divmod(at, block)
            length = min(block, self.size - index * block)
            if start == 0 and n - done >= length:  # a whole block: straight into the caller's memory
                self._fill(view[done: done + length], at)
                self._check(index, view[done: done + length])
                done += length
                continue
            if self._cached[0] != index:
                scratch = bytearray(length)
                self._fill(memoryview(scratch), index * block)
                self._check(index, scratch)
                self._cached = (index, scratch)
            take = min(length - start, n - done)
            view[done: done + take] = self._cached[1][start: start + take]
            done += take
        self._pos += n
        return n

    def readall(self) -> bytes:
        self._checkClosed()
        out = bytearray(max(0, self.size - self._pos))
        self.readinto(out)
        return bytes(out)

    def close(self) -> None:
        if not self.closed:
            self._blob.close()
        super().close()


# ---------------------------------------------------------------- metadata.pkl as tagged JSON


class _PlainData(pickle.Unpickler):
    """Unpickles only what needs no class: dicts, lists, tuples, strings, numbers, None."""

    def find_class(self, module: str, name: str):
        raise UnsafeValueError(f"{module}.{name}")


def _metadata_to_json(raw: bytes, where: str) -> bytes:
    try:
        data = _PlainData(io.BytesIO(raw)).load()
    except UnsafeValueError as exc:
        raise UnsafeValueError(
            f"{where}: torch_checkpointing's metadata holds an object of class {exc}, which distckpt stores only as "
            "plain data; give the metadata's to_dict() plain values, or DistckptStorageConfig(pickled_metadata=True) "
            "to store the pickle (then load it only from storage you trust)") from None
    return encode_value(data, where=where)


def _metadata_to_pickle(raw: bytes, where: str, pickled_ok: bool) -> bytes:
    try:
        data = decode_value(raw, where=where)
    except CorruptCheckpointError:
        if pickled_ok:
            return raw
        raise UnsafeValueError(f"{where} is not distckpt's JSON metadata (a pickle another backend wrote?); it is not "
                               "unpickled unless DistckptStorageConfig(pickled_metadata=True), for a checkpoint you trust") from None
    return pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL)


# ---------------------------------------------------------------- local filesystem

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | _CLOEXEC
_MAX_LINKS = 40  # as the kernel's own limit on links followed in one path


def _not_own_dir(path: str) -> NotRegularFileError:
    return NotRegularFileError(f"{path} is not a directory of its own (a link); distckpt never writes or reads through a "
                               "link at a checkpoint's directory")


def _walk(path: str, *, create: bool = False, follow_last: bool = False) -> int:
    """A descriptor of the directory ``path`` (absolute), reached one component at a time from ``/`` with
    ``openat(O_NOFOLLOW)``, so that no link is followed unseen anywhere on the way.

    A link on the way is followed only where root or this user owns it (the rule of ``private_dir``: a link
    another user planted, as in a shared or world-writable folder, is refused with UnsafeLocationError); the
    last component is a real directory unless ``follow_last``. ``create`` makes missing directories, as
    ``os.makedirs`` would. Raises FileNotFoundError, NotADirectoryError or NotRegularFileError naming ``path``.
    """
    me = os.geteuid()
    todo = [p for p in path.split("/") if p][::-1]  # a stack: the next component last
    walked = "/"
    links = 0
    fd = os.open("/", _DIR_FLAGS)
    try:
        while todo:
            part = todo.pop()
            if part == ".":
                continue
            last = not todo
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create or part == "..":
                    raise FileNotFoundError(errno.ENOENT, f"{path} does not exist", path) from None
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o777, dir_fd=fd)
                todo.append(part)  # opened as any other (what another process made there meanwhile included)
                continue
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                where = os.path.join(walked, part)
                st = os.lstat(part, dir_fd=fd)
                if not stat.S_ISLNK(st.st_mode):
                    raise NotADirectoryError(errno.ENOTDIR, f"{where} is not a directory" +
                                             ("" if where == path else f" (on the way to {path})"), path) from None
                if last and not follow_last:
                    raise _not_own_dir(path) from None
                if st.st_uid not in (0, me):
                    raise UnsafeLocationError(
                        f"{where} is a symbolic link owned by uid {st.st_uid}, not by root or this user (uid {me}): another "
                        f"user may have planted it, and distckpt does not follow it to reach {path}. Remove it, or use the "
                        "real path") from None
                target = os.readlink(part, dir_fd=fd)
                again = os.lstat(part, dir_fd=fd)
                if (again.st_ino, again.st_dev, again.st_uid) != (st.st_ino, st.st_dev, st.st_uid):
                    raise UnsafeLocationError(f"{where} was replaced while distckpt followed it; nothing was done") from None
                links += 1
                if links > _MAX_LINKS:
                    raise OSError(errno.ELOOP, f"{path}: too many levels of symbolic links", path) from None
                if target.startswith("/"):
                    nfd = os.open("/", _DIR_FLAGS)
                    os.close(fd)
                    fd, walked = nfd, "/"
                todo.extend([p for p in target.split("/") if p][::-1])
                continue
            os.close(fd)
            fd = nfd
            walked = os.path.dirname(walked) if part == ".." else os.path.join(walked, part)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _named(exc: BaseException, url: str) -> BaseException:
    """``exc``, naming ``url`` where it named only a hidden temporary file (an OSError keeps its class and errno)."""
    if not isinstance(exc, OSError) or url in str(exc):
        return exc
    text = f"writing {url} failed: {exc.strerror or exc}; nothing of it was kept"
    if isinstance(exc, StorageIOError):
        return StorageIOError(text, exc.errno)
    if isinstance(exc, CheckpointError):
        return exc
    return OSError(exc.errno, text) if exc.errno else OSError(text)


class _Local:
    """Real files and directories, each file created exclusively under a hidden name and renamed into place.

    Every directory is reached through :func:`_walk` (no link followed unseen, none another user owns), and every
    name in it is then used relative to that descriptor."""

    def __init__(self, config: DistckptStorageConfig):
        self.config = config

    def _dir_fd(self, path: str) -> int:
        return _walk(path)

    def create(self, url: str) -> _ChecksummingWriter:
        parent, name = _split(url)
        try:
            fd = self._dir_fd(parent)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"{parent} does not exist; mkdir it first", parent) from None
        try:
            if _is_dir_at(name, fd):
                raise IsADirectoryError(errno.EISDIR, f"{url} is a directory", url)
        finally:
            os.close(fd)
        part = f".{name}{PART_MARK}{uuid.uuid4().hex}"
        blob = FsStore(parent).create(part)
        sync = self.config.sync
        side, sidecar = f"{part}{CRC_SUFFIX}", _sidecar(name)

        def finish(crcs: Optional[_Crcs]) -> None:
            try:
                fd = self._dir_fd(parent)
            except BaseException:
                if crcs is not None:
                    with contextlib.suppress(Exception):
                        blob.abort()
                raise
            placed = None  # the inode renamed to ``name``, once it is there
            try:
                if crcs is None:
                    _unlink_regular(part, fd)
                    return
                blob.close(sync)
                self._write_small(fd, side, crcs.encode())
                if _is_dir_at(name, fd):  # checked before anything is replaced
                    raise IsADirectoryError(errno.EISDIR, f"{url} is a directory", url)
                try:
                    os.replace(side, sidecar, src_dir_fd=fd, dst_dir_fd=fd)
                except OSError as exc:
                    raise OSError(exc.errno, f"writing {url} failed: its checksum file {os.path.join(parent, sidecar)} cannot "
                                             f"be replaced ({exc.strerror}); nothing of {url} was kept") from None
                inode = os.lstat(part, dir_fd=fd).st_ino
                try:
                    os.replace(part, name, src_dir_fd=fd, dst_dir_fd=fd)
                except OSError as exc:
                    _unlink_regular(sidecar, fd)  # the checksums of a file that is not there
                    if exc.errno == errno.EISDIR:
                        raise IsADirectoryError(errno.EISDIR, f"{url} is a directory", url) from None
                    raise
                placed = inode
                if sync:
                    os.fsync(fd)
            except BaseException as exc:
                for leftover in (part, side):
                    with contextlib.suppress(OSError):
                        _unlink_regular(leftover, fd)
                with contextlib.suppress(OSError):
                    if placed is not None and os.lstat(name, dir_fd=fd).st_ino == placed:
                        os.unlink(name, dir_fd=fd)  # a close that raises leaves no file behind
                        _unlink_regular(sidecar, fd)
                named = _named(exc, url)
                if named is exc:
                    raise
                raise named from exc
            finally:
                os.close(fd)

        return _ChecksummingWriter(blob, self.config.block_bytes, url, finish)

    def _write_small(self, dir_fd: int, name: str, data: bytes) -> None:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o644, dir_fd=dir_fd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if self.config.sync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _read_small(self, dir_fd: int, name: str, where: str) -> Optional[bytes]:
        try:
            fd = open_regular(name, dir_fd=dir_fd)
        except CheckpointNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size > 64 << 20:
                raise CorruptCheckpointError(f"{where}: {size} bytes, more than any checksum file distckpt writes")
            return os.pread(fd, size, 0)
        finally:
            os.close(fd)

    def open(self, url: str) -> tuple[BlobReader, Optional[bytes]]:
        parent, name = _split(url)
        fd = self._dir_fd(parent)
        try:
            try:
                blob = FileReader(url, open_regular(name, dir_fd=fd))
            except CheckpointNotFoundError:
                raise FileNotFoundError(errno.ENOENT, f"{url} does not exist", url) from None
            try:
                return blob, self._read_small(fd, _sidecar(name), url + " (its checksums)")
            except BaseException:
                blob.close()
                raise
        finally:
            os.close(fd)

    def exists(self, url: str) -> bool:
        return os.path.lexists(url)

    def isdir(self, url: str) -> bool:
        return is_real_dir(url)

    def mkdir(self, url: str, recursive: bool) -> None:
        parent, name = _split(url)
        fd = _walk(parent, create=recursive)
        try:
            try:
                os.mkdir(name, 0o777, dir_fd=fd)
            except FileExistsError:
                mode = os.lstat(name, dir_fd=fd).st_mode
                if stat.S_ISLNK(mode):
                    raise _not_own_dir(url) from None
                if not recursive or not stat.S_ISDIR(mode):
                    raise FileExistsError(errno.EEXIST, f"{url} exists" + ("" if stat.S_ISDIR(mode) else " and is not a directory"),
                                          url) from None
        finally:
            os.close(fd)

    def ls(self, url: str) -> list[str]:
        fd = _walk(url, follow_last=True)
        try:
            return sorted(n for n in os.listdir(fd) if not _hidden(n))
        finally:
            os.close(fd)

    def delete(self, url: str) -> None:
        parent, name = _split(url)
        fd = self._dir_fd(parent)
        try:
            mode = os.lstat(name, dir_fd=fd).st_mode
            if not stat.S_ISREG(mode):
                raise NotRegularFileError(f"{url} is not a regular file; distckpt deletes only files it wrote")
            os.unlink(name, dir_fd=fd)
            _unlink_regular(_sidecar(name), fd)
        finally:
            os.close(fd)

    def rmdir(self, url: str) -> None:
        parent, name = _split(url)
        pfd = self._dir_fd(parent)
        try:
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=pfd)
            except FileNotFoundError:
                raise FileNotFoundError(errno.ENOENT, f"{url} does not exist", url) from None
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise NotRegularFileError(f"{url} is not a directory of its own (a link or a file); left in place") from None
                raise
            left: list[str] = []
            try:
                clear_dir(fd, url, left)  # through descriptors only: no link inside leads the removal out
            finally:
                os.close(fd)
            if not left:
                faults.point("unlink", url)
                rmdir_at(name, pfd, left, url)
        finally:
            os.close(pfd)
        if left:
            raise NotRegularFileError(f"{url} was not removed whole: {', '.join(left[:5])} not files distckpt deletes "
                                      "(links, FIFOs, sockets or devices); remove them yourself")

    def rename(self, src: str, dst: str) -> None:
        sparent, sname = _split(src)
        dparent, dname = _split(dst)
        sfd = self._dir_fd(sparent)
        try:
            dfd = self._dir_fd(dparent)
        except BaseException:
            os.close(sfd)
            raise
        try:
            try:
                src_mode = os.lstat(sname, dir_fd=sfd).st_mode
            except FileNotFoundError:
                raise FileNotFoundError(errno.ENOENT, f"{src} does not exist", src) from None
            try:
                dst_mode: Optional[int] = os.lstat(dname, dir_fd=dfd).st_mode
            except FileNotFoundError:
                dst_mode = None
            if stat.S_ISDIR(src_mode):
                self._rename_dir(src, dst, dst_mode, sfd, dfd)
            elif stat.S_ISREG(src_mode):
                self._rename_file(src, dst, dst_mode, sfd, dfd)
            else:
                raise NotRegularFileError(f"{src} is neither a regular file nor a directory; distckpt never moves links")
            if self.config.sync:
                os.fsync(sfd)
                if dparent != sparent:
                    os.fsync(dfd)
        finally:
            os.close(sfd)
            os.close(dfd)

    def _rename_dir(self, src: str, dst: str, dst_mode: Optional[int], sfd: int, dfd: int) -> None:
        if dst_mode is not None and not stat.S_ISDIR(dst_mode):
            raise _occupied(src, dst, errno.ENOTDIR)
        sname, dname = _split(src)[1], _split(dst)[1]
        try:
            if dst_mode is None:
                rename_noreplace_at(sfd, sname, dfd, dname)
            else:  # replaces an empty directory atomically, refuses a populated one
                os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise _occupied(src, dst, exc.errno) from None
            raise OSError(exc.errno, f"cannot rename {src} to {dst}: {exc.strerror}") from None

    def _rename_file(self, src: str, dst: str, dst_mode: Optional[int], sfd: int, dfd: int) -> None:
        if dst_mode is not None and stat.S_ISDIR(dst_mode):
            raise _occupied(src, dst, errno.EISDIR)
        if dst_mode is not None and not stat.S_ISREG(dst_mode):
            raise _occupied(src, dst, errno.EEXIST)  # a link or a device: not a file to replace
        sname, dname = _split(src)[1], _split(dst)[1]
        try:
            os.lstat(_sidecar(sname), dir_fd=sfd)
        except FileNotFoundError:
            _unlink_regular(_sidecar(dname), dfd)
        else:
            os.replace(_sidecar(sname), _sidecar(dname), src_dir_fd=sfd, dst_dir_fd=dfd)
        os.replace(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)


def _is_dir_at(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(name, dir_fd=dir_fd).st_mode)
    except FileNotFoundError:
        return False


def _unlink_regular(name: str, dir_fd: int) -> None:
    try:
        if stat.S_ISREG(os.lstat(name, dir_fd=dir_fd).st_mode):
            os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


# ---------------------------------------------------------------- object stores (memory://, s3://, registered ones)


class _Objects:
    """Directories as stores of blobs; a renamed directory is a committed save of its destination's store.

    A directory is the store ``store_for(url)``: its files are blobs, with a marker blob from ``mkdir``. A
    rename of directory T onto D copies T's blobs into ``D.staging(save id)``, adds a manifest (the files and
    their sizes) as the staging store's metadata blob, and commits it with ``D.commit`` (S3: a conditional
    PUT; of two racing renames exactly one wins). Files of a committed D are read from ``D.data_store``.
    """

    def __init__(self, config: DistckptStorageConfig):
        self.config = config
        self._manifests: dict[str, dict] = {}
        self._lock = threading.Lock()

    # -- committed directories

    def _manifest(self, url: str) -> Optional[dict]:
        with self._lock:
            if url in self._manifests:
                return self._manifests[url]
        if "/" not in url.partition("://")[2]:
            return None  # a bucket or a name alone: no checkpoint there
        try:
            store = store_for(url)
            if not store.exists(METADATA_FILE):
                return None
            blob = store.open(METADATA_FILE)
        except CheckpointNotFoundError:
            return None
        try:
            raw = blob.pread(blob.size, 0)
        finally:
            blob.close()
        doc = parse_json(raw, f"{url}/{METADATA_FILE}")
        if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
            raise CorruptCheckpointError(f"{url} holds a checkpoint distckpt wrote itself, not torch_checkpointing's; "
                                         "load it with distckpt.load")
        files, save_id = doc.get("files"), doc.get("save_id")
        if doc.get("version") != 1 or not isinstance(files, dict) or not isinstance(save_id, str) or \
                not all(isinstance(k, str) and type(v) is int and v >= 0 for k, v in files.items()):
            raise CorruptCheckpointError(f"{url}/{METADATA_FILE}: not a manifest of version 1 with files and a save id")
        with self._lock:
            self._manifests[url] = doc
        return doc

    def _committed_home(self, url: str) -> Optional[tuple[str, dict, str]]:
        """(the committed directory holding ``url``, its manifest, ``url`` relative to it), or None."""
        parent = url
        while "://" in parent and "/" in parent.partition("://")[2]:
            parent, _ = _split(parent)
            manifest = self._manifest(parent)
            if manifest is not None:
                return parent, manifest, url[len(parent) + 1:]
        return None

    # -- files

    def create(self, url: str) -> _ChecksummingWriter:
        parent, name = _split(url)
        if self._committed_home(url) is not None or self._manifest(url) is not None:
            raise FileExistsError(errno.EEXIST, f"{url} is inside a committed checkpoint, which is never written to "
                                                "again; write into a new directory and rename it", url)
        if self._isdir(url):
            raise IsADirectoryError(errno.EISDIR, f"{url} is a directory", url)
        store = store_for(parent)
        blob = store.create(name)

        def finish(crcs: Optional[_Crcs]) -> None:
            if crcs is not None:
                blob.close(self.config.sync)
                store.put_atomic(_sidecar(name), crcs.encode(), self.config.sync)

        return _ChecksummingWriter(blob, self.config.block_bytes, url, finish)

    def _locate(self, url: str) -> tuple[BlobStore, str]:
        home = self._committed_home(url)
        if home is not None:
            directory, manifest, rel = home
            if rel not in manifest["files"]:
                raise FileNotFoundError(errno.ENOENT, f"{url} is not a file of the committed checkpoint {directory}", url)
            return store_for(directory).data_store(manifest["save_id"]), rel
        parent, name = _split(url)
        return store_for(parent), name

    def open(self, url: str) -> tuple[BlobReader, Optional[bytes]]:
        store, name = self._locate(url)
        try:
            blob = store.open(name)
        except CheckpointNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"{url} does not exist", url) from None
        try:
            side = store.open(_sidecar(name))
        except CheckpointNotFoundError:
            return blob, None
        try:
            if side.size > 64 << 20:
                raise CorruptCheckpointError(f"{url}: its checksum file holds {side.size} bytes, more than distckpt writes")
            return blob, side.pread(side.size, 0)
        finally:
            side.close()

    def _is_file(self, url: str) -> bool:
        home = self._committed_home(url)
        if home is not None:
            return home[2] in home[1]["files"]
        parent, name = _split(url)
        return "/" in parent.partition("://")[2] and store_for(parent).exists(name)

    # -- directories

    def _entries(self, url: str) -> list[str]:
        """What ``ls`` shows of directory ``url`` (its hidden blobs left out)."""
        manifest = self._manifest(url)
        if manifest is not None:
            return sorted({f.split("/", 1)[0] for f in manifest["files"]})
        home = self._committed_home(url)
        if home is not None:
            prefix = home[2] + "/"
            return sorted({f[len(prefix):].split("/", 1)[0] for f in home[1]["files"] if f.startswith(prefix)})
        store = store_for(url)
        names = {n.rstrip("/") for n in store.list()}
        if RUNS in store.capabilities:
            names.update(store.children())
        return sorted(n for n in names if n and not _hidden(n) and "#tmp-" not in n)

    def _isdir(self, url: str) -> bool:
        if "/" not in url.partition("://")[2]:
            return True  # a bucket, or the top of memory://
        if self._manifest(url) is not None:
            return True
        home = self._committed_home(url)
        if home is not None:
            return any(f.startswith(home[2] + "/") for f in home[1]["files"])
        store = store_for(url)
        if any(True for _ in store.list()):
            return True
        return RUNS in store.capabilities and bool(store.children())

    def exists(self, url: str) -> bool:
        return self._isdir(url) or self._is_file(url)

    def isdir(self, url: str) -> bool:
        return self._isdir(url)

    def mkdir(self, url: str, recursive: bool) -> None:
        if self._is_file(url):
            raise FileExistsError(errno.EEXIST, f"{url} is a file", url)
        parent, _ = _split(url)
        if not recursive and "/" in parent.partition("://")[2] and not self._isdir(parent):
            raise FileNotFoundError(errno.ENOENT, f"{parent} does not exist", parent)
        if self._manifest(url) is None and self._committed_home(url) is None:
            store = store_for(url)
            store.prepare()
            store.put_atomic(DIR_MARKER, b"", False)

    def ls(self, url: str) -> list[str]:
        if not self._isdir(url):
            raise FileNotFoundError(errno.ENOENT, f"{url} is not a directory", url)
        return self._entries(url)

    def delete(self, url: str) -> None:
        raise io.UnsupportedOperation(f"{url}: the store of {scheme_of(url)}:// deletes whole directories only (rmdir)")

    def rmdir(self, url: str) -> None:
        if not self._isdir(url):
            raise FileNotFoundError(errno.ENOENT, f"{url} is not a directory", url)
        if self._committed_home(url) is not None:
            raise io.UnsupportedOperation(f"{url} is inside a committed checkpoint; remove the whole checkpoint")
        self._remove_tree(url)

    def _remove_tree(self, url: str) -> None:
        store = store_for(url)
        if RUNS not in store.capabilities:
            raise io.UnsupportedOperation(f"the store of {url} cannot remove directories")
        if self._manifest(url) is None:
            for child in store.children():
                self._remove_tree(f"{url}/{child}")
        store.remove()
        with self._lock:
            self._manifests.pop(url, None)

    def rename(self, src: str, dst: str, background_cleanup: bool) -> None:
        if dst == src or dst.startswith(src + "/"):
            raise OSError(errno.EINVAL, f"cannot rename {src} to {dst}: a directory cannot be moved into itself")
        if self._is_file(src):
            raise io.UnsupportedOperation(f"{src}: the store of {scheme_of(src)}:// renames directories only")
        if not self._isdir(src):
            raise FileNotFoundError(errno.ENOENT, f"{src} does not exist", src)
        if self._committed_home(src) is not None:
            raise io.UnsupportedOperation(f"{src} is a directory inside a committed checkpoint, which is never changed; "
                                          "rename the whole checkpoint")
        if self._committed_home(dst) is not None:
            raise _occupied(src, dst, errno.EEXIST)
        if self._is_file(dst):
            raise _occupied(src, dst, errno.ENOTDIR)
        if self._manifest(dst) is not None or self._entries(dst):
            raise _occupied(src, dst, errno.ENOTEMPTY)
        files = self._files_below(src)
        target = store_for(dst)
        save_id = uuid.uuid4().hex
        staging = target.staging(save_id)
        try:
            staging.prepare()
            sizes = {}
            for rel, store, name in files:
                sizes[rel] = self._copy(f"{src}/{rel}", store, name, rel, staging)
            manifest = {"format": MANIFEST_FORMAT, "version": 1, "save_id": save_id,
                        "files": {rel: size for rel, size in sizes.items() if not _hidden(rel.rpartition("/")[2])}}
            staging.put_atomic(METADATA_FILE, json.dumps(manifest, separators=(",", ":")).encode(), self.config.sync)
        except BaseException:
            target.discard(staging)
            raise
        try:
            target.commit(staging, overwrite=False, sync=self.config.sync)
        except BaseException as exc:
            # Only a lost race is "occupied": another save's manifest is there now. A commit that landed before its
            # store failed (cleaning up after it) is a commit. Any other failure is itself, and this save's staged
            # copy goes (a store's discard also leaves a save that did commit alone).
            committed = None
            if isinstance(exc, Exception):
                with contextlib.suppress(Exception):
                    committed = self._manifest(dst)
            if committed is None or committed.get("save_id") != save_id:
                with contextlib.suppress(Exception):
                    target.discard(staging)
                if committed is not None:
                    raise _occupied(src, dst, errno.EEXIST) from None
                if isinstance(exc, OSError) or not isinstance(exc, Exception):
                    raise
                raise OSError(errno.EIO, f"committing the rename of {src} to {dst} failed: {exc}; nothing was committed, "
                                         f"{src} is left as it was") from exc
        if background_cleanup:
            threading.Thread(target=self._remove_tree, args=(src,), daemon=True).start()
        else:
            self._remove_tree(src)

    def _files_below(self, url: str, rel: str = "") -> list[tuple[str, BlobStore, str]]:
        """Every file below directory ``url``, its checksum files included: (its name relative to ``url`` prefixed
        with ``rel``, the store holding it, its name there). A committed directory's files are those of its
        manifest, read from its save's data store (never its store's own objects: on S3 the manifest and the
        save area)."""
        out = {}
        manifest = self._manifest(url)
        if manifest is not None:
            data = store_for(url).data_store(manifest["save_id"])
            for name in manifest["files"]:
                out[rel + name] = (data, name)
                if data.exists(_sidecar(name)):
                    out[rel + _sidecar(name)] = (data, _sidecar(name))
            return sorted((r, st, n) for r, (st, n) in out.items())
        store = store_for(url)
        for name in store.list():
            if name.endswith("/") or name == DIR_MARKER:
                continue
            out[rel + name] = (store, name)
        listed = sorted((r, st, n) for r, (st, n) in out.items())
        if RUNS in store.capabilities:
            for child in store.children():
                if "#tmp-" not in child:
                    listed.extend(self._files_below(f"{url}/{child}", f"{rel}{child}/"))
        return sorted(listed, key=lambda f: f[0])

    def _copy(self, where: str, store: BlobStore, name: str, rel: str, staging: BlobStore) -> int:
        src = where
        reader = store.open(name)
        try:
            writer = staging.create(rel)
            try:
                buf = bytearray(min(_COPY_BYTES, max(1, reader.size)))
                at = 0
                while at < reader.size:
                    view = memoryview(buf)[: min(len(buf), reader.size - at)]
                    got = reader.readinto(view, at)
                    if got != len(view):
                        raise CorruptCheckpointError(f"{src}: cut short at byte {at + got} while it was renamed")
                    writer.pwrite(view, at)
                    at += got
            except BaseException:
                writer.abort()
                raise
            writer.close(self.config.sync)
            return reader.size
        finally:
            reader.close()


# ---------------------------------------------------------------- the Storage


class DistckptStorage(Storage):
    """torch_checkpointing's ``Storage`` on distckpt's stores; see the module's docstring."""

    def __init__(self, config: Optional[DistckptStorageConfig] = None):
        self.config = config or DistckptStorageConfig()
        self._local = _Local(self.config)
        self._objects = _Objects(self.config)

    def _ns(self, url: str):
        return self._local if _is_local(url) else self._objects

    # -- writes

    def stream_write(self, path) -> io.IOBase:
        url = _url(path)
        return self._ns(url).create(url)

    def write(self, path, data) -> None:
        url = _url(path)
        view = memoryview(data).cast("B") if memoryview(data).c_contiguous else memoryview(bytes(memoryview(data)))
        if _split(url)[1] == METADATA_PKL and not self.config.pickled_metadata:
            view = memoryview(_metadata_to_json(bytes(view), url))
        with self._ns(url).create(url) as stream:
            stream.write(view)

    # -- reads

    def _reader(self, url: str) -> _VerifyingReader:
        blob, side = self._ns(url).open(url)
        try:
            crcs = None
            if self.config.verify:
                if side is None:
                    raise CorruptCheckpointError(
                        f"{url} has no checksums (.{_split(url)[1]}{CRC_SUFFIX} is missing): it was not written through "
                        "distckpt's storage, or its checksum file was lost; DistckptStorageConfig(verify=False) reads it unchecked")
                crcs = _Crcs.decode(side, url + " (its checksums)")
            return _VerifyingReader(blob, crcs, url)
        except BaseException:
            blob.close()
            raise

    def stream_read(self, path, read_args: Optional[ReadArgs] = None) -> io.RawIOBase:
        url = _url(path)
        if _split(url)[1] == METADATA_PKL:
            return io.BytesIO(self.read(path, read_args))
        reader = self._reader(url)
        if read_args is not None and read_args.known_size_bytes is not None and read_args.known_size_bytes != reader.size:
            reader.close()
            raise CorruptCheckpointError(f"{url} holds {reader.size} bytes, not the {read_args.known_size_bytes} expected")
        return reader

    def read(self, path, read_args: Optional[ReadArgs] = None) -> bytes:
        url = _url(path)
        with self._reader(url) as reader:
            raw = reader.readall()
        if _split(url)[1] == METADATA_PKL:
            return _metadata_to_pickle(raw, url, self.config.pickled_metadata)
        return raw

    def getsize(self, path) -> int:
        url = _url(path)
        if _split(url)[1] == METADATA_PKL:
            return len(self.read(path))
        with self._reader(url) as reader:
            return reader.size

    # -- names

    def exists(self, path) -> bool:
        url = _url(path)
        return self._ns(url).exists(url)

    def isdir(self, path) -> bool:
        url = _url(path)
        return self._ns(url).isdir(url)

    def ls(self, path) -> list[str]:
        url = _url(path)
        return self._ns(url).ls(url)

    def mkdir(self, path, recursive: bool = True) -> None:
        url = _url(path)
        self._ns(url).mkdir(url, recursive)

    def delete(self, path) -> None:
        url = _url(path)
        self._ns(url).delete(url)

    def rmdir(self, path) -> None:
        url = _url(path)
        self._ns(url).rmdir(url)

    def rename(self, src_path, dst_path, is_directory: bool = False, background_cleanup: bool = False) -> None:
        """torch_checkpointing's commit, exactly as the table of ``Storage.rename`` says (an occupied destination
        raises ``FileExistsError``, an ``OSError``); between stores of different schemes, refused."""
        src, dst = _url(src_path), _url(dst_path)
        if scheme_of(src) != scheme_of(dst):
            raise OSError(errno.EXDEV, f"cannot rename {src} to {dst}: different stores")
        if _is_local(src):
            self._local.rename(src, dst)
        else:
            self._objects.rename(src, dst, background_cleanup)

    def glob(self, pattern: str) -> list[str]:
        import fnmatch

        directory, name = os.path.split(pattern)
        try:
            if not self.isdir(directory):
                return []
            return [os.path.join(directory, n) for n in fnmatch.filter(self.ls(directory), name)]
        except FileNotFoundError:
            return []

    def remap_path(self, path) -> str:
        return _url(path)
