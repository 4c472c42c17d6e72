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

import threading
from collections import OrderedDict
from typing import Any, Iterable, Optional

from .. import knobs, process_state
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..format import METADATA_FILE
from ..format.codec import StoredFiles, stored_files
from ..format.datafile import read_header
from ..format.records import FileStorageData, split_reference
from .blobs import MAPS, RUNS, BlobReader, BlobStore, BlobWriter

__all__ = ["ReferencingStore", "SaveFiles", "data_files", "check_references", "committed_files", "referenced_by_siblings",
           "UNKNOWN"]


class ReadOnlyStore(BlobStore):
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


class SaveFiles(ReadOnlyStore):
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
        other = None  # what was found at that name instead: another save's file, or an entry distckpt does not read
        damaged = None  # a file there whose header cannot be read
        for _ in range(2):  # twice: a step retired between two looks has moved from the first place to another
            for place in self.places:
                try:
                    blob = place.open(name)
                except CheckpointNotFoundError:
                    continue
                except (OSError, CheckpointError) as exc:  # a link, a FIFO, a directory: never this save's file
                    other = other or f"{place.describe(name)} is not a regular file ({exc})"
                    continue
                if self.exact:
                    return blob
                try:
                    if read_header(blob.pread, blob.size, place.describe(name)).save_id == self.save_id:
                        return blob
                    other = other or f"{place.describe(name)} holds another save's data"
                except (OSError, CheckpointError) as exc:
                    damaged = damaged or exc
                blob.close()
        if damaged is not None:
            raise CorruptCheckpointError(
                f"{self.describe(name)}, which the checkpoint being read references, is damaged: {damaged}. Restore "
                "it from a copy, or load another step.")
        found = f" ({other})" if other else ""
        raise CheckpointNotFoundError(
            f"{self.describe(name)} is gone{found}. The checkpoint being read is a step of an incremental run that "
            "references this file of an earlier step: the step was copied or moved out of its run, or the earlier step "
            "was deleted or saved again outside distckpt's retention (which keeps every file a kept step references). "
            "Load it where its run is, or first make it self-contained there with `distckpt compact <step>` and copy it "
            "after that.")

    def list(self) -> Iterable[str]:
        names: set = set()
        for place in self.places:
            names.update(place.list())
        return sorted(names)


class ReferencingStore(ReadOnlyStore):
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


def check_references(location: BlobStore, listed: StoredFiles, where: str) -> None:
    """Every data file of another checkpoint that a document (its files ``listed``) references is stored, at its
    recorded size: what a commit checks before it publishes a document with references (a file deleted since the
    save began is caught here)."""
    for key, (size, save_id) in sorted(listed.references.items()):
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


def committed_files(checkpoint: BlobStore, known: Optional[tuple] = None) -> tuple[Optional[Any], Optional[StoredFiles]]:
    """(identity, files) of the committed metadata of ``checkpoint``, read by the loader's parsers
    (:func:`~distckpt.format.codec.stored_files`). ``files`` is None where the checkpoint is not committed
    (no metadata), and :data:`UNKNOWN` where its metadata cannot be read or parsed, or is of a version this
    release does not read: it might reference anything, so whoever deletes keeps all it could. ``known`` is an
    earlier answer, returned again while the metadata's identity (``BlobReader.identity``) is the same."""
    try:
        blob = checkpoint.open(METADATA_FILE)
    except CheckpointNotFoundError:
        return None, None
    except (OSError, CheckpointError):
        return None, UNKNOWN
    try:
        identity = blob.identity()
        if known is not None and identity is not None and known[0] == identity:
            return known
        if blob.size > knobs.max_metadata_bytes():
            return identity, UNKNOWN
        document = blob.pread(blob.size, 0)
    except (OSError, CheckpointError):
        return None, UNKNOWN
    finally:
        blob.close()
    try:
        files = stored_files(document, checkpoint.describe(METADATA_FILE))
    except CheckpointError:
        return identity, UNKNOWN
    return identity, (UNKNOWN if files is None else files)


UNKNOWN = StoredFiles("", {}, {})  # a committed document whose references cannot be known: it keeps everything

# what the overwrites of this process parsed of their siblings' documents, by location, while each is the same version
# (its identity): a run of many steps is not parsed again whole at every overwrite
_PARSED: "OrderedDict[str, tuple]" = OrderedDict()
_PARSED_LOCK = threading.Lock()
_PARSED_MAX = 4096


@process_state.on_fork_child
def _fresh_lock_in_child() -> None:
    global _PARSED_LOCK
    _PARSED_LOCK = threading.Lock()  # a parent's thread may have held it at the fork


def referenced_by_siblings(parent: BlobStore, name: str, save_id: str) -> Optional[set]:
    """The data files of save ``save_id`` of checkpoint ``name`` that committed checkpoints under ``parent``
    reference: what replacing or deleting that save must keep. The checkpoint now committed at ``name`` counts too
    (an overwrite's new document may reference the save it replaced; docs/format.md, section 6). None where a
    committed document cannot be read whole (it might reference anything)."""
    keep: set = set()
    for sibling in parent.children():
        child = parent.child(sibling)
        where = child.describe(METADATA_FILE)
        with _PARSED_LOCK:
            known = _PARSED.get(where)
        identity, files = committed_files(child, known)
        if identity is not None and files is not None and files is not UNKNOWN:
            with _PARSED_LOCK:
                _PARSED[where] = (identity, files)
                _PARSED.move_to_end(where)
                while len(_PARSED) > _PARSED_MAX:
                    _PARSED.popitem(last=False)
        if files is None:
            continue  # not committed: references nothing
        if files is UNKNOWN:
            return None
        keep |= files.referenced_by_checkpoint().get((name, save_id), set())
    return keep
