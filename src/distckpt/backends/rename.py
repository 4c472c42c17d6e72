"""Atomic directory renames: renameat2(2) with RENAME_NOREPLACE / RENAME_EXCHANGE where the
kernel and filesystem have it, plain rename(2) otherwise."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2

try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    _renameat2 = getattr(_libc, "renameat2", None)
except OSError:  # pragma: no cover - no libc (not Linux)
    _renameat2 = None


def _call(src: str, dst: str, flags: int) -> bool:
    """True if renameat2 did it; False if it is unavailable here."""
    if _renameat2 is None:
        return False
    rc = _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err), dst)


def rename_noreplace(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst``; fail with EEXIST if ``dst`` exists."""
    if _call(src, dst, _RENAME_NOREPLACE):
        return
    if os.path.lexists(dst):
        raise OSError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
    os.rename(src, dst)


def exchange(a: str, b: str) -> None:
    """Swap two existing paths atomically where possible.

    Without RENAME_EXCHANGE this falls back to two renames, with a moment in
    which ``b`` does not exist; the old content survives under ``a``'s name.
    """
    if _call(a, b, _RENAME_EXCHANGE):
        return
    aside = a + ".swap"
    os.rename(b, aside)
    os.rename(a, b)
    os.rename(aside, a)


def rename_noreplace_at(sfd: int, sname: str, dfd: int, dname: str) -> None:
    """``rename_noreplace`` between entries of two directory descriptors (no path is resolved again); EEXIST if
    ``dname`` exists."""
    if _renameat2 is not None:
        if _renameat2(sfd, os.fsencode(sname), dfd, os.fsencode(dname), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(err, os.strerror(err), dname)
    try:
        os.lstat(dname, dir_fd=dfd)
    except FileNotFoundError:
        os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)
        return
    raise OSError(errno.EEXIST, os.strerror(errno.EEXIST), dname)
