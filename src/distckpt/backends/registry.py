"""The storage layer for a checkpoint id: the writer or reader of the store registered for its scheme
(:mod:`.schemes`), or of another program's checkpoint found there; and ``pick_storage``, the choice that
``save``, ``load`` and ``async_save`` make.

``hf://path`` publishes a Hugging Face checkpoint directory (:class:`HuggingFaceWriter`). A directory that
torch.distributed.checkpoint wrote is read by :class:`DCPReader`, a Hugging Face directory by
:class:`HuggingFaceReader`, a torch.save file by :class:`TorchSaveReader`.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Optional, Union

from ..capabilities import OVERWRITE, supports
from ..errors import CheckpointError
from ..format import METADATA_FILE
from ..layouts.dcp import DCP_METADATA_FILE
from ..layouts.hf import is_hf_listing
from ..storage import StorageReader, StorageWriter
from .blob_storage import BlobStorageReader, BlobStorageWriter, accepted_options, store_at
from .dcp_reader import DCPReader
from .fsspec_store import FsspecReader, FsspecWriter  # noqa: F401 - any fsspec URL, after the stores registered
from .hf_reader import HuggingFaceReader
from .hf_writer import HuggingFaceWriter
from .schemes import FILE, scheme_entry, scheme_of
from .torch_save_file import TorchSaveReader, is_torch_save_blob

__all__ = ["writer_for", "reader_for", "check_options", "pick_storage"]

_FOREIGN_READERS = (DCPReader, HuggingFaceReader, TorchSaveReader)


def _classes(checkpoint_id: Union[str, os.PathLike]) -> Optional[tuple[type, type]]:
    """The writer and reader classes of the store registered for ``checkpoint_id``'s scheme, or None."""
    entry = scheme_entry(checkpoint_id)
    if entry is None:
        return None
    return entry.writer or BlobStorageWriter, entry.reader or BlobStorageReader


def _unknown(checkpoint_id: Union[str, os.PathLike], arg: str) -> CheckpointError:
    return CheckpointError(f"no storage backend accepts checkpoint_id {str(checkpoint_id)!r}; pass {arg}= explicitly, or "
                           "register a store for its scheme with distckpt.backends.register_store")


def writer_for(checkpoint_id: Union[str, os.PathLike], **options: Any) -> StorageWriter:
    """A new writer for ``checkpoint_id``'s scheme, given the ``options`` its constructor takes
    (``hf://path`` publishes a Hugging Face checkpoint directory, given its ``config``)."""
    if HuggingFaceWriter.validate_checkpoint_id(checkpoint_id):
        accepted = accepted_options(HuggingFaceWriter, options)
        path = os.fspath(checkpoint_id)[len("hf://"):]
        if accepted.get("config") is None and path:  # ("hf://" alone: the writer says it names no directory)
            raise CheckpointError(
                f"{os.fspath(checkpoint_id)!r} would publish safetensors shards with no config.json, and from_pretrained "
                f"cannot open such a directory (a checkpoint id has no room for a config): pass storage_writer="
                f"distckpt.HuggingFaceWriter({path!r}, config=model.config) (a transformers config, a dict, or the path "
                f"of a config.json); HuggingFaceWriter({path!r}) without config publishes the weights alone, for a loader "
                "that takes its config elsewhere")
        return HuggingFaceWriter(**accepted)
    classes = _classes(checkpoint_id)
    if classes is None:
        raise _unknown(checkpoint_id, "storage_writer")
    return classes[0](**accepted_options(classes[0], options))


def reader_for(checkpoint_id: Union[str, os.PathLike], **options: Any) -> StorageReader:
    """A new reader for ``checkpoint_id``, given the ``options`` its constructor takes (a directory that
    torch.distributed.checkpoint wrote gets the DCP reader, a Hugging Face directory the Hugging Face
    reader, a torch.save file the torch.save reader; anything else the reader of its scheme's store)."""
    for foreign in _FOREIGN_READERS:
        if foreign.validate_checkpoint_id(checkpoint_id):
            return foreign(**accepted_options(foreign, options))
    classes = _classes(checkpoint_id)
    if classes is None:
        raise _unknown(checkpoint_id, "storage_reader")
    found = _foreign_on_store(os.fspath(checkpoint_id), options) if scheme_of(checkpoint_id) != FILE else None
    if found is not None:
        return found(os.fspath(checkpoint_id), **accepted_options(found, options))
    return classes[1](**accepted_options(classes[1], options))


def _foreign_on_store(checkpoint_id: str, options: dict[str, Any]) -> Optional[type]:
    """The reader of another program's checkpoint at ``checkpoint_id`` on a store other than a local disk: a Hugging
    Face or DCP directory (by its listing, where no distckpt metadata is), or a torch.save file (an object that
    begins as a zip archive does). None where distckpt's own reader is the one to use, or to say what is wrong: a
    store that cannot be opened or listed, a committed distckpt checkpoint, nothing there. One existence check a
    load of distckpt's own checkpoint; the listing only where its metadata is absent."""
    try:
        store = store_at(checkpoint_id, options)
    except CheckpointError:  # nothing there (a store that is no prefix of objects), or a store that cannot open
        store = None
    try:
        if store is not None and store.exists(METADATA_FILE):
            return None
        names = [] if store is None else list(store.list())
        if is_hf_listing(names):
            return HuggingFaceReader
        if DCP_METADATA_FILE in names:
            return DCPReader
        parent, _, name = checkpoint_id.rstrip("/").rpartition("/")
        if names or not name or "://" not in parent:
            return None
        return TorchSaveReader if is_torch_save_blob(store_at(parent, options), name) else None
    except CheckpointError:
        return None


def check_options(checkpoint_id: Union[str, os.PathLike], options: dict[str, Any]) -> None:
    """Refuse options that neither the writer nor the reader of ``checkpoint_id``'s scheme takes."""
    classes = _classes(checkpoint_id)
    if classes is None:
        return
    writer, reader = classes
    unknown = set(options) - set(accepted_options(writer, options)) - set(accepted_options(reader, options))
    if unknown:
        raise CheckpointError(
            f"storage options {sorted(unknown)} are not taken by {writer.__name__} or {reader.__name__} "
            f"(the backend of {str(checkpoint_id)!r}); see their arguments")


def pick_storage(kind: str, checkpoint_id: Any, given: Any, overwrite: Optional[bool] = None, own_copy: bool = False) -> Any:
    """The storage writer or reader to use: ``given``, or the one for ``checkpoint_id``'s scheme;
    reset to ``checkpoint_id`` when there is one. ``overwrite`` (writers), when given, is this call's
    choice over the writer's own, for writers that declare ``OVERWRITE``: a copy of a given writer carries it.
    ``own_copy``: always work on a copy of a given one (a save still in flight when the caller passes the same
    writer to the next must keep its own checkpoint id)."""
    storage = copy.copy(given) if own_copy and given is not None else given
    if storage is None:
        if checkpoint_id is None:
            arg = "storage_writer" if kind == "writer" else "storage_reader"
            raise CheckpointError(f"needs checkpoint_id= (a directory path, s3://bucket/prefix or memory://name) or {arg}=")
        storage = writer_for(checkpoint_id) if kind == "writer" else reader_for(checkpoint_id)
    if overwrite is not None:
        if not supports(storage, OVERWRITE):
            raise CheckpointError(f"overwrite={overwrite}: the storage writer {type(storage).__name__} has no overwrite "
                                  "option; leave overwrite= out and use the writer's own")
        if storage is given:
            storage = copy.copy(given)
        storage.overwrite = bool(overwrite)
    if checkpoint_id is not None:
        storage.reset(checkpoint_id)
    return storage
