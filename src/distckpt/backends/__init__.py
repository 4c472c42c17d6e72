"""Storage backends, chosen by the scheme of a checkpoint_id.

``memory://name`` selects the in-memory backend, ``s3://bucket/prefix`` an
S3-compatible object store; a plain path (or
``file://``) the filesystem. More backends register with
:func:`register_backend`.
"""

from __future__ import annotations

import os
from typing import Union

from ..errors import CheckpointError
from ..storage import StorageReader, StorageWriter
from .filesystem import FileSystemReader, FileSystemWriter
from .memory import MemoryReader, MemoryWriter, clear_memory_store
from .s3 import S3Reader, S3Writer

__all__ = [
    "FileSystemWriter", "FileSystemReader", "MemoryWriter", "MemoryReader", "S3Writer", "S3Reader", "clear_memory_store",
    "register_backend", "writer_for", "reader_for",
]

# most specific first; the filesystem accepts any plain path, so it comes last
_BACKENDS: list[tuple[type[StorageWriter], type[StorageReader]]] = [
    (MemoryWriter, MemoryReader),
    (S3Writer, S3Reader),
    (FileSystemWriter, FileSystemReader),
]


def register_backend(writer: type[StorageWriter], reader: type[StorageReader]) -> None:
    """Make ``save``/``load`` pick this pair for checkpoint ids its ``validate_checkpoint_id`` accepts."""
    _BACKENDS.insert(0, (writer, reader))


def writer_for(checkpoint_id: Union[str, os.PathLike]) -> StorageWriter:
    for writer, _ in _BACKENDS:
        if writer.validate_checkpoint_id(checkpoint_id):
            return writer()
    raise CheckpointError(f"no storage backend accepts checkpoint_id {str(checkpoint_id)!r}; pass storage_writer= explicitly")


def reader_for(checkpoint_id: Union[str, os.PathLike]) -> StorageReader:
    for _, reader in _BACKENDS:
        if reader.validate_checkpoint_id(checkpoint_id):
            return reader()
    raise CheckpointError(f"no storage backend accepts checkpoint_id {str(checkpoint_id)!r}; pass storage_reader= explicitly")
