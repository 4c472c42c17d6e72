"""A ``torch.save`` file of a state dict as a checkpoint: every rank reads the rows its state dict holds straight
from the file, through the read engine (the layout, distckpt.layouts.torch_save, places each tensor at its bytes;
the file is never given to ``torch.load``)."""

from __future__ import annotations

import os
from typing import Union

from ..engine.blobs import BlobStore
from ..errors import CheckpointError, CheckpointNotFoundError
from ..layouts.torch_save import read_archive, torch_save_layout
from ..metadata import Metadata
from .blob_storage import store_at
from .filesystem import FsStore
from .foreign import LayoutReader
from .schemes import FILE, scheme_of

__all__ = ["TorchSaveReader", "is_torch_save_file", "is_torch_save_blob"]

_ZIP_MAGIC = b"PK\x03\x04"


def is_torch_save_file(checkpoint_id: Union[str, os.PathLike, None]) -> bool:
    """A local regular file (not a link) that begins as a zip archive does, as ``torch.save`` files do."""
    if checkpoint_id is None:
        return False
    path = os.fspath(checkpoint_id)
    if not isinstance(path, str) or "://" in path or os.path.islink(path) or not os.path.isfile(path):
        return False
    try:
        with open(path, "rb") as f:
            return f.read(4) == _ZIP_MAGIC
    except OSError:
        return False


def is_torch_save_blob(store: BlobStore, name: str) -> bool:
    """Whether the object ``name`` of ``store`` begins as a zip archive does, as ``torch.save`` files do."""
    if not store.exists(name):
        return False
    blob = store.open(name)
    try:
        return blob.size >= len(_ZIP_MAGIC) and blob.pread(len(_ZIP_MAGIC), 0) == _ZIP_MAGIC
    finally:
        blob.close()


class TorchSaveReader(LayoutReader):
    """Reads a ``torch.save`` file of a state dict: its tensors, by dotted key, at any sharding (see the module
    docstring). ``path`` is the file."""

    kind = "torch.save"

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return is_torch_save_file(checkpoint_id)

    def _store(self) -> BlobStore:
        if self.path is None:
            raise CheckpointError("TorchSaveReader needs the file: TorchSaveReader(path) or checkpoint_id=")
        if scheme_of(self.path) != FILE:  # an object: read from the store of its prefix
            return store_at(self.path.rstrip("/").rpartition("/")[0], self.store_options)
        return FsStore(os.path.dirname(os.path.abspath(self.path)))

    def describe(self, store: BlobStore, sizes: dict[str, int]) -> Metadata:
        name = self.path.rstrip("/").rpartition("/")[2] if scheme_of(self.path) != FILE else os.path.basename(self.path)
        if name not in sizes:
            raise CheckpointNotFoundError(f"{self.where()} does not exist or is not a regular file; check the path")
        blob = store.open(name)
        try:
            obj, archive = read_archive(blob.pread, blob.size, self.where())
            md = torch_save_layout(obj, archive, name, blob.size, self.where(), self.path, self.load_id)
            md.storage_data.identities[name] = blob.identity()
            return md
        finally:
            blob.close()
