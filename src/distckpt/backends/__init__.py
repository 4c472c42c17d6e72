"""Storage backends, chosen by the scheme of a checkpoint_id.

``memory://name`` selects the in-memory backend, ``s3://bucket/prefix`` an
S3-compatible object store; a plain path (or
``file://``) the filesystem. More backends register with
:func:`register_backend`.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Union

from ..errors import CheckpointError
from ..storage import StorageReader, StorageWriter
from .dcp_reader import DCPReader
from .filesystem import FileSystemReader, FileSystemWriter
from .hf_reader import HuggingFaceReader
from .hf_writer import HuggingFaceWriter
from .memory import MemoryReader, MemoryWriter, clear_memory_store
from .s3 import S3Reader, S3Writer
from .torch_save_file import TorchSaveReader

__all__ = [
    "FileSystemWriter", "FileSystemReader", "DCPReader", "HuggingFaceReader", "HuggingFaceWriter", "TorchSaveReader",
    "MemoryWriter", "MemoryReader",
    "S3Writer", "S3Reader",
    "clear_memory_store",
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


def writer_for(checkpoint_id: Union[str, os.PathLike], **options: Any) -> StorageWriter:
    """A new writer of the backend that accepts ``checkpoint_id``, given the ``options`` its constructor takes
    (``hf://path`` publishes a Hugging Face checkpoint directory)."""
    if HuggingFaceWriter.validate_checkpoint_id(checkpoint_id):
        return HuggingFaceWriter(**_accepted(HuggingFaceWriter, options))
    for writer, _ in _BACKENDS:
        if writer.validate_checkpoint_id(checkpoint_id):
            return writer(**_accepted(writer, options))
    raise CheckpointError(f"no storage backend accepts checkpoint_id {str(checkpoint_id)!r}; pass storage_writer= explicitly")


def reader_for(checkpoint_id: Union[str, os.PathLike], **options: Any) -> StorageReader:
    """A new reader of the backend that accepts ``checkpoint_id``, given the ``options`` its constructor takes
    (a directory that torch.distributed.checkpoint wrote gets the DCP reader, a Hugging Face directory the
    Hugging Face reader, a torch.save file the torch.save reader)."""
    for foreign in (DCPReader, HuggingFaceReader, TorchSaveReader):
        if foreign.validate_checkpoint_id(checkpoint_id):
            return foreign(**_accepted(foreign, options))
    for _, reader in _BACKENDS:
        if reader.validate_checkpoint_id(checkpoint_id):
            return reader(**_accepted(reader, options))
    raise CheckpointError(f"no storage backend accepts checkpoint_id {str(checkpoint_id)!r}; pass storage_reader= explicitly")


def check_options(checkpoint_id: Union[str, os.PathLike], options: dict[str, Any]) -> None:
    """Refuse options that neither the writer nor the reader of ``checkpoint_id``'s backend takes."""
    for writer, reader in _BACKENDS:
        if writer.validate_checkpoint_id(checkpoint_id):
            unknown = set(options) - set(_accepted(writer, options)) - set(_accepted(reader, options))
            if unknown:
                raise CheckpointError(
                    f"storage options {sorted(unknown)} are not taken by {writer.__name__} or {reader.__name__} "
                    f"(the backend of {str(checkpoint_id)!r}); see their arguments")
            return


def _accepted(cls: type, options: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return dict(options)
    return {k: v for k, v in options.items() if k in params}
