"""A step of the local tier as tensors that view its files' pages, for persisting it without a copy.

Persisting writes a step from the node's tier to the durable tier. Loading it first into fresh host tensors costs
a copy of the state and, on hosts that back memory lazily, the first touch of as many fresh pages; the tier's
files are already in memory (a tmpfs), so each tensor is mapped from its file instead, after its bytes pass their
CRC-32C: a flipped bit in the tier is never written to the durable tier under a new, valid checksum. An item
whose offset in its file is not a multiple of its element size (the writer puts odd-sized items last) is copied.

The tier's files are the manager's own and never rewritten in place: removing a step while it is mapped only
unlinks its files, and the pages stay until the tensors go.
"""

from __future__ import annotations

import mmap
from typing import Any

import torch

from ..backends.filesystem import FsStore
from ..engine.blobs import MAPS
from ..errors import CorruptCheckpointError
from ..format.checksum import crc32c
from ..format.records import FileStorageData, StorageInfo
from ..loading import load, read_metadata
from ..metadata import Metadata, MetadataIndex, TensorStorageMetadata
from ..planning.flatten import flatten_state_dict, get_element, set_element

__all__ = ["map_step"]


def map_step(path: str, view: dict[str, Any], dtensors: dict[int, Any]) -> bool:
    """Fill ``view`` (a local view whose tensors are placeholders of the right shape and dtype, e.g. on the meta
    device) from the step at ``path``: each tensor becomes a verified view of the step's pages, every other value
    is loaded. ``dtensors`` (keyed by ``id`` of a placeholder) is re-keyed to the tensors that replace them.

    Returns False, and changes nothing, where some tensor cannot be mapped whole (stored in several chunks, with
    a codec, of another shape, or inside a tuple): the caller then loads the step into host tensors.
    Raises CorruptCheckpointError, naming the key and file, where bytes fail their checksum."""
    md = read_metadata(path)
    flat, mappings = flatten_state_dict(view)
    places = {fqn: _place(md, fqn, value) for fqn, value in flat.items() if isinstance(value, torch.Tensor)}
    if not all(places.values()) or any(isinstance(get_element(view, mappings[fqn][:-1]), tuple) for fqn in places):
        return False
    store = FsStore(path)
    if MAPS not in store.capabilities:
        return False
    maps: dict[str, mmap.mmap] = {}
    mapped = {}
    for fqn, info in places.items():
        if info.file not in maps:
            maps[info.file] = store.map(info.file, md.storage_data.files[info.file].size)
        data = torch.frombuffer(maps[info.file], dtype=torch.uint8)[info.offset:info.offset + info.length]
        got = crc32c(memoryview(data.numpy()))
        if got != info.crc32c:
            raise CorruptCheckpointError(f"{path!r}: the bytes of {fqn!r} in file {info.file!r} at offset {info.offset} "
                                         f"fail their checksum (stored {info.crc32c:08x}, computed {got:08x}); the "
                                         "node's tier is damaged, so this step cannot be persisted from it")
        template = flat[fqn]
        if info.offset % template.element_size():  # an odd-sized item the writer placed after the aligned ones
            copy = torch.empty(template.shape, dtype=template.dtype)
            copy.reshape(-1).view(torch.uint8).copy_(data)
            mapped[fqn] = copy
        else:
            mapped[fqn] = data.view(template.dtype).reshape(template.shape)
    rest = {fqn: value for fqn, value in flat.items() if fqn not in mapped}
    if rest:
        load(rest, checkpoint_id=path, no_dist=True)
    for fqn, path_ in mappings.items():
        if fqn in mapped:
            set_element(view, path_, mapped[fqn])
            if id(flat[fqn]) in dtensors:
                dtensors[id(mapped[fqn])] = dtensors.pop(id(flat[fqn]))
        else:
            set_element(view, path_, rest[fqn])
    return True


def _place(md: Metadata, fqn: str, template: torch.Tensor) -> StorageInfo | None:
    """Where ``fqn`` lies whole and as it is in memory, if it does."""
    entry = md.state_dict_metadata.get(fqn)
    data = md.storage_data
    if not isinstance(entry, TensorStorageMetadata) or not isinstance(data, FileStorageData) or len(entry.chunks) != 1:
        return None
    chunk = entry.chunks[0]
    info = data.items.get(MetadataIndex(fqn, chunk.offsets))
    whole = tuple(chunk.sizes) == tuple(template.shape) == tuple(entry.size) and not any(chunk.offsets)
    if (info is None or info.codec != "identity" or not whole or entry.properties.dtype != template.dtype
            or info.length != template.numel() * template.element_size() or info.file not in data.files
            or not 0 < info.offset + info.length <= data.files[info.file].size):
        return None
    return info
