"""How many bytes a checkpoint stores itself, how many it references in other checkpoints of its run, and how much
its items shrank through codecs: what ``distckpt steps`` and ``verify`` report per step."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .format.dtypes import itemsize
from .format.locations import ChunkLocations
from .format.records import FileStorageData, split_reference
from .metadata import Metadata, MetadataIndex, TensorStorageMetadata

__all__ = ["StoredBytes", "stored_bytes"]


@dataclass(frozen=True)
class StoredBytes:
    """The stored bytes of a checkpoint's items: in its own data files (``written``), in data files of other
    checkpoints of its run (``referenced``, an incremental save's); and their bytes once decoded (``decoded``)."""

    written: int = 0
    referenced: int = 0
    decoded: int = 0

    @property
    def stored(self) -> int:
        return self.written + self.referenced

    @property
    def compression_ratio(self) -> float:
        """Decoded bytes per stored byte (1.0 where nothing went through a codec)."""
        return self.decoded / self.stored if self.stored else 1.0


def stored_bytes(md: Metadata) -> StoredBytes:
    """:class:`StoredBytes` of the checkpoint ``md`` describes (zeros where it has no distckpt file table)."""
    fsd = md.storage_data
    if not isinstance(fsd, FileStorageData):
        return StoredBytes()
    items = fsd.items
    if isinstance(items, ChunkLocations):
        referencing = np.array([split_reference(name) is not None for name, _ in items.file_list], dtype=bool)
        file_no = np.frombuffer(items.file_no, dtype=np.int64)
        length = np.frombuffer(items.length, dtype=np.int64)
        elsewhere = referencing[file_no] if len(file_no) else np.zeros(0, dtype=bool)
        referenced, total = int(length[elsewhere].sum()), int(length.sum())
    else:
        referenced = sum(si.length for si in items.values() if split_reference(si.file) is not None)
        total = sum(si.length for si in items.values())
    decoded = 0
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            decoded += sum(math.prod(c.sizes) for c in entry.chunks) * itemsize(entry.properties.dtype)
        else:  # a value's decoded size is not recorded: its stored bytes stand for it
            decoded += items[MetadataIndex(fqn)].length
    return StoredBytes(total - referenced, referenced, decoded)
