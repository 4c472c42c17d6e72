"""Local directories reached through descriptors: one component at a time with ``openat(O_NOFOLLOW)``, so that
no link is followed unseen, and names then used relative to the descriptor reached."""

from __future__ import annotations

import contextlib
import errno
import os
import stat

from ...errors import NotRegularFileError, UnsafeLocationError

CLOEXEC = getattr(os, "O_CLOEXEC", 0)
DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | CLOEXEC
_MAX_LINKS = 40  # as the kernel's own limit on links followed in one path


def not_own_dir(path: str) -> NotRegularFileError:
    return NotRegularFileError(f"{path} is not a directory of its own (a link); distckpt never writes or reads through a "
                               "link at a checkpoint's directory")


def walk_dir(path: str, *, create: bool = False, follow_last: bool = False) -> int:
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
    fd = os.open("/", DIR_FLAGS)
    try:
        while todo:
            part = todo.pop()
            if part == ".":
                continue
            last = not todo
            try:
                nfd = os.open(part, DIR_FLAGS, dir_fd=fd)
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
                    raise not_own_dir(path) from None
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
                    nfd = os.open("/", DIR_FLAGS)
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



def is_dir_at(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(name, dir_fd=dir_fd).st_mode)
    except FileNotFoundError:
        return False


def unlink_regular(name: str, dir_fd: int) -> None:
    try:
        if stat.S_ISREG(os.lstat(name, dir_fd=dir_fd).st_mode):
            os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
