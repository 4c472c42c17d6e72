"""The one place where distckpt decides which file system objects it will open, create or delete.

Only regular files and real directories are ever read, written or removed.
A symbolic link, FIFO, socket or device node where a checkpoint expects a
file is refused: links are never followed (``O_NOFOLLOW``, and removal
through directory descriptors, never through path names that a link could
redirect), and nothing is opened that could block (a FIFO) or be something
else than bytes at rest. Checks happen on the opened descriptor (``fstat``),
never on the path before opening it, so a file swapped between a check and
the open cannot slip through.

Files distckpt creates are created exclusively (``O_CREAT | O_EXCL |
O_NOFOLLOW``): anything already at the name, a planted link among them, makes
the create fail instead of being written through.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from typing import Optional

from .. import faults
from ..errors import CheckpointNotFoundError, NotRegularFileError, UnsafeLocationError

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)

log = logging.getLogger("distckpt")


def kind(mode: int) -> str:
    """What a ``st_mode`` is, in words."""
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def _refuse(path: str, what: str) -> NotRegularFileError:
    return NotRegularFileError(
        f"{path} is {what}; distckpt reads and deletes only regular files and directories it finds in a checkpoint, "
        "and never follows links. Replace it with the regular file the checkpoint expects.")


def open_regular(path: str, *, dir_fd: Optional[int] = None) -> int:
    """Open the regular file ``path`` for reading; refuse anything else without blocking on it.

    Raises CheckpointNotFoundError if nothing is there, NotRegularFileError if
    something other than a regular file is (a symbolic link included), and
    OSError for other failures.
    """
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path} does not exist; the checkpoint is incomplete or damaged") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse(path, "a symbolic link") from None
        if exc.errno == errno.ENXIO:  # a socket, or a device with no driver
            raise _refuse(path, "a socket or device node") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _refuse(path, kind(mode))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_exclusive(path: str, extra_flags: int = 0, mode: int = 0o644) -> int:
    """Create the new regular file ``path`` for writing; fail (FileExistsError) if anything is there, a link included."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC | extra_flags, mode)


def is_real_dir(path: str) -> bool:
    """Whether ``path`` is a directory itself, not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def open_dir(path: str) -> int:
    """A descriptor of the directory ``path``, which must not be a link."""
    return os.open(path, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC)


def remove_tree(path: str) -> list[str]:
    """Delete the directory ``path`` and what it holds: regular files and directories only.

    ``path`` itself must be a real directory (a link there is left alone), and
    every entry is removed through its directory's descriptor, so no link, at
    any depth or swapped in meanwhile, leads the removal outside the tree.
    Anything else found inside (a link, FIFO, socket or device) is left in
    place, and with it the directories that hold it; what was left is
    returned. Entries removed concurrently by another process are no error.
    """
    left: list[str] = []
    try:
        fd = open_dir(path)
    except FileNotFoundError:
        return left
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            log.warning("distckpt: %s is not a directory (a link or a file); left in place", path)
            return [path]
        raise
    try:
        clear_dir(fd, path, left)
    finally:
        os.close(fd)
    if not left:
        faults.point("unlink", path)
        rmdir_at(path, None, left)
    else:
        log.warning("distckpt: left %s in place: %s not created by distckpt", path, ", ".join(left[:5]))
    return left


def clear_dir(fd: int, path: str, left: list[str]) -> None:
    """Remove what the directory open as ``fd`` holds, through descriptors only; what is not a regular file or a
    directory (a link, FIFO, socket or device) is left in place and its path added to ``left``."""
    for entry in os.scandir(fd):
        name = entry.name
        where = os.path.join(path, name)
        try:
            mode = os.lstat(name, dir_fd=fd).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(mode):
            try:
                sub = os.open(name, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=fd)
            except FileNotFoundError:
                continue
            try:
                if not stat.S_ISDIR(os.fstat(sub).st_mode):
                    left.append(where)
                    continue
                before = len(left)
                clear_dir(sub, where, left)
            finally:
                os.close(sub)
            if len(left) == before:
                faults.point("unlink", where)
                rmdir_at(name, fd, left, where)
        elif stat.S_ISREG(mode):
            faults.point("unlink", where)
            try:
                os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                pass
        else:
            left.append(where)


def prune_dir(path: str, keep: set) -> bool:
    """Remove the regular files of the real directory ``path`` not named in ``keep``, through its descriptor, and the
    directory itself once nothing is left in it; anything else in it (a link, a directory) stays. Returns whether the
    directory is gone."""
    try:
        fd = open_dir(path)
    except FileNotFoundError:
        return True
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            return False  # a link or a file where a directory of ours was: not ours
        raise
    try:
        for entry in os.scandir(fd):
            if entry.name in keep:
                continue
            try:
                mode = os.lstat(entry.name, dir_fd=fd).st_mode
            except FileNotFoundError:
                continue
            if stat.S_ISREG(mode):
                faults.point("unlink", os.path.join(path, entry.name))
                try:
                    os.unlink(entry.name, dir_fd=fd)
                except FileNotFoundError:
                    pass
        empty = not any(True for _ in os.scandir(fd))
    finally:
        os.close(fd)
    if empty:
        left: list[str] = []
        rmdir_at(path, None, left)
        return not left
    return False


def rmdir_at(name: str, dir_fd: Optional[int], left: list[str], where: str = "") -> None:
    """Remove the empty directory ``name`` of ``dir_fd``; one that is not empty (something left in it) is added to ``left``."""
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        left.append(where or name)  # something is writing into it: not ours to race


def private_dir(path: str) -> str:
    """Make ``path`` (with its missing parents, mode 0700) or accept it, as a directory no other user can change;
    return its absolute path. The way ssh treats a key file's folders:

    - every existing ancestor is owned by root or this user, and one that others may write to is sticky (``/tmp``,
      ``/dev/shm``: there only a name's owner can replace it);
    - a link on the way is followed only where root or this user owns it (in a sticky folder nobody else can
      replace it); one that another user planted is refused;
    - ``path`` itself is a real directory, owned by this user and writable by nobody else.

    Raises UnsafeLocationError, naming the component and the fix, where any of these fails.
    """
    me = os.geteuid()
    path = os.path.abspath(path)
    current = "/"
    parts = [p for p in path.split(os.sep) if p]
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        nxt = os.path.join(current, part)
        try:
            st = os.lstat(nxt)
        except FileNotFoundError:
            try:
                os.mkdir(nxt, 0o700)
            except FileExistsError:
                pass
            st = os.lstat(nxt)
        if stat.S_ISLNK(st.st_mode):
            if last:
                raise UnsafeLocationError(f"{nxt} is a symbolic link; a tier directory must be a real directory of "
                                          "its own (a link there could send its files anywhere). Remove the link, "
                                          "or choose another directory")
            if st.st_uid not in (0, me):
                raise UnsafeLocationError(f"{nxt} is a symbolic link owned by uid {st.st_uid}, not by root or this "
                                          f"user (uid {me}): another user may have planted it. Remove it, or choose "
                                          "another directory")
            nxt = os.path.realpath(nxt)
            st = os.stat(nxt)
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafeLocationError(f"{nxt} is {kind(st.st_mode)}, not a directory; choose another directory")
        if st.st_uid not in ((me,) if last else (0, me)):
            raise UnsafeLocationError(f"{nxt} is owned by uid {st.st_uid}; distckpt keeps its files only in directories "
                                      f"owned by this user (uid {me}){'' if last else ' or root'}. Choose another "
                                      "directory")
        if st.st_mode & 0o022 and (last or not st.st_mode & stat.S_ISVTX):
            raise UnsafeLocationError(f"{nxt} can be written by other users (mode {stat.S_IMODE(st.st_mode):o}); "
                                      f"{'run chmod go-w on it' if last else 'make it sticky or chmod go-w it'}, or "
                                      "choose another directory")
        current = nxt
    return current
