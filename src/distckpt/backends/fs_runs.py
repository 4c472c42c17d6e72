"""The parts of a directory store that concern its neighbours: hidden siblings (a save's staging directory, its
lease, a retired step's kept files), and a directory as the root of a run of checkpoints (children, deletion,
retirement, cleanup of what crashed saves and deletions left).

:class:`RunParts` is mixed into :class:`~distckpt.backends.filesystem.FsStore`, which provides ``root``.
"""

from __future__ import annotations

import errno
import os
import time
import uuid
from typing import Optional

from .. import faults
from ..engine.blobs import BlobStore, Keep, keep_now
from ..engine.references import UNKNOWN, SaveFiles, committed_files, referenced_by_siblings
from ..errors import CheckpointError, CheckpointNotFoundError, StorageIOError
from .direct_io import pwrite_all
from .fs_objects import create_exclusive, is_real_dir, open_regular, prune_dir, remove_tree
from .leases import save_is_dead
from .replaced import carry_foreign
from .run_guard import deleting

__all__ = ["RunParts", "hidden_name", "parse_hidden", "TMP_MARK", "LEASE_MARK", "RETIRED_MARK", "TRASH"]

TMP_MARK = ".distckpt-tmp-"
LEASE_MARK = ".distckpt-lease-"
RETIRED_MARK = ".distckpt-retired-"  # a deleted step's data files that kept steps still reference, under its save id
TRASH = "trash-"
# Hidden siblings are named ".distckpt-tmp-<name in hex>-<tag>" (and "-lease-"): the checkpoint's own name
# never appears in them, so no tool's pattern for its steps ("step-(\d+)") matches a save in progress.
# Names too long for that keep the older form ".<name>.distckpt-tmp-<tag>", which is also still recognised.
_HEX_NAME_MAX = 100
_LEASE_MAX_BYTES = 4096


def _io_error(action: str, path: str, exc: OSError) -> StorageIOError:
    hint = ""
    if exc.errno == errno.ENOSPC:
        hint = "; free disk space or save elsewhere"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        hint = "; check the directory's permissions"
    return StorageIOError(f"{action} {path} failed: {exc.strerror or exc}{hint}", exc.errno)


class RunParts:
    """A directory store's siblings and children (mixed into FsStore, which has ``root``)."""

    root: str

    def _sibling(self, tag: str, mark: str = TMP_MARK) -> str:
        parent, base = os.path.split(os.path.abspath(self.root))
        return os.path.join(parent, hidden_name(base, mark, tag))

    def _drop_replaced(self, old: str) -> None:
        """Remove the checkpoint this one replaced (now at ``old``), or retire it where later steps of its run reference
        its files (format 4.0): they stay where ``referenced`` finds them."""
        save_id = _committed_save_id(type(self)(old, follow_root=False))
        if save_id is None:  # no document names its save: no reference can name it either
            remove_tree(old)
            return
        with deleting(self.parent()) as guard:
            keep: Optional[set] = None  # with a save in flight that may come to reference any of it: the next deleter decides
            if not guard.savers_live():  # looked for first: a save it does not see commits after its record (run_guard.py)
                keep = referenced_by_siblings(self.parent(), os.path.basename(os.path.abspath(self.root)), save_id)
            if keep == set():
                remove_tree(old)
                return
            retired = self._sibling(save_id, RETIRED_MARK)
            os.rename(old, retired)
            if keep is not None:  # None: a sibling's metadata could not be read; everything stays until cleanup knows
                prune_dir(retired, keep)

    def _lease_path(self, save_id: str) -> str:
        parent, base = os.path.split(os.path.abspath(self.root))
        return os.path.join(parent, hidden_name(base, LEASE_MARK, save_id))

    def put_lease(self, save_id: str, record: bytes) -> None:
        path = self._lease_path(save_id)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)  # the checkpoint's parent, as the save would make it
            fd = create_exclusive(path)
            try:
                pwrite_all(fd, [memoryview(record)], 0)
            except BaseException:
                os.unlink(path)  # ours, just made: a record half written is no record (a full disk)
                raise
            finally:
                os.close(fd)
        except OSError as exc:
            raise _io_error("creating the lease", path, exc) from exc

    def renew_lease(self, save_id: str) -> None:
        os.utime(self._lease_path(save_id), follow_symlinks=False)

    def read_lease(self, save_id: str) -> Optional[tuple[bytes, Optional[float]]]:
        try:
            fd = open_regular(self._lease_path(save_id))
        except (CheckpointNotFoundError, FileNotFoundError):
            return None
        except (CheckpointError, OSError):
            return b"", None  # not a lease distckpt wrote: nobody is proven dead by it
        try:
            return os.pread(fd, _LEASE_MAX_BYTES, 0), max(0.0, time.time() - os.fstat(fd).st_mtime)
        finally:
            os.close(fd)

    def drop_lease(self, save_id: str) -> None:
        try:
            os.unlink(self._lease_path(save_id))
        except FileNotFoundError:
            pass

    def lease_ids(self) -> list[str]:
        parent, base = os.path.split(os.path.abspath(self.root))
        try:
            names = os.listdir(parent)
        except FileNotFoundError:
            return []
        found = (_lease_of(name) for name in names)
        return sorted(tag for checkpoint, tag in found if checkpoint == base)

    def parent(self) -> "RunParts":
        return type(self)(os.path.dirname(os.path.abspath(self.root)))

    def incomplete_saves(self) -> list[str]:
        parent, base = os.path.split(os.path.abspath(self.root))
        try:
            names = os.listdir(parent)
        except FileNotFoundError:
            return []
        return sorted(os.path.join(parent, n) for n in names if (parse_hidden(n) or ("", "", ""))[:2] == (base, TMP_MARK))

    def child(self, name: str) -> "RunParts":
        return type(self)(os.path.join(self.root, name))

    def children(self) -> list[str]:
        """Real directories only: a link to a checkpoint elsewhere is not a checkpoint of this run."""
        try:
            return sorted(n for n in os.listdir(self.root) if not n.startswith(".") and is_real_dir(os.path.join(self.root, n)))
        except FileNotFoundError:
            return []

    def remove(self) -> None:
        """Delete this committed checkpoint; one already gone (another process deleted it) is no error."""
        if not is_real_dir(self.root):
            return  # gone, or a link: never followed, never deleted
        hidden = self._sibling(TRASH + uuid.uuid4().hex)
        try:
            faults.point("rename", self.root)
            os.rename(self.root, hidden)  # atomic: the checkpoint disappears whole
        except FileNotFoundError:
            return
        except OSError as exc:
            raise _io_error("deleting", self.root, exc) from exc
        remove_tree(hidden)

    def referenced(self, checkpoint: str, save_id: str) -> BlobStore:
        parent = os.path.dirname(os.path.abspath(self.root))
        places = [type(self)(os.path.join(parent, checkpoint), follow_root=False),
                  type(self)(os.path.join(parent, hidden_name(checkpoint, RETIRED_MARK, save_id)), follow_root=False)]
        return SaveFiles(places, save_id, f"{os.path.join(parent, checkpoint)} (save {save_id})")

    def retire(self, save_id: str, keep: set) -> None:
        if not is_real_dir(self.root):
            return  # gone, or a link: never followed, never deleted
        retired = self._sibling(save_id, RETIRED_MARK)
        try:
            faults.point("rename", self.root)
            os.rename(self.root, retired)  # atomic: the step disappears whole; what it keeps is found under its save id
        except FileNotFoundError:
            return
        except OSError as exc:
            raise _io_error("deleting", self.root, exc) from exc
        prune_dir(retired, set(keep))

    def remove_incomplete_below(self, prefix: str = "", keep: Keep = None) -> list[str]:
        removed = []
        try:
            names = sorted(os.listdir(self.root))
        except FileNotFoundError:
            return removed
        if any((parse_hidden(n) or ("", "", ""))[1] == RETIRED_MARK for n in names):
            keep = keep_now(keep)  # the mark, read after the listing: a step retired since is not in it
        else:
            keep = None
        now = time.time()
        for name in names:
            parsed = parse_hidden(name)
            if parsed is None or not parsed[0].startswith(prefix):
                continue
            base, mark, tag = parsed
            path = os.path.join(self.root, name)
            if mark == RETIRED_MARK:
                if keep is not None and prune_dir(path, set(keep.get((base, tag), ()))):
                    removed.append(path)
            elif mark == TMP_MARK:
                if not tag.startswith(TRASH):  # a deletion left half done: anyone may finish it
                    if not save_is_dead(self.child(base), tag, _age(path, now)):
                        continue
                    if _holds_replaced(type(self)(path, follow_root=False)):  # an overwrite killed between its swap and its retire
                        if carry_foreign(path, self.child(base).root):  # what a user kept in it goes on with the step
                            self.child(base)._drop_replaced(path)
                            self.child(base).drop_lease(tag)
                            removed.append(path)
                        continue
                if not remove_tree(path):
                    removed.append(path)
                    self.child(base).drop_lease(tag)
            else:  # a lease whose save's staging area is gone
                staging = self.child(base)._sibling(tag)
                if not os.path.lexists(staging) and save_is_dead(self.child(base), tag, None):
                    self.child(base).drop_lease(tag)
        return removed


def _lease_of(name: str) -> tuple[str, str]:
    """(checkpoint, save id) of a lease's file name; empty strings for any other name."""
    parsed = parse_hidden(name)
    return (parsed[0], parsed[2]) if parsed is not None and parsed[1] == LEASE_MARK else ("", "")


def _holds_replaced(staging: "RunParts") -> bool:
    """Whether the staging directory ``staging`` of a save holds the committed checkpoint that save
    replaced (an overwrite exchanges the two; its metadata names another save than the directory's name): it is then
    dropped as the overwrite would have, kept where later steps of the run reference its files (format 4.0)."""
    parsed = parse_hidden(os.path.basename(staging.root))
    save_id = _committed_save_id(staging)
    return parsed is not None and save_id is not None and save_id != parsed[2]


def _committed_save_id(directory: BlobStore) -> Optional[str]:
    """The save id the metadata document in ``directory`` names, or None (none there, unreadable, not distckpt's)."""
    _, files = committed_files(directory)
    return None if files is None or files is UNKNOWN else files.save_id


def hidden_name(base: str, mark: str, tag: str) -> str:
    """The name of a hidden sibling of checkpoint ``base``: its staging area, lease or retired files (``mark``) for ``tag``."""
    encoded = base.encode("utf-8").hex()
    if len(base.encode("utf-8")) > _HEX_NAME_MAX:
        return f".{base}{mark}{tag}"
    return f"{mark}{encoded}-{tag}"


def parse_hidden(name: str) -> Optional[tuple[str, str, str]]:
    """(checkpoint name, mark, tag) of a hidden sibling's name, in either form; None for any other name."""
    for mark in (TMP_MARK, LEASE_MARK, RETIRED_MARK):
        if name.startswith(mark):
            encoded, sep, tag = name[len(mark):].partition("-")
            try:
                base = bytes.fromhex(encoded).decode("utf-8")
            except ValueError:
                return None
            return (base, mark, tag) if sep and tag and base else None
        if name.startswith(".") and mark in name:
            base, tag = name[1:].split(mark, 1)
            return (base, mark, tag) if base and tag else None
    return None


def _age(path: str, now: float) -> Optional[float]:
    """Seconds since anything in the directory ``path`` (one level) last changed; None if unknown."""
    try:
        newest = os.lstat(path).st_mtime
        with os.scandir(path) as entries:
            for e in entries:
                newest = max(newest, e.stat(follow_symlinks=False).st_mtime)
        return max(0.0, now - newest)
    except OSError:
        return None
