"""Which data files of a run's checkpoints other checkpoints reference: the mark phase of retention and cleanup.

An incremental save (format 4.0) references data files of earlier steps of its run. Before retention deletes
a step, it reads the file tables of the steps that stay and keeps every file they reference: a step whose
files are referenced is *retired* (it disappears whole, its referenced files stay where
``BlobStore.referenced`` finds them, the rest go); any other step is removed as before. A later cleanup
removes what retired steps hold that no kept step references any more. Every decision reads committed
documents only, so a crash anywhere leaves, at worst, files that the next cleanup removes: never a kept
step that references a deleted byte.
"""

from __future__ import annotations

import logging
from typing import Optional

from . import knobs
from .engine.blobs import REFERENCES, BlobStore
from .engine.references import REFERENCING
from .errors import CheckpointError
from .format import METADATA_FILE
from .format.codec import referenced_files, stored_file_sizes, stored_save_id
from .format.names import SAVE_ID
from .format.records import split_reference

__all__ = ["RunFiles"]

log = logging.getLogger("distckpt")


class RunFiles:
    """The file tables of the checkpoints directly under ``store`` (a run's root), read as committed."""

    def __init__(self, store: BlobStore) -> None:
        self.store = store
        self._tables: dict[str, tuple] = {}  # name -> (identity of its metadata, (save id, own files, references))

    def table(self, name: str, refs_only: bool = False) -> Optional[tuple[str, set, dict]]:
        """(save id, own data files, referenced files as (checkpoint, save id) -> names) of committed checkpoint
        ``name``; None where it is gone or its metadata cannot be read. With ``refs_only``, a document that
        references nothing may come back with only that known."""
        child = self.store.child(name)
        try:
            blob = child.open(METADATA_FILE)
        except (OSError, CheckpointError):
            return None
        try:
            identity = blob.identity()
            cached = self._tables.get(name)
            if identity is not None and cached is not None and cached[0] == identity:
                return cached[1]
            if refs_only and REFERENCING not in blob.pread(min(blob.size, 64), 0):
                return ("", set(), {})  # before format 4 a document references nothing: its rows need no reading
            if blob.size > knobs.max_metadata_bytes():
                return None
            document = blob.pread(blob.size, 0)
        except (OSError, CheckpointError):
            return None
        finally:
            blob.close()
        try:
            save_id = stored_save_id(document)
            own = set(stored_file_sizes(document))
            refs: dict = {}
            for key, (_, ref_save) in referenced_files(document).items():
                checkpoint, file = split_reference(key) or ("", key)
                refs.setdefault((checkpoint, ref_save), set()).add(file)
        except CheckpointError:
            return None
        if save_id is None or not SAVE_ID.match(save_id):
            return None
        result = (save_id, own, refs)
        if identity is not None:
            self._tables[name] = (identity, result)
        return result

    def kept_files(self, names: list[str]) -> Optional[dict]:
        """(checkpoint, save id) -> the names of its data files that checkpoints ``names`` reference; None where one
        of them cannot be read (it might reference anything)."""
        keep: dict = {}
        for name in names:
            table = self.table(name, refs_only=True)
            if table is None:
                if self.store.child(name).is_committed():
                    return None
                continue  # deleted meanwhile (another manager's retention): it references nothing any more
            for key, files in table[2].items():
                keep.setdefault(key, set()).update(files)
        return keep

    def delete(self, name: str, keep: Optional[dict]) -> None:
        """Delete committed checkpoint ``name``: removed whole, or retired keeping the files that ``keep`` (from
        :meth:`kept_files` of the steps that stay) names; with ``keep`` None, retired keeping all its files."""
        child = self.store.child(name)
        if REFERENCES not in self.store.capabilities or (keep is not None and not any(c == name for c, _ in keep)):
            child.remove()  # nothing of it is referenced (its table need not be read)
            return
        table = self.table(name)
        if table is None:
            if keep is None or any(checkpoint == name for checkpoint, _ in keep):
                log.warning("distckpt: left %s in place: its metadata cannot be read, and a kept step may reference its "
                            "data files", child.describe())
                return
            child.remove()
            return
        save_id, own, _ = table
        needed = own if keep is None else keep.get((name, save_id), set())
        if needed:
            child.retire(save_id, set(needed))
        else:
            child.remove()
