"""The checks every layout's output passes before a load plans on it: the rules distckpt's own format is held to.

A layout describes another program's checkpoint as :class:`~distckpt.metadata.Metadata` plus the place of every
item (:class:`~distckpt.format.records.ForeignStorageData`). Nothing that program wrote is trusted: every tensor's
chunks must lie inside it and cover it exactly once, every chunk and value must have exactly one stored item,
every item must lie inside its file, an item stored as it is in memory must hold exactly its chunk's bytes, and
``planner_data`` may name only keys the checkpoint has, with list positions no larger than it could hold.
"""

from __future__ import annotations

import math

import torch

from ..errors import CorruptCheckpointError
from ..format.dtypes import itemsize
from ..format.locations import check_cover, check_no_overlap, checked_chunk
from ..format.records import ForeignStorageData
from ..metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

__all__ = ["check_layout", "check_planner_data", "MAX_DIM"]

MAX_DIM = (1 << 62) - 1  # a dimension, offset or element count past this is no tensor a process can hold
_MAX_NDIM = 64


def _dims(values, what: str, here: str) -> tuple[int, ...]:
    dims = tuple(values)
    if len(dims) > _MAX_NDIM or not all(type(d) is int and 0 <= d <= MAX_DIM for d in dims):
        raise CorruptCheckpointError(f"{here}: {what} {list(dims)[:8]} is not a list of at most {_MAX_NDIM} sizes in "
                                     f"0..{MAX_DIM}; the checkpoint is damaged or forged")
    return dims


def check_layout(md: Metadata, where: str, shared_bytes: bool = False) -> None:
    """Raise CorruptCheckpointError, naming the key or file, where ``md`` breaks a rule of the module docstring.

    ``shared_bytes``: items may share bytes of a file (a torch.save file's tensors that view one storage)."""
    fsd = md.storage_data
    if not isinstance(fsd, ForeignStorageData):
        raise CorruptCheckpointError(f"{where}: the layout gave no table of stored items")
    for name, info in fsd.files.items():
        if not isinstance(name, str) or not name or "/" in name or name in (".", "..") or "\0" in name:
            raise CorruptCheckpointError(f"{where}: the file {name!r} is not a plain name inside the checkpoint's directory")
        if type(info.size) is not int or info.size < 0:
            raise CorruptCheckpointError(f"{where}, file {name!r}: size {info.size!r}")
    expected = 0
    for fqn, entry in md.state_dict_metadata.items():
        here = f"{where}: key {fqn!r}"
        if isinstance(entry, BytesStorageMetadata):
            if MetadataIndex(fqn) not in fsd.items:
                raise CorruptCheckpointError(f"{here}: the value has no stored item")
            expected += 1
            continue
        if not isinstance(entry, TensorStorageMetadata) or not isinstance(entry.properties.dtype, torch.dtype):
            raise CorruptCheckpointError(f"{here}: metadata of type {type(entry).__name__} is neither a tensor's nor a value's")
        size = torch.Size(_dims(entry.size, "the size", here))
        element = itemsize(entry.properties.dtype)
        for chunk in entry.chunks:
            _dims(chunk.offsets, "a chunk's offsets", here)
            _dims(chunk.sizes, "a chunk's sizes", here)
            checked_chunk(chunk, size, here)
            info = fsd.items.get(MetadataIndex(fqn, chunk.offsets))
            if info is None:
                raise CorruptCheckpointError(f"{here}: chunk {list(chunk.offsets)} has no stored item")
            nbytes = math.prod(chunk.sizes) * element
            if info.codec == "identity" and info.length != nbytes:
                raise CorruptCheckpointError(
                    f"{here}: chunk {list(chunk.offsets)}+{list(chunk.sizes)} of {entry.properties.dtype} is {nbytes} bytes, "
                    f"but its stored item in file {info.file!r} is {info.length}; the checkpoint is damaged or forged")
        check_cover(entry.chunks, size, here)
        expected += len(entry.chunks)
    for index, info in fsd.items.items():
        file = fsd.files.get(info.file)
        if file is None:
            raise CorruptCheckpointError(f"{where}: key {index.fqn!r} is stored in {info.file!r}, which the checkpoint lacks")
        if not (type(info.offset) is int and type(info.length) is int and 0 <= info.offset
                and 0 <= info.length and info.offset + info.length <= file.size):
            raise CorruptCheckpointError(
                f"{where}: key {index.fqn!r} is stored at bytes {info.offset}..{info.offset + info.length} of file "
                f"{info.file!r}, which holds {file.size} bytes; the file is truncated or the checkpoint forged")
    if expected != len(fsd.items):
        raise CorruptCheckpointError(f"{where}: {len(fsd.items)} stored items for {expected} chunks and values; some item "
                                     "belongs to no key")
    if not shared_bytes:
        check_no_overlap(fsd.items, fsd.files, where)
    check_planner_data(md, where)


def check_planner_data(md: Metadata, where: str) -> None:
    """``planner_data`` (key -> path in the nested state dict) names only keys of the checkpoint, with paths of
    strings and list positions below the number of keys: a list cannot hold more elements than there are keys."""
    mappings = md.planner_data
    if mappings is None:
        return
    if not isinstance(mappings, dict):
        raise CorruptCheckpointError(f"{where}: planner_data is a {type(mappings).__name__}, not a mapping of keys to paths")
    keys = len(md.state_dict_metadata)
    for fqn, path in mappings.items():
        if fqn not in md.state_dict_metadata:
            raise CorruptCheckpointError(f"{where}: planner_data names key {fqn!r}, which the checkpoint lacks")
        if not isinstance(path, tuple) or not path or len(path) > _MAX_NDIM or not all(
                type(p) is str or (type(p) is int and 0 <= p < keys) for p in path):
            raise CorruptCheckpointError(
                f"{where}: planner_data gives key {fqn!r} the path {path!r:.200}: a path is a tuple of names and list "
                f"positions below {keys} (the number of keys); the checkpoint is damaged or forged")
