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

from .engine.blobs import REFERENCES, BlobStore
from .engine.references import UNKNOWN, committed_files
from .format.codec import StoredFiles

__all__ = ["RunFiles"]

log = logging.getLogger("distckpt")


class RunFiles:
    """The file tables of the checkpoints directly under ``store`` (a run's root), read as committed, by the loader's
    parsers (:func:`~distckpt.engine.references.committed_files`), each parsed once per version of its metadata."""

    def __init__(self, store: BlobStore) -> None:
        self.store = store
        self._tables: dict[str, tuple] = {}  # name -> (identity of its metadata, its StoredFiles)

    def table(self, name: str) -> Optional[StoredFiles]:
        """What committed checkpoint ``name`` stores and references; None where it is not committed (gone),
        :data:`UNKNOWN` where its metadata cannot be read or parsed."""
        identity, files = committed_files(self.store.child(name), self._tables.get(name))
        if identity is not None and files is not None and files is not UNKNOWN:
            self._tables[name] = (identity, files)
        else:
            self._tables.pop(name, None)
        return files

    def kept_files(self, names: list[str]) -> Optional[dict]:
        """(checkpoint, save id) -> the names of its data files that checkpoints ``names`` reference; None where one
        of them cannot be read (it might reference anything)."""
        keep: dict = {}
        for name in names:
            files = self.table(name)
            if files is None:
                continue  # deleted meanwhile (another manager's retention): it references nothing any more
            if files is UNKNOWN:
                return None
            for key, found in files.referenced_by_checkpoint().items():
                keep.setdefault(key, set()).update(found)
        return keep

    def delete(self, name: str, keep: Optional[dict]) -> None:
        """Delete committed checkpoint ``name``: removed whole, or retired keeping the files that ``keep`` (from
        :meth:`kept_files` of the steps that stay) names; with ``keep`` None, retired keeping all its files."""
        child = self.store.child(name)
        if REFERENCES not in self.store.capabilities or (keep is not None and not any(c == name for c, _ in keep)):
            child.remove()  # nothing of it is referenced (its table need not be read)
            return
        files = self.table(name)
        if files is None:
            return  # gone meanwhile
        if files is UNKNOWN:
            log.warning("distckpt: left %s in place: its metadata cannot be read, and a kept step may reference its "
                        "data files", child.describe())
            return
        needed = set(files.own) if keep is None else keep.get((name, files.save_id), set())
        if needed:
            child.retire(files.save_id, set(needed))
        else:
            child.remove()
