"""The local-disk side: real files and directories, every directory reached through :func:`walk_dir`."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import uuid
from typing import Optional

from ... import faults
from ...backends.filesystem import FileReader, FsStore
from ...backends.fs_objects import clear_dir, is_real_dir, open_regular, rmdir_at
from ...backends.rename import rename_noreplace_at
from ...engine.blobs import BlobReader
from ...errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, NotRegularFileError, StorageIOError
from .checksums import BlockCrcs, ChecksummingWriter
from .dirfd import CLOEXEC, DIR_FLAGS, is_dir_at, not_own_dir, unlink_regular, walk_dir
from .paths import CRC_SUFFIX, PART_MARK, is_hidden, occupied, sidecar_name, split_url
from .settings import Settings


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


class LocalNamespace:
    """Real files and directories, each file created exclusively under a hidden name and renamed into place.

    Every directory is reached through :func:`walk_dir` (no link followed unseen, none another user owns), and every
    name in it is then used relative to that descriptor."""

    def __init__(self, config: Settings):
        self.config = config

    def _dir_fd(self, path: str) -> int:
        return walk_dir(path)

    def create(self, url: str) -> ChecksummingWriter:
        parent, name = split_url(url)
        try:
            fd = self._dir_fd(parent)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"{parent} does not exist; mkdir it first", parent) from None
        try:
            if is_dir_at(name, fd):
                raise IsADirectoryError(errno.EISDIR, f"{url} is a directory", url)
        finally:
            os.close(fd)
        part = f".{name}{PART_MARK}{uuid.uuid4().hex}"
        blob = FsStore(parent).create(part)
        sync = self.config.sync
        side, sidecar = f"{part}{CRC_SUFFIX}", sidecar_name(name)

        def finish(crcs: Optional[BlockCrcs]) -> None:
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
                    unlink_regular(part, fd)
                    return
                blob.close(sync)
                self._write_small(fd, side, crcs.encode())
                if is_dir_at(name, fd):  # checked before anything is replaced
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
                    unlink_regular(sidecar, fd)  # the checksums of a file that is not there
                    if exc.errno == errno.EISDIR:
                        raise IsADirectoryError(errno.EISDIR, f"{url} is a directory", url) from None
                    raise
                placed = inode
                if sync:
                    os.fsync(fd)
            except BaseException as exc:
                for leftover in (part, side):
                    with contextlib.suppress(OSError):
                        unlink_regular(leftover, fd)
                with contextlib.suppress(OSError):
                    if placed is not None and os.lstat(name, dir_fd=fd).st_ino == placed:
                        os.unlink(name, dir_fd=fd)  # a close that raises leaves no file behind
                        unlink_regular(sidecar, fd)
                named = _named(exc, url)
                if named is exc:
                    raise
                raise named from exc
            finally:
                os.close(fd)

        return ChecksummingWriter(blob, self.config.block_bytes, url, finish)

    def _write_small(self, dir_fd: int, name: str, data: bytes) -> None:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | CLOEXEC, 0o644, dir_fd=dir_fd)
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
        parent, name = split_url(url)
        fd = self._dir_fd(parent)
        try:
            try:
                blob = FileReader(url, open_regular(name, dir_fd=fd))
            except CheckpointNotFoundError:
                raise FileNotFoundError(errno.ENOENT, f"{url} does not exist", url) from None
            try:
                return blob, self._read_small(fd, sidecar_name(name), url + " (its checksums)")
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
        parent, name = split_url(url)
        fd = walk_dir(parent, create=recursive)
        try:
            try:
                os.mkdir(name, 0o777, dir_fd=fd)
            except FileExistsError:
                mode = os.lstat(name, dir_fd=fd).st_mode
                if stat.S_ISLNK(mode):
                    raise not_own_dir(url) from None
                if not recursive or not stat.S_ISDIR(mode):
                    raise FileExistsError(errno.EEXIST, f"{url} exists" + ("" if stat.S_ISDIR(mode) else " and is not a directory"),
                                          url) from None
        finally:
            os.close(fd)

    def ls(self, url: str) -> list[str]:
        fd = walk_dir(url, follow_last=True)
        try:
            return sorted(n for n in os.listdir(fd) if not is_hidden(n))
        finally:
            os.close(fd)

    def delete(self, url: str) -> None:
        parent, name = split_url(url)
        fd = self._dir_fd(parent)
        try:
            mode = os.lstat(name, dir_fd=fd).st_mode
            if not stat.S_ISREG(mode):
                raise NotRegularFileError(f"{url} is not a regular file; distckpt deletes only files it wrote")
            os.unlink(name, dir_fd=fd)
            unlink_regular(sidecar_name(name), fd)
        finally:
            os.close(fd)

    def rmdir(self, url: str) -> None:
        parent, name = split_url(url)
        pfd = self._dir_fd(parent)
        try:
            try:
                fd = os.open(name, DIR_FLAGS, dir_fd=pfd)
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
        sparent, sname = split_url(src)
        dparent, dname = split_url(dst)
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
            raise occupied(src, dst, errno.ENOTDIR)
        sname, dname = split_url(src)[1], split_url(dst)[1]
        try:
            if dst_mode is None:
                rename_noreplace_at(sfd, sname, dfd, dname)
            else:  # replaces an empty directory atomically, refuses a populated one
                os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise occupied(src, dst, exc.errno) from None
            raise OSError(exc.errno, f"cannot rename {src} to {dst}: {exc.strerror}") from None

    def _rename_file(self, src: str, dst: str, dst_mode: Optional[int], sfd: int, dfd: int) -> None:
        if dst_mode is not None and stat.S_ISDIR(dst_mode):
            raise occupied(src, dst, errno.EISDIR)
        if dst_mode is not None and not stat.S_ISREG(dst_mode):
            raise occupied(src, dst, errno.EEXIST)  # a link or a device: not a file to replace
        sname, dname = split_url(src)[1], split_url(dst)[1]
        try:
            os.lstat(sidecar_name(sname), dir_fd=sfd)
        except FileNotFoundError:
            unlink_regular(sidecar_name(dname), dfd)
        else:
            os.replace(sidecar_name(sname), sidecar_name(dname), src_dir_fd=sfd, dst_dir_fd=dfd)
        os.replace(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)
