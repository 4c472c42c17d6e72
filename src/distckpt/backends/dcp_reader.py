"""Reading a checkpoint directory that torch.distributed.checkpoint (DCP) wrote, so ``distckpt.load`` takes it as
it is, with resharding, and a run migrates without a conversion step. The layout (distckpt.layouts.dcp) says
what is trusted and how; this reader reads it through distckpt's engine."""

from __future__ import annotations

import os
from typing import Any, Union

from .. import knobs
from ..engine.blobs import BlobStore
from ..errors import CheckpointNotFoundError
from ..layouts.dcp import DCP_METADATA_FILE, dcp_layout, is_dcp_directory, parse_dcp_metadata
from ..metadata import Metadata
from .foreign import LayoutReader

__all__ = ["DCPReader", "is_dcp_directory"]


class DCPReader(LayoutReader):
    """Reads a checkpoint directory written by torch.distributed.checkpoint's FileSystemWriter.

    ``distckpt.load(state_dict, checkpoint_id=path)`` picks it for such a directory; pass it as
    ``storage_reader=`` to choose it explicitly (an ``s3://`` prefix DCP wrote, say). ``_extension_registry``
    rebuilds DCP's stream extensions, as with DCP (default: one that knows ZStandard).
    """

    kind = "DCP"

    def __init__(self, path: Union[str, os.PathLike, None] = None, *, _extension_registry: Any = None, **options: Any):
        super().__init__(path, **options)
        self.extension_registry = _extension_registry

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return is_dcp_directory(checkpoint_id)

    def describe(self, store: BlobStore, sizes: dict[str, int]) -> Metadata:
        if DCP_METADATA_FILE not in sizes:
            raise CheckpointNotFoundError(f"{self.where()} has no {DCP_METADATA_FILE} (or it is not a regular file): it is "
                                          "not a DCP checkpoint, or its save never finished")
        raw = self.read_small(store, DCP_METADATA_FILE, knobs.max_metadata_bytes(), sizes)
        dcp_md = parse_dcp_metadata(raw, self.where())
        return dcp_layout(dcp_md, sizes, self.where(), self.path, self.load_id, self.extension_registry)
