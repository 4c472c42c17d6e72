"""Reading a Hugging Face checkpoint directory (safetensors shards and their index) straight into any state dict,
sharded or not: each rank reads the rows it holds, from disk or ``s3://``. The layout (distckpt.layouts.hf) holds
the files to safetensors' rules and the index to the files; this reader reads them through distckpt's engine."""

from __future__ import annotations

import os
from typing import Any, Optional, Union

from .. import knobs
from ..engine.blobs import BlobStore
from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..layouts.hf import SINGLE_FILE, find_index, hf_layout, is_hf_directory, parse_index, parse_shard_header, shard_names
from ..metadata import Metadata
from .foreign import LayoutReader

__all__ = ["HuggingFaceReader"]


class HuggingFaceReader(LayoutReader):
    """Reads a directory that ``save_pretrained`` (or safetensors) wrote: ``*.safetensors`` shards and
    ``model.safetensors.index.json``, or one ``model.safetensors``.

    ``distckpt.load(state_dict, checkpoint_id=path)`` picks it for such a directory (or ``hf://path``).
    Keys are the checkpoint's tensor names; every tensor of the checkpoint must have a place in the state dict
    (pass ``planner=DefaultLoadPlanner(allow_unexpected_keys=True)`` to skip the rest), and stored dtypes load into
    other dtypes only with ``allow_dtype_conversion=True``.

    Args:
        path: the directory (``hf://`` prefix optional), or ``s3://bucket/prefix``.
        index: the index file's name, where the directory holds several.
    """

    kind = "Hugging Face"

    def __init__(self, path: Union[str, os.PathLike, None] = None, *, index: Optional[str] = None, **options: Any):
        super().__init__(_strip(path), **options)
        self.index = index

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        super().reset(_strip(checkpoint_id))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return is_hf_directory(checkpoint_id)

    def describe(self, store: BlobStore, sizes: dict[str, int]) -> Metadata:
        index = self.index if self.index is not None else find_index(sorted(sizes), self.where())
        if index is None and SINGLE_FILE not in sizes:
            raise CheckpointNotFoundError(f"{self.where()} holds no *.safetensors.index.json and no {SINGLE_FILE} (as regular "
                                          "files): it is not a Hugging Face checkpoint directory")
        weight_map = None
        if index is not None:
            weight_map = parse_index(self.read_small(store, index, knobs.max_metadata_bytes(), sizes), f"{self.where()}, {index}")
        headers, identities = {}, {}
        for shard in shard_names(weight_map):
            if shard not in sizes:
                raise CorruptCheckpointError(
                    f"{self.where()}: the index names shard {shard!r}, which is missing or not a regular file (a symbolic "
                    "link is not followed: for a Hugging Face cache snapshot, whose files are links, download with "
                    "huggingface_hub.snapshot_download(local_dir=...), which writes real files)")
            blob = store.open(shard)
            try:
                if blob.size != sizes[shard]:
                    raise CorruptCheckpointError(f"{self.where()}: shard {shard!r} changed while it was read")
                headers[shard] = parse_shard_header(blob.pread, blob.size, f"{self.where()}, shard {shard!r}")
                identities[shard] = blob.identity()
            finally:
                blob.close()
        md = hf_layout(weight_map, headers, sizes, self.where(), self.path, self.load_id)
        md.storage_data.identities.update(identities)
        return md


def _strip(path: Union[str, os.PathLike, None]) -> Optional[str]:
    if path is None:
        return None
    path = os.fspath(path)
    return path[len("hf://"):] if path.startswith("hf://") else path
