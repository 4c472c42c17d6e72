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
from .filesystem import FsStore
from .foreign import LayoutReader

__all__ = ["TorchSaveReader", "is_torch_save_file"]

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
        return FsStore(os.path.dirname(os.path.abspath(self.path)))

    def describe(self, store: BlobStore, sizes: dict[str, int]) -> Metadata:
        name = os.path.basename(self.path)
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
