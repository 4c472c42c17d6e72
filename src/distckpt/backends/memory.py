"""In-memory storage: checkpoints kept in this process, named ``memory://<name>``.

Useful for tests, for fast hand-offs inside one process, and as the smallest
example of a backend. Data lives until :func:`clear_memory_store` or exit.
"""

from __future__ import annotations

import itertools
import threading
from typing import Callable, Iterable, Optional, Union

from .. import faults
from ..engine.blobs import BlobReader, BlobStore, BlobWriter, BytesReader
from ..errors import CheckpointError, CheckpointNotFoundError
from .blob_storage import BlobStorageReader, BlobStorageWriter
from .objects import ObjectClient, ObjectInfo, ObjectStore
from .schemes import register_store

__all__ = ["MemoryWriter", "MemoryReader", "MemoryStore", "clear_memory_store"]

_LOCK = threading.Lock()
_OBJECTS: dict[str, "_Blob"] = {}  # key ("<checkpoint name>/<object>") -> bytes
_VERSIONS = itertools.count(1)  # each object written gets the next: what tells two versions of one key apart
SCHEME = "memory://"


def clear_memory_store() -> None:
    """Forget every in-memory checkpoint of this process."""
    with _LOCK:
        _OBJECTS.clear()


class _Blob(bytes):
    """An object's bytes, with the version it was written as and its tag."""

    version: int = 0
    tag: Optional[str] = None


def _new_blob(data, tag: Optional[str] = None) -> _Blob:
    blob = _Blob(data)
    blob.version, blob.tag = next(_VERSIONS), tag
    return blob


class _VersionedReader(BytesReader):
    def __init__(self, blob: _Blob) -> None:
        super().__init__(blob)
        self._version = blob.version

    def identity(self) -> Optional[tuple]:
        return ("memory", self._version)


class _MemWriter(BlobWriter):
    """Fills a buffer; the object appears, whole, when the writer is closed."""

    def __init__(self, key: str):
        self.key = key
        self.buf = bytearray()
        self.lock = threading.Lock()

    def pwrite(self, data: memoryview, offset: int) -> None:
        faults.point("write", SCHEME + self.key)
        data = memoryview(data).cast("B")
        with self.lock:
            end = offset + len(data)
            if len(self.buf) < end:
                self.buf.extend(bytes(end - len(self.buf)))
            self.buf[offset:end] = data

    def close(self, sync: bool) -> None:
        with self.lock:
            if self.buf is not None:
                blob, self.buf = _new_blob(self.buf), None
                with _LOCK:
                    _OBJECTS[self.key] = blob

    def abort(self) -> None:
        with self.lock:
            self.buf = None


class MemoryObjects(ObjectClient):
    """This process's objects: the primitives of an object store over a dict."""

    def url(self, key: str) -> str:
        return SCHEME + key

    def put(self, key: str, data: bytes, *, if_absent: bool = False, tag: Optional[str] = None) -> bool:
        blob = _new_blob(data, tag)
        with _LOCK:
            if if_absent and key in _OBJECTS:
                return False
            _OBJECTS[key] = blob
        return True

    def get(self, key: str, limit: Optional[int] = None) -> Optional[bytes]:
        blob = _OBJECTS.get(key)
        return None if blob is None else bytes(blob if limit is None else blob[:limit])

    def head(self, key: str) -> Optional[ObjectInfo]:
        blob = _OBJECTS.get(key)
        return None if blob is None else ObjectInfo(key, len(blob), None, blob.tag)

    def list(self, prefix: str, delimiter: bool = False) -> Iterable[ObjectInfo]:
        with _LOCK:
            found = [(k, b) for k, b in _OBJECTS.items() if k.startswith(prefix)]
        out: dict[str, ObjectInfo] = {}
        for key, blob in found:
            rest = key[len(prefix):]
            if delimiter and "/" in rest:
                folder = prefix + rest.split("/", 1)[0] + "/"
                out[folder] = ObjectInfo(folder)
            else:
                out[key] = ObjectInfo(key, len(blob), None, blob.tag)
        return [out[k] for k in sorted(out)]

    def delete(self, keys: list[str]) -> None:
        with _LOCK:
            for key in keys:
                _OBJECTS.pop(key, None)

    def touch(self, key: str) -> None:
        if key not in _OBJECTS:
            raise CheckpointNotFoundError(f"{self.url(key)} does not exist")

    def writer(self, key: str, buffer_bytes: Optional[int] = None) -> BlobWriter:
        return _MemWriter(key)

    def reader(self, key: str, missing: Callable[[Optional[BaseException]], CheckpointError]) -> BlobReader:
        blob = _OBJECTS.get(key)
        if blob is None:
            raise missing(None)
        return _VersionedReader(blob)


class MemoryStore(ObjectStore):
    """Objects in this process's memory, under one name: the lifecycle of :mod:`.objects` over a dict."""

    def __init__(self, name: str):
        super().__init__(MemoryObjects(), name)

    @property
    def name(self) -> str:
        return self.prefix


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
        store = MemoryStore(_name(checkpoint_id))
        if not store.list():
            raise CheckpointNotFoundError(f"checkpoint {store.describe()!r} does not exist in this process")
        if not store.exists("metadata.json") and store.incomplete_saves():
            raise CheckpointNotFoundError(f"checkpoint {store.describe()!r} does not exist in this process (a save of it "
                                          "never committed)")
        return store


register_store("memory", memory_store, writer=MemoryWriter, reader=MemoryReader)
