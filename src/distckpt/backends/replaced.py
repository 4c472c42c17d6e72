"""What a save may replace at its path, and how the replaced checkpoint's other files are kept.

A save commits by putting its directory in place atomically. The path must be free, an empty directory, or a
committed checkpoint: distckpt's own, or one torch.distributed.checkpoint wrote (DCP's replace-on-save, for code
that switches to distckpt and saves where DCP saved before). What the replaced checkpoint held besides its own
files (a user's notes, a framework's files) is carried into the new one; nothing is followed through a link.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from typing import Optional

from .. import knobs
from ..errors import CheckpointError
from ..format import METADATA_FILE
from ..format.codec import StoredFiles, stored_files
from .fs_objects import is_real_dir, open_dir, open_regular
from .rename import rename_noreplace

__all__ = ["carry_foreign", "dcp_checkpoint_files", "holds_committed_metadata", "unreadable_metadata", "check_target",
           "DCP_METADATA_FILE"]

log = logging.getLogger("distckpt")


def carry_foreign(old: str, new: str) -> bool:
    """Move what the replaced checkpoint at ``old`` holds but does not list (a user's notes, another tool's
    files) into the checkpoint that replaced it at ``new``; return whether ``old`` is left holding only
    the replaced checkpoint's own files. What cannot move (its name is taken) stays in ``old``, which is
    then kept. A replaced checkpoint of DCP's lists its ``.metadata`` and ``__<rank>_<n>.distcp`` files, when
    they are regular files: anything else, links included, is carried."""
    if not os.path.lexists(os.path.join(old, METADATA_FILE)) and os.path.lexists(os.path.join(old, DCP_METADATA_FILE)):
        try:
            listed = set(_dcp_names(old))
        except OSError:
            log.warning("distckpt: the replaced DCP checkpoint at %s cannot be listed; left in place", old)
            return False
    else:
        files = _committed_files(old)
        if files is None:
            log.warning("distckpt: the replaced checkpoint's metadata at %s is unreadable; left in place", old)
            return False
        listed = set(files.own) | {METADATA_FILE}
    kept = []
    for name in os.listdir(old):
        if name in listed:
            continue
        try:
            rename_noreplace(os.path.join(old, name), os.path.join(new, name))
        except OSError:
            kept.append(name)
    if kept:
        log.warning("distckpt: the replaced checkpoint left in %s: %s could not move into %s", old, ", ".join(kept[:5]), new)
    return not kept


DCP_METADATA_FILE = ".metadata"
_DCP_DATA_FILE = re.compile(r"__\d+_\d+\.distcp\Z")  # DCP's FileSystemWriter: __<rank>_<file index>.distcp


def _dcp_names(directory: str) -> list[str]:
    """The entries of ``directory`` named as DCP names its checkpoint's files that are regular files (not links)."""
    fd = open_dir(directory)
    try:
        return [name for name in os.listdir(fd)
                if (name == DCP_METADATA_FILE or _DCP_DATA_FILE.match(name))
                and stat.S_ISREG(os.lstat(name, dir_fd=fd).st_mode)]
    finally:
        os.close(fd)


def dcp_checkpoint_files(directory: str) -> Optional[list[str]]:
    """The files of a committed checkpoint torch.distributed.checkpoint wrote at ``directory``: a real directory
    holding a regular ``.metadata`` that is a pickle (as DCP writes it), whose entries named as DCP names its files
    (``.metadata``, ``__<rank>_<n>.distcp``) are all regular files, and whose other entries are regular files (a
    framework's beside DCP's, as Lightning's ``meta.pt``: a replacing save carries them into the new checkpoint).
    None otherwise: a link or subdirectory anywhere (not followed), or no ``.metadata`` (a DCP save that never
    finished)."""
    if not is_real_dir(directory):
        return None
    try:
        fd = open_dir(directory)
        try:
            names = sorted(os.listdir(fd))
            if DCP_METADATA_FILE not in names or not all(stat.S_ISREG(os.lstat(n, dir_fd=fd).st_mode) for n in names):
                return None
        finally:
            os.close(fd)
        fd = open_regular(os.path.join(directory, DCP_METADATA_FILE))
        try:
            if os.pread(fd, 1, 0) != b"\x80":  # pickle's PROTO opcode: DCP pickles its metadata
                return None
        finally:
            os.close(fd)
    except (CheckpointError, OSError):
        return None
    return names


def _committed_files(directory: str) -> Optional[StoredFiles]:
    """The files the regular metadata.json of distckpt in ``directory`` lists, as the loader parses it; None where
    there is none, or it is not distckpt's, damaged, or of a version this release does not read."""
    return _read_committed(directory)[0]


def _read_committed(directory: str) -> tuple[Optional[StoredFiles], Optional[str]]:
    """(files, None) of the metadata.json in ``directory``; (None, why) where it cannot be read as distckpt's."""
    try:
        fd = open_regular(os.path.join(directory, METADATA_FILE))
    except (CheckpointError, OSError) as exc:
        return None, str(exc)
    try:
        size = os.fstat(fd).st_size
        if size > knobs.max_metadata_bytes():
            return None, f"{METADATA_FILE} is {size} bytes, over DISTCKPT_MAX_METADATA_BYTES"
        files = stored_files(os.pread(fd, size, 0), os.path.join(directory, METADATA_FILE))
        return files, None if files is not None else f"{METADATA_FILE} is not distckpt's own file table"
    except (CheckpointError, OSError) as exc:
        return None, str(exc)
    finally:
        os.close(fd)


def unreadable_metadata(directory: str) -> Optional[str]:
    """Why the metadata.json that ``directory`` holds cannot be read as a committed distckpt checkpoint; None where
    it has none, or it reads."""
    if not os.path.lexists(os.path.join(directory, METADATA_FILE)):
        return None
    return _read_committed(directory)[1]


def holds_committed_metadata(directory: str) -> bool:
    """Whether ``directory`` holds a committed checkpoint of distckpt: a regular metadata.json that the loader's
    parsers read as distckpt's, listing its data files."""
    return _committed_files(directory) is not None


def check_target(final: str, replaces: bool) -> None:
    """A save commits by renaming its directory into place: the path must be free, an empty directory, or a
    committed checkpoint (to replace): distckpt's, or one torch.distributed.checkpoint wrote (``replaces``
    only: DCP's replace-on-save, for code that switches to distckpt and saves where DCP saved before).
    Anything else is refused before a byte is written."""
    if not os.path.lexists(final) or (is_real_dir(final) and holds_committed_metadata(final)):
        return
    dcp_files = dcp_checkpoint_files(final)
    if dcp_files is not None:
        if replaces:
            return
        raise CheckpointError(
            f"cannot save to {final!r}: it holds a committed checkpoint torch.distributed.checkpoint wrote "
            f"({len(dcp_files)} files: .metadata, its .distcp files and any beside them), and distckpt does not replace a committed "
            "checkpoint unless asked. Pass overwrite=True to the storage writer (or route_dcp_calls(overwrite=True), "
            "or set DISTCKPT_OVERWRITE=1) to replace it atomically, or save to a new path.")
    if not is_real_dir(final):
        raise CheckpointError(f"cannot save to {final!r}: it exists and is not a directory (a file or a link); "
                              "save to another path")
    names = sorted(os.listdir(final))
    if names:
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise CheckpointError(
            f"cannot save to {final!r}: the directory holds files that are not a distckpt checkpoint ({shown}). "
            "A save commits atomically by putting a whole directory in place, and never mixes its files with "
            "others; save to a new or empty directory, such as a subdirectory of this one.")
