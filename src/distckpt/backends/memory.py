"""In-memory storage: checkpoints kept in this process, named ``memory://<name>``.

Useful for tests, for fast hand-offs inside one process, and as the smallest
example of a backend. Data lives until :func:`clear_memory_store` or exit.
"""

from __future__ import annotations

import itertools
import threading
from typing import Iterable, Optional, Union

from .. import faults
from ..engine.blobs import LEASES, REFERENCES, RUNS, BlobReader, BlobStore, BlobWriter, BytesReader, Keep, keep_now
from ..engine.references import SaveFiles, referenced_by_siblings
from ..errors import CheckpointError, CheckpointNotFoundError
from ..format import METADATA_FILE
from ..format.codec import stored_files
from .blob_storage import BlobStorageReader, BlobStorageWriter
from .leases import save_is_dead
from .schemes import register_store

__all__ = ["MemoryWriter", "MemoryReader", "MemoryStore", "clear_memory_store"]

_LOCK = threading.Lock()
_CHECKPOINTS: dict[str, dict[str, bytearray]] = {}
_VERSIONS = itertools.count(1)  # each blob written gets the next: what tells two versions of one name apart
_LEASES: dict[tuple[str, str], bytes] = {}  # (checkpoint, save id) -> lease record
SCHEME = "memory://"
_TMP = "#tmp-"
_RETIRED = "#retired-"  # a deleted checkpoint's data files that kept checkpoints reference, under its save id


def clear_memory_store() -> None:
    """Forget every in-memory checkpoint of this process."""
    with _LOCK:
        _CHECKPOINTS.clear()


class _Blob(bytearray):
    """A blob's bytes, with the version it was written as."""

    version: int = 0


def _new_blob(data: bytes = b"") -> bytearray:
    blob = _Blob(data)
    blob.version = next(_VERSIONS)
    return blob


class _VersionedReader(BytesReader):
    def __init__(self, data: bytearray) -> None:
        super().__init__(data)
        self._version = getattr(data, "version", None) or None

    def identity(self) -> Optional[tuple]:
        return None if self._version is None else ("memory", self._version)


class _MemWriter(BlobWriter):
    def __init__(self, blobs: dict, name: str):
        self.buf = _new_blob()
        self.lock = threading.Lock()
        blobs[name] = self.buf

    def pwrite(self, data: memoryview, offset: int) -> None:
        faults.point("write", "memory")
        data = memoryview(data).cast("B")
        with self.lock:
            end = offset + len(data)
            if len(self.buf) < end:
                self.buf.extend(b"\0" * (end - len(self.buf)))
            self.buf[offset:end] = data

    def close(self, sync: bool) -> None:
        pass


class MemoryStore(BlobStore):
    """Blobs in this process's memory, under one name."""

    capabilities = frozenset({RUNS, LEASES, REFERENCES})

    def __init__(self, name: str):
        self.name = name

    def _blobs(self) -> dict[str, bytearray]:
        with _LOCK:
            return _CHECKPOINTS.setdefault(self.name, {})

    def prepare(self) -> None:
        self._blobs()

    def create(self, name: str, buffer_bytes: Optional[int] = None) -> BlobWriter:
        return _MemWriter(self._blobs(), name)

    def open(self, name: str) -> BlobReader:
        blobs = _CHECKPOINTS.get(self.name, {})
        if name not in blobs:
            raise CheckpointNotFoundError(f"{self.describe(name)} does not exist")
        return _VersionedReader(blobs[name])

    def put_atomic(self, name: str, data: bytes, sync: bool) -> None:
        self._blobs()[name] = _new_blob(data)

    def check_replaceable(self) -> None:
        document = _CHECKPOINTS.get(self.name, {}).get(METADATA_FILE)
        if document is None:
            return
        try:
            if stored_files(bytes(document), self.describe(METADATA_FILE)) is not None:
                return
        except CheckpointError as exc:
            raise CheckpointError(f"{self.describe()} holds a metadata document this distckpt cannot read ({exc}); an "
                                  "overwrite would drop files that kept steps may reference. Save to a new name, or "
                                  "remove it yourself.") from None

    def exists(self, name: str) -> bool:
        return name in _CHECKPOINTS.get(self.name, {})

    def list(self) -> Iterable[str]:
        return sorted(_CHECKPOINTS.get(self.name, {}))

    def describe(self, name: str = "") -> str:
        return f"{SCHEME}{self.name}/{name}" if name else f"{SCHEME}{self.name}"

    def staging(self, save_id: str) -> "MemoryStore":
        return MemoryStore(f"{self.name}{_TMP}{save_id}")

    def commit(self, staging: BlobStore, overwrite: bool, sync: bool) -> None:
        assert isinstance(staging, MemoryStore)
        faults.point("rename", self.describe())
        with _LOCK:
            if not overwrite and METADATA_FILE in _CHECKPOINTS.get(self.name, {}):
                _CHECKPOINTS.pop(staging.name, None)
                raise CheckpointError(f"checkpoint {self.describe()!r} was committed by another save while this one was writing")
            old = _CHECKPOINTS.get(self.name, {})
            _CHECKPOINTS[self.name] = _CHECKPOINTS.pop(staging.name, {})
        self._drop_replaced(old)

    def _drop_replaced(self, old: dict) -> None:
        """Keep what later steps of the run reference of the checkpoint a commit replaced (format 4.0), as retire does."""
        document = old.get(METADATA_FILE)
        try:
            files = None if document is None else stored_files(bytes(document), f"{self.describe(METADATA_FILE)} (replaced)")
        except CheckpointError:
            files = None
        if files is None or "/" not in self.name:
            return
        save_id = files.save_id
        parent, base = self.name.rsplit("/", 1)
        keep = referenced_by_siblings(MemoryStore(parent), base, save_id)
        if keep != set():
            with _LOCK:
                _CHECKPOINTS[f"{self.name}{_RETIRED}{save_id}"] = {n: b for n, b in old.items() if keep is None or n in keep}

    def discard(self, staging: BlobStore) -> None:
        with _LOCK:
            _CHECKPOINTS.pop(staging.name, None)

    def incomplete_saves(self) -> list[str]:
        return sorted(SCHEME + n for n in _CHECKPOINTS if n.startswith(self.name + _TMP))

    def child(self, name: str) -> "MemoryStore":
        return MemoryStore(f"{self.name}/{name}")

    def children(self) -> list[str]:
        start = len(self.name) + 1
        with _LOCK:
            return sorted({n[start:].split("/", 1)[0] for n in _CHECKPOINTS
                           if n.startswith(self.name + "/") and _TMP not in n[start:] and _RETIRED not in n[start:]})

    def referenced(self, checkpoint: str, save_id: str) -> BlobStore:
        parent = self.name.rsplit("/", 1)[0] if "/" in self.name else ""
        live = f"{parent}/{checkpoint}" if parent else checkpoint
        return SaveFiles([MemoryStore(live), MemoryStore(f"{live}{_RETIRED}{save_id}")], save_id, f"{SCHEME}{live} (save {save_id})")

    def retire(self, save_id: str, keep: set) -> None:
        faults.point("rename", self.describe())
        with _LOCK:
            blobs = _CHECKPOINTS.pop(self.name, None)
            if blobs is not None:
                _CHECKPOINTS[f"{self.name}{_RETIRED}{save_id}"] = {n: b for n, b in blobs.items() if n in keep}

    def remove(self) -> None:
        with _LOCK:
            _CHECKPOINTS.pop(self.name, None)

    def remove_incomplete_below(self, prefix: str = "", keep: Keep = None) -> list[str]:
        removed = []
        with _LOCK:
            retired = [n for n in _CHECKPOINTS if n.startswith(f"{self.name}/{prefix}") and _RETIRED in n[len(self.name) + 1:]]
        keep = keep_now(keep) if retired else None  # the mark, read after the listing: a step retired since is not in it
        with _LOCK:
            for n in retired:
                base, save_id = n[len(self.name) + 1:].split(_RETIRED, 1)
                if keep is not None and n in _CHECKPOINTS:
                    wanted = keep.get((base, save_id), ())
                    left = {k: v for k, v in _CHECKPOINTS[n].items() if k in wanted}
                    if left:
                        _CHECKPOINTS[n] = left
                    else:
                        del _CHECKPOINTS[n]
                        removed.append(SCHEME + n)
            stale = [n for n in _CHECKPOINTS if n.startswith(f"{self.name}/{prefix}") and _TMP in n[len(self.name) + 1:]]
        for n in stale:
            base, save_id = n.split(_TMP, 1)
            if save_is_dead(MemoryStore(base), save_id, None):
                with _LOCK:
                    _CHECKPOINTS.pop(n, None)
                MemoryStore(base).drop_lease(save_id)
                removed.append(SCHEME + n)
        return sorted(removed)

    def sizes(self) -> dict[str, int]:
        with _LOCK:
            return {k: len(v) for k, v in _CHECKPOINTS.get(self.name, {}).items()}

    def put_lease(self, save_id: str, record: bytes) -> None:
        with _LOCK:
            if (self.name, save_id) in _LEASES:
                raise CheckpointError(f"memory://{self.name}: save {save_id} holds a lease already")
            _LEASES[(self.name, save_id)] = record

    def renew_lease(self, save_id: str) -> None:
        pass

    def read_lease(self, save_id: str) -> Optional[tuple[bytes, Optional[float]]]:
        with _LOCK:
            record = _LEASES.get((self.name, save_id))
        return None if record is None else (record, None)

    def drop_lease(self, save_id: str) -> None:
        with _LOCK:
            _LEASES.pop((self.name, save_id), None)


def _name(checkpoint_id: Union[str, None]) -> Union[str, None]:
    if checkpoint_id is None:
        return None
    text = str(checkpoint_id)
    return text[len(SCHEME):] if text.startswith(SCHEME) else text


def memory_store(checkpoint_id: str) -> MemoryStore:
    """The store of ``memory://name`` (the factory of scheme ``memory``)."""
    return MemoryStore(_name(checkpoint_id))


class _Named:
    """An in-memory writer or reader names its checkpoint ``memory://<name>``; ``name`` is the part after the scheme."""

    @property
    def name(self) -> Union[str, None]:
        return _name(self.checkpoint_id)  # type: ignore[attr-defined]

    def canonical(self, checkpoint_id) -> str:
        return SCHEME + _name(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return str(checkpoint_id).startswith(SCHEME)


class MemoryWriter(_Named, BlobStorageWriter):
    """Writes a checkpoint into this process's memory under ``memory://<name>``."""

    def __init__(self, name: Union[str, None] = None, thread_count: int | None = None, overwrite: Optional[bool] = None,
                 compression: Optional[str] = None, compression_level: Optional[int] = None):
        super().__init__(name, sync_files=False, thread_count=thread_count, overwrite=overwrite, compression=compression,
                         compression_level=compression_level)

    def open_store(self, checkpoint_id: str) -> BlobStore:
        return memory_store(checkpoint_id)


class MemoryReader(_Named, BlobStorageReader):
    """Reads a checkpoint written by :class:`MemoryWriter`."""

    def __init__(self, name: Union[str, None] = None, verify_checksums: bool = True, thread_count: int | None = None,
                 shared_reads: Optional[bool] = None):
        super().__init__(name, verify_checksums=verify_checksums, thread_count=thread_count, shared_reads=shared_reads)

    def open_store(self, checkpoint_id: str) -> BlobStore:
        name = _name(checkpoint_id)
        if name not in _CHECKPOINTS:
            hint = " (a save of it never committed)" if MemoryStore(name).incomplete_saves() else ""
            raise CheckpointNotFoundError(f"checkpoint '{SCHEME}{name}' does not exist in this process{hint}")
        return MemoryStore(name)


register_store("memory", memory_store, writer=MemoryWriter, reader=MemoryReader)
