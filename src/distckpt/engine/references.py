"""Data files an incremental save references: found where the save that stored them put them.

A format-4.0 checkpoint's file table may list data files of sibling checkpoints of the same run
(``<checkpoint>/<file name>`` with the id of the save that stored them; docs/format.md, 3.2). The read
engine opens every file through one store, so a checkpoint with references is read through a
:class:`ReferencingStore`: its own files from its data store, a referenced one from the store its run's
location gives for that checkpoint and save (``BlobStore.referenced``). That store may hold the save under
more than one name (a step retired by retention keeps its referenced files under a hidden name of its
save), so :class:`SaveFiles` looks in each place and takes the file whose header names the save.
"""

from __future__ import annotations

from typing import Iterable, Optional

from .. import knobs
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..format import METADATA_FILE
from ..format.codec import referenced_files
from ..format.records import FileStorageData, split_reference
from .blobs import MAPS, RUNS, BlobReader, BlobStore, BlobWriter

__all__ = ["ReferencingStore", "SaveFiles", "data_files", "check_references", "referenced_by_siblings", "REFERENCING"]

_PEEK = 512  # bytes: a distckpt data file names its save in the first member of its header


class _ReadOnly(BlobStore):
    """A store to read from only."""

    def create(self, name: str, buffer_bytes: Optional[int] = None) -> BlobWriter:
        raise CheckpointError(f"{self.describe(name)}: referenced data files are read, never written")

    def staging(self, save_id: str) -> BlobStore:
        raise CheckpointError(f"{self.describe()}: referenced data files belong to committed saves")

    def commit(self, staging: BlobStore, overwrite: bool, sync: bool) -> None:
        raise CheckpointError(f"{self.describe()}: referenced data files belong to committed saves")

    def discard(self, staging: BlobStore) -> None:
        raise CheckpointError(f"{self.describe()}: referenced data files belong to committed saves")

    def incomplete_saves(self) -> list[str]:
        return []


class SaveFiles(_ReadOnly):
    """The data files of save ``save_id`` of one checkpoint, looked for in ``places`` in order.

    A file is taken from the first place that holds it with a header naming the save: a checkpoint saved
    again under the same name holds another save's files there. Places named by the save itself (``exact``)
    need no look at the header.
    """

    def __init__(self, places: list[BlobStore], save_id: str, what: str, exact: bool = False) -> None:
        self.places, self.save_id, self.what, self.exact = places, save_id, what, exact

    def describe(self, name: str = "") -> str:
        return f"{self.what}, file {name!r}" if name else self.what

    def open(self, name: str) -> BlobReader:
        mark = f'"save_id":"{self.save_id}"'.encode()
        for _ in range(2):  # twice: a step retired between two looks has moved from the first place to another
            for place in self.places:
                try:
                    blob = place.open(name)
                except CheckpointNotFoundError:
                    continue
                if self.exact or mark in blob.pread(min(blob.size, _PEEK), 0):
                    return blob
                blob.close()
        raise CheckpointNotFoundError(
            f"{self.describe(name)} is gone: the step that stored it was deleted, or saved again, outside distckpt's retention "
            "(which keeps every file a kept step references). This checkpoint cannot be loaded; load another step.")

    def list(self) -> Iterable[str]:
        names: set = set()
        for place in self.places:
            names.update(place.list())
        return sorted(names)


class ReferencingStore(_ReadOnly):
    """The data files of a checkpoint that references files of other checkpoints: its own from ``own``, each
    referenced one from ``location.referenced(checkpoint, save_id)``."""

    def __init__(self, own: BlobStore, location: BlobStore, fsd: FileStorageData) -> None:
        self.own, self.location, self.fsd = own, location, fsd
        self.capabilities = own.capabilities - {MAPS, RUNS}
        self._saves: dict[tuple[str, str], BlobStore] = {}

    def describe(self, name: str = "") -> str:
        return self.own.describe(name)

    def _save(self, checkpoint: str, save_id: str) -> BlobStore:
        key = (checkpoint, save_id)
        if key not in self._saves:
            self._saves[key] = self.location.referenced(checkpoint, save_id)
        return self._saves[key]

    def open(self, name: str) -> BlobReader:
        parts = split_reference(name)
        if parts is None:
            return self.own.open(name)
        info = self.fsd.files.get(name)
        if info is None or info.save_id is None:
            raise CorruptCheckpointError(f"{self.describe()}: data file {name!r} is not a reference the metadata lists")
        return self._save(parts[0], info.save_id).open(parts[1])

    def list(self) -> Iterable[str]:
        return sorted(set(self.own.list()) | {n for n, info in self.fsd.files.items() if info.save_id is not None})

    def sizes(self) -> dict[str, int]:
        out = self.own.sizes()
        for name, info in self.fsd.files.items():
            if info.save_id is not None:
                try:
                    blob = self.open(name)
                except CheckpointNotFoundError:
                    continue
                try:
                    out[name] = blob.size
                finally:
                    blob.close()
        return out


def data_files(location: BlobStore, fsd: FileStorageData) -> BlobStore:
    """The store to read the data files of the checkpoint at ``location`` (its table ``fsd``) through."""
    own = location.data_store(fsd.save_id)
    if not any(info.save_id is not None for info in fsd.files.values()):
        return own
    return ReferencingStore(own, location, fsd)


def check_references(location: BlobStore, document: bytes, where: str) -> None:
    """Every data file of another checkpoint ``document`` references is stored, at its recorded size: what a commit
    checks before it publishes a document with references (a file deleted since the save began is caught here)."""
    for key, (size, save_id) in sorted(referenced_files(document).items()):
        checkpoint, name = split_reference(key) or ("", key)
        try:
            blob = location.referenced(checkpoint, save_id).open(name)
        except CheckpointNotFoundError:
            raise CorruptCheckpointError(
                f"{where}: data file {name!r} of {checkpoint!r} (save {save_id}), which this save references for chunks it "
                "did not write again, is gone; nothing was committed. Save again: the next save writes every chunk.") from None
        try:
            if blob.size != size:
                raise CorruptCheckpointError(f"{where}: referenced data file {key!r} is {blob.size} bytes, not {size}; nothing "
                                             "was committed. Save again.")
        finally:
            blob.close()


REFERENCING = b'"format_version":"4.'  # how a document that may reference other checkpoints' files begins (format 4)


def referenced_by_siblings(parent: BlobStore, name: str, save_id: str) -> Optional[set]:
    """The data files of save ``save_id`` of checkpoint ``name`` that committed checkpoints beside it (under
    ``parent``) reference: what replacing or deleting that save must keep. None where a sibling's metadata cannot
    be read whole (it might reference anything)."""
    keep: set = set()
    prefix = f"{name}/"
    for sibling in parent.children():
        if sibling == name:
            continue
        try:
            blob = parent.child(sibling).open(METADATA_FILE)
        except (OSError, CheckpointError):
            continue  # not committed: references nothing
        try:
            if REFERENCING not in blob.pread(min(blob.size, 64), 0):
                continue
            if blob.size > knobs.max_metadata_bytes():
                return None
            document = blob.pread(blob.size, 0)
        except (OSError, CheckpointError):
            return None
        finally:
            blob.close()
        try:
            found = referenced_files(document)
        except CheckpointError:
            return None
        keep |= {key[len(prefix):] for key, (_, sid) in found.items() if sid == save_id and key.startswith(prefix)}
    return keep
