"""Local (or network-mounted POSIX) filesystem storage: the default backend."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import uuid
from typing import Any, Iterable, Optional, Union

from .. import faults, knobs
from ..engine.blobs import LEASES, MAPS, PAGE_CACHE, REFERENCES, RUNS, BlobReader, BlobStore, BlobWriter
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..format.stream_transforms import StreamTransforms
from ..layouts.dcp import is_dcp_directory
from .blob_storage import BlobStorageReader, BlobStorageWriter
from .direct_io import DirectWriter, bounce_buffer_bytes, bounce_buffer_count, direct_io_wanted, pwrite_all
from .fs_objects import create_exclusive, is_real_dir, open_dir, open_regular, remove_tree
from .fs_runs import (  # noqa: F401 - the marks and names are this module's to other modules and tests
    LEASE_MARK,
    RETIRED_MARK,
    TMP_MARK,
    TRASH,
    RunParts,
    _holds_replaced,
    _io_error,
    hidden_name,
    parse_hidden,
)
from .rename import exchange, rename_noreplace
from .replaced import carry_foreign, check_target, dcp_checkpoint_files, holds_committed_metadata, unreadable_metadata
from .schemes import looks_like_scheme_typo, register_store, scheme_of
from .write_paths import PATHS, TimedWriter, device_of

log = logging.getLogger("distckpt")

_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024)

__all__ = ["FileSystemWriter", "FileSystemReader", "FsStore"]


class _FdWriter(BlobWriter):
    def __init__(self, path: str):
        self.path = path
        try:
            self.fd = create_exclusive(path)
        except OSError as exc:
            raise _io_error("creating", path, exc) from exc

    def pwrite(self, data: memoryview, offset: int) -> None:
        view = memoryview(data).cast("B")
        try:
            faults.point("write", self.path)
            pwrite_all(self.fd, [view], offset)
        except OSError as exc:
            raise _io_error("writing", self.path, exc) from exc

    def pwritev(self, buffers: list, offset: int) -> None:
        try:
            faults.point("write", self.path)
            want = sum(len(b) for b in buffers)
            if _vectored(os.pwritev, self.fd, buffers, offset) != want:
                raise OSError(errno.EIO, "short write")
        except OSError as exc:
            raise _io_error("writing", self.path, exc) from exc

    def close(self, sync: bool) -> None:
        try:
            if sync:
                faults.point("fsync", self.path)
                os.fsync(self.fd)
        except OSError as exc:
            raise _io_error("fsync of", self.path, exc) from exc
        finally:
            fd, self.fd = self.fd, -1  # a closed writer holds no number another file may be given
            os.close(fd)


class FileReader(BlobReader):
    small_reads_are_cheap = True
    nowait_refused = False

    def __init__(self, path: str, fd: int):
        self.path = path
        self.fd = fd
        self.size = os.fstat(self.fd).st_size

    def identity(self) -> Optional[tuple]:
        st = os.fstat(self.fd)
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

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

    def readv(self, views: list, offset: int) -> int:
        try:
            return _vectored(os.preadv, self.fd, views, offset)
        except OSError as exc:
            raise _io_error("reading", self.path, exc) from exc

    def readv_cached(self, views: list, offset: int) -> Optional[int]:
        if _NOWAIT is None or self.nowait_refused:
            return None
        try:
            return _vectored(_preadv_nowait, self.fd, views, offset)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # tmpfs and some file systems: they never wait anyway
                self.nowait_refused = True
                return None
            raise _io_error("reading", self.path, exc) from exc

    def close(self) -> None:
        fd, self.fd = self.fd, -1  # a closed reader holds no number another file may be given
        os.close(fd)


_NOWAIT = getattr(os, "RWF_NOWAIT", None)


def _preadv_nowait(fd: int, views: list, offset: int) -> int:
    """preadv that stops (returns 0) where the next byte is not in the page cache."""
    try:
        return os.preadv(fd, views, offset, _NOWAIT)
    except BlockingIOError:
        return 0


def _vectored(op, fd: int, buffers: list, offset: int) -> int:
    """Run ``os.pwritev``/``os.preadv`` over ``buffers`` until done (or end of file); return the bytes moved.

    The calls may move fewer bytes than asked, and take at most IOV_MAX buffers each.
    """
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    i = total = 0
    while i < len(views):
        n = op(fd, views[i:i + _IOV_MAX], offset + total)
        if n == 0:
            break
        total += n
        while i < len(views) and n >= len(views[i]):  # skip what is done, trim the one in progress
            n -= len(views[i])
            i += 1
        if n:
            views[i] = views[i][n:]
    return total


def _fsync_dir(path: str) -> None:
    faults.point("fsync", path)
    fd = open_dir(path)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_parent(path: str) -> None:
    """Make the entry ``path`` durable in its parent directory. The parent is opened as the path names it: the
    rename that made the entry resolved it the same way (a parent that is a link, as /data -> /mnt/data, is
    the user's), and an fsync reads and changes nothing in it."""
    parent = os.path.dirname(path)
    faults.point("fsync", parent)
    fd = os.open(parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FsStore(RunParts, BlobStore):
    """Blobs as files in one directory."""

    capabilities = frozenset({RUNS, LEASES, MAPS, PAGE_CACHE, REFERENCES})

    def __init__(self, root: Union[str, os.PathLike], follow_root: bool = True):
        self.root = os.fspath(root)
        self.follow_root = follow_root  # False: a link where the directory should be is refused (a sibling found by name)
        self._direct: Optional[bool] = None  # data files written with O_DIRECT: asked once, on the first file
        self._device: Optional[int] = None  # where the way to write is learned (write_paths.py)

    def _p(self, name: str) -> str:
        return os.path.join(self.root, name)

    def prepare(self) -> None:
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise _io_error("creating directory", self.root, exc) from exc
        if not is_real_dir(self.root):
            raise CheckpointError(f"{self.root} is not a directory of its own (a symbolic link, or a file); "
                                  "distckpt writes only into directories it can see are real. Use another path.")

    def _writes_directly(self) -> bool:
        """Whether this store's data files go around the page cache: asked once, on the first file. Where
        ``DISTCKPT_DIRECT_IO=auto`` finds a local disk, whichever way has moved files faster to that device
        (write_paths.py)."""
        if self._direct is None:
            self._direct = direct_io_wanted(self.root)
            learning = self._direct and knobs.direct_io_mode() == "auto"
            self._device = device_of(self.root) if learning else None
            if self._device is not None:
                self._direct = PATHS.choose(self._device)
        return self._direct

    def create(self, name: str, buffer_bytes: Optional[int] = None) -> BlobWriter:
        direct = self._writes_directly()
        writer: BlobWriter = (DirectWriter(self._p(name), _io_error, bounce_buffer_bytes(buffer_bytes)) if direct
                              else _FdWriter(self._p(name)))
        if self._device is not None:
            return TimedWriter(writer, PATHS, self._device, direct)
        return writer

    def write_buffer_bytes(self, buffer_bytes: Optional[int] = None) -> int:
        return bounce_buffer_count() * bounce_buffer_bytes(buffer_bytes) if self._writes_directly() else 0

    def open(self, name: str) -> BlobReader:
        path = self._p(name)
        try:
            dir_fd = os.open(self.root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
                             | (0 if self.follow_root else os.O_NOFOLLOW))
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self.root} does not exist; the checkpoint is incomplete or was removed") from None
        except OSError as exc:
            if not self.follow_root and exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise CheckpointNotFoundError(f"{self.root} is a link or not a directory: a step found by name is never "
                                              "followed through a link") from None
            raise _io_error("opening", self.root, exc) from exc
        try:
            return FileReader(path, open_regular(name, dir_fd=dir_fd))  # relative to the checkpoint's directory
        except OSError as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise _io_error("opening", path, exc) from exc
        finally:
            os.close(dir_fd)

    def put_atomic(self, name: str, data: bytes, sync: bool) -> None:
        final = self._p(name)
        tmp = f"{final}.tmp-{uuid.uuid4().hex}"
        w = _FdWriter(tmp)
        try:
            w.pwrite(memoryview(data), 0)
        finally:
            w.close(sync)
        try:
            faults.point("rename", final)
            os.replace(tmp, final)
            if sync:
                _fsync_dir(self.root)
        except OSError as exc:
            raise _io_error("committing", final, exc) from exc

    def exists(self, name: str) -> bool:
        return os.path.lexists(self._p(name))

    def map(self, name: str, size: int) -> Optional[mmap.mmap]:
        """Blob ``name`` mapped whole, private and never written back (None when it is empty): a regular file of
        exactly ``size`` bytes, opened without following links; anything else raises CorruptCheckpointError.
        A file truncated while it is mapped ends the process with SIGBUS at the first read past its end: map only
        files nothing else rewrites (a committed checkpoint's)."""
        fd = open_regular(self._p(name))
        try:
            if os.fstat(fd).st_size != size:
                raise CorruptCheckpointError(f"{self._p(name)} holds {os.fstat(fd).st_size} bytes, not the {size} its "
                                             "metadata records; the checkpoint is damaged")
            if not size:
                return None
            return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    def list(self) -> Iterable[str]:
        try:
            return sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []

    def describe(self, name: str = "") -> str:
        return self._p(name) if name else self.root

    # ---- commit: a hidden sibling directory, renamed into place

    def staging(self, save_id: str) -> "FsStore":
        return FsStore(self._sibling(save_id))

    def check_replaceable(self) -> None:
        final = os.path.abspath(self.root)
        if not os.path.lexists(final) or (is_real_dir(final) and not os.listdir(final)):
            return
        if is_real_dir(final) and (holds_committed_metadata(final) or dcp_checkpoint_files(final) is not None):
            return
        why = unreadable_metadata(final) if is_real_dir(final) else None
        if why is not None:
            raise CheckpointError(
                f"{final} holds a metadata.json this distckpt cannot read ({why}); an overwrite would drop files that "
                "kept steps may reference. Load it with a distckpt that reads it, save to a new path, or remove it yourself.")
        raise CheckpointError(
            f"{final} is not a committed distckpt checkpoint (no metadata.json of distckpt in it, or not a directory "
            "of its own), nor one torch.distributed.checkpoint wrote (its .metadata and regular files only, no "
            "links or subdirectories); overwrite=True replaces only a committed checkpoint. Save to a new path, or remove it yourself.")

    def commit(self, staging: BlobStore, overwrite: bool, sync: bool) -> None:
        assert isinstance(staging, FsStore)
        check_save_target(self.root)
        final = os.path.abspath(self.root)
        try:
            if sync:
                _fsync_dir(staging.root)
            if is_real_dir(final) and not os.listdir(final):
                os.rmdir(final)  # an empty directory made by the user is not a checkpoint
            faults.point("rename", final)
            if overwrite and os.path.lexists(final):
                self.check_replaceable()
                exchange(staging.root, final)  # atomic swap: the old checkpoint is now at staging.root
                if sync:
                    _fsync_parent(final)
                if carry_foreign(staging.root, final):  # the replaced checkpoint, distckpt's or DCP's
                    self._drop_replaced(staging.root)
            else:
                rename_noreplace(staging.root, final)
            if sync:
                _fsync_parent(final)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY) and not overwrite:
                self.discard(staging)
                raise CheckpointError(
                    f"checkpoint {final!r} was committed by another save while this one was writing; "
                    "this save was discarded and the committed checkpoint left as it is") from None
            raise _io_error("committing", final, exc) from exc

    def discard(self, staging: BlobStore) -> None:
        assert isinstance(staging, FsStore)
        if _holds_replaced(FsStore(staging.root, follow_root=False)):
            # the overwrite swapped, then failed: what it replaced is there now, with what a user kept in it
            if carry_foreign(staging.root, os.path.abspath(self.root)):
                self._drop_replaced(staging.root)
            return
        remove_tree(staging.root)

    def sizes(self) -> dict[str, int]:
        try:
            with os.scandir(self.root) as entries:
                return {e.name: e.stat(follow_symlinks=False).st_size for e in entries if e.is_file(follow_symlinks=False)}
        except FileNotFoundError:
            return {}











def _is_local_path(checkpoint_id: Union[str, os.PathLike]) -> bool:
    text = os.fspath(checkpoint_id)
    return isinstance(text, str) and ("://" not in text or text.startswith("file://"))


def _strip_file_scheme(checkpoint_id: Union[str, os.PathLike, None]):
    if checkpoint_id is None:
        return None
    text = os.fspath(checkpoint_id)
    return text[len("file://"):] if text.startswith("file://") else text


def checked_path(checkpoint_id: Union[str, os.PathLike]) -> str:
    """The directory path a plain path or ``file://`` URL names, or a CheckpointError naming the id and the fix.

    An id of another scheme (``s3://``, ``memory://``) or a one-slash typo of one (``s3:/bucket``) would land in a
    local directory named after the scheme; an empty one (``""``, ``file://``) names no directory at all."""
    text = os.fspath(checkpoint_id)
    if not isinstance(text, str):
        raise CheckpointError(f"checkpoint_id {text!r} is bytes; pass the path as a str")
    scheme = scheme_of(text)
    if scheme != "file":
        raise CheckpointError(f"checkpoint_id {text!r} is a {scheme}:// id, not a directory: leave storage_writer= and "
                              "storage_reader= out, or use the storage layer of that scheme")
    typo = looks_like_scheme_typo(text)
    if typo is not None:
        raise CheckpointError(f"checkpoint_id {text!r} looks like a {typo}:// id with one slash; write {typo}://..., "
                              f"or ./{text} for a local directory of that name")
    path = _strip_file_scheme(text)
    if "\0" in path:
        raise CheckpointError(f"checkpoint_id {text!r} holds a NUL byte, which no path can; check how it was built")
    if not path:
        raise CheckpointError(f"checkpoint_id {text!r} names no directory; pass a path such as 'checkpoints/step-100'")
    return path


def check_save_target(path: str) -> None:
    """Refuse to commit a checkpoint at the working or the root directory: the commit puts the checkpoint in
    place of the directory it names, and these are directories the process stands in."""
    final = os.path.abspath(path)
    if final in (os.path.abspath(os.curdir), os.path.abspath(os.sep)):
        raise CheckpointError(f"checkpoint_id {path!r} names the {'root' if final == os.path.abspath(os.sep) else 'working'} "
                              "directory: a checkpoint is saved as a directory of its own, which the commit puts in place "
                              "of whatever the path names; pass a path such as 'checkpoints/step-100'")


def fs_store(checkpoint_id: str) -> FsStore:
    """The store of a plain path or a ``file://`` URL (the factory of scheme ``file``)."""
    return FsStore(checked_path(checkpoint_id))


class _AtPath:
    """A filesystem writer or reader names its checkpoint by its path (``file://`` stripped), as ``path``."""

    @property
    def path(self) -> Optional[str]:
        return self.checkpoint_id  # type: ignore[attr-defined]

    def canonical(self, checkpoint_id: Union[str, os.PathLike]) -> str:
        return checked_path(checkpoint_id)

    def _require_path(self) -> str:
        if self.path is None:
            raise CheckpointNotFoundError(f"{type(self).__name__} has no path: pass checkpoint_id=, or {type(self).__name__}(path)")
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return _is_local_path(checkpoint_id)


class FileSystemWriter(_AtPath, BlobStorageWriter):
    """Writes a checkpoint into a directory: one safetensors data file per rank, plus metadata.json.

    Args:
        path: the checkpoint directory (may also be given as ``checkpoint_id``).
        sync_files: fsync data files, metadata and the directory (default: the DISTCKPT_FSYNC knob).
        thread_count: writer threads per rank (default: the DISTCKPT_IO_THREADS knob).
        overwrite: replace a committed checkpoint at ``path``; the old one stays
            intact until the new one commits. Off by default: saving over a
            committed checkpoint raises (unless DISTCKPT_OVERWRITE=1, DCP's behaviour).
        single_file_per_rank, per_thread_copy_ahead, cache_staged_state_dict,
            serialization_format: DCP's layout and staging options, accepted so
            code written for it runs; they change nothing here (one safetensors
            file per rank, I/O batching by DISTCKPT_IO_BATCH_BYTES, async_save
            keeps its staging buffers anyway).
        _extensions: stream transforms (DCP's name and protocol): every item is
            written through them, e.g. ``[distckpt.ZStandard()]`` compresses. Such
            items are encoded whole, their CRC-32C covers the stored bytes, and
            loads decode them through a buffer instead of reading in place; the
            metadata records them (format 2.1), so a reader needs no option unless
            an extension is not one distckpt knows (then ``_extension_registry=``).
        compression, compression_level: byte-grouped zstd of every chunk, as
            :class:`~distckpt.backends.blob_storage.BlobStorageWriter` says.

    The save writes into a hidden sibling directory ``.distckpt-tmp-<name in hex>-<save id>``
    and the coordinator renames it into place after fsync: a reader sees the
    whole checkpoint or none of it.
    """

    def __init__(self, path: Union[str, os.PathLike, None] = None, sync_files: bool | None = None,
                 thread_count: int | None = None, overwrite: Optional[bool] = None, *,
                 single_file_per_rank: bool = True, per_thread_copy_ahead: int = 0,
                 cache_staged_state_dict: bool = False, serialization_format: Any = None,
                 _extensions: Optional[Iterable[Any]] = None, compression: Optional[str] = None,
                 compression_level: Optional[int] = None):
        super().__init__(path, sync_files=sync_files, thread_count=thread_count, overwrite=overwrite,
                         compression=compression, compression_level=compression_level)
        extensions = list(_extensions or ())
        for ext in extensions:
            if not all(callable(getattr(ext, m, None)) for m in ("transform_to", "transform_from", "get_descriptor")):
                raise CheckpointError(
                    f"FileSystemWriter({str(path)!r}): extension {type(ext).__name__} is not a stream transform "
                    "(it needs transform_to, transform_from and get_descriptor, as distckpt.StreamTransformExtension)")
        if extensions and compression is not None:
            raise CheckpointError(f"FileSystemWriter({str(path)!r}): pass compression= or _extensions=, not both")
        if extensions:
            self.chunk_codec = StreamTransforms(extensions)

    def open_store(self, checkpoint_id: str) -> BlobStore:
        return fs_store(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        if is_coordinator:
            check_save_target(self._require_path())
            check_target(os.path.abspath(self._require_path()), self._replaces())


class FileSystemReader(_AtPath, BlobStorageReader):
    """Reads a checkpoint directory written by :class:`FileSystemWriter`.

    Args:
        path: the checkpoint directory (may also be given as ``checkpoint_id``).
        verify_checksums: check the CRC-32C of every item read (default True).
        thread_count: reader threads per rank (default: the DISTCKPT_IO_THREADS knob).
        shared_reads: as :class:`~distckpt.backends.BlobStorageReader`'s (default: DISTCKPT_SHARED_READS, on).
        _extension_registry: rebuilds the stream transforms items were written
            through, from the descriptors the metadata records (DCP's name; an
            :class:`~distckpt.ExtensionRegistry` or DCP's). The default one knows
            :class:`~distckpt.ZStandard`.
    """

    def __init__(self, path: Union[str, os.PathLike, None] = None, verify_checksums: bool = True, thread_count: int | None = None,
                 *, _extension_registry: Any = None, shared_reads: Optional[bool] = None):
        super().__init__(path, verify_checksums=verify_checksums, thread_count=thread_count, shared_reads=shared_reads)
        self.extension_registry = _extension_registry

    def open_store(self, checkpoint_id: str) -> BlobStore:
        store = fs_store(checkpoint_id)
        if is_dcp_directory(checkpoint_id):
            raise CheckpointError(
                f"checkpoint {checkpoint_id!r} was written by torch.distributed.checkpoint; load it with "
                "checkpoint_id=path (no storage_reader), or storage_reader=distckpt.DCPReader(path)")
        if not os.path.isdir(checkpoint_id):
            pending = store.incomplete_saves()
            if pending:
                raise CheckpointNotFoundError(
                    f"checkpoint {checkpoint_id!r} is incomplete: its save never committed (uncommitted data in "
                    f"{pending[0]!r}). Load an earlier checkpoint.")
            raise CheckpointNotFoundError(f"checkpoint {checkpoint_id!r} does not exist (no such directory); check the path")
        return store


register_store("file", fs_store, writer=FileSystemWriter, reader=FileSystemReader)
