"""The layout of a Hugging Face checkpoint directory: safetensors shards and their index.

``save_pretrained`` writes ``model-0000i-of-0000N.safetensors`` files and ``model.safetensors.index.json``
(``{"metadata": {...}, "weight_map": {tensor name: shard file}}``), or one ``model.safetensors`` without an index.
A shard is an 8-byte little-endian header length, a JSON header (``{name: {"dtype", "shape", "data_offsets"}}``,
with an optional ``"__metadata__"`` of strings), then the tensors' bytes as they are in memory.

Every tensor is one whole chunk stored as it is in memory, so a load reads each rank's rows straight from the
shard. The headers are held to safetensors' own rules and more: a bounded header of one JSON object with no key
twice, known dtypes, sizes that match shape times dtype, tensors that tile the data area exactly (no gap, no
overlap, nothing past the end); and the index to the headers: every tensor it names is in the shard it names and
nowhere else, every shard it names is a regular file in the directory, and no shard holds a tensor it does not
list.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from .. import knobs
from ..errors import CheckpointError, CorruptCheckpointError
from ..format import METADATA_FILE
from ..format.dtypes import ITEMSIZE
from ..format.records import FileInfo, ForeignStorageData, StorageInfo
from ..metadata import ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata
from .checks import MAX_DIM, check_layout

__all__ = ["HF_INDEX_SUFFIX", "SINGLE_FILE", "ShardHeader", "parse_index", "parse_shard_header", "find_index",
           "hf_layout", "is_hf_listing", "is_hf_directory", "shard_names"]

HF_INDEX_SUFFIX = ".safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
           "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
           "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn,
           "F8_E5M2": torch.float8_e5m2}
_SHARD_NAME = re.compile(r"[^/\\\0]+\.safetensors")
_MAX_KEY = 4096


@dataclass(frozen=True)
class ShardHeader:
    """A shard's tensors: name -> (dtype, shape, absolute offset of its bytes, length), and its ``__metadata__``."""

    tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]
    metadata: dict[str, str]
    data_start: int


def _no_duplicates(pairs: list) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r:.100} appears twice")
        out[key] = value
    return out


def _json(raw: bytes, where: str) -> Any:
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise CorruptCheckpointError(f"{where}: the JSON nests too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({exc})") from None


def parse_index(raw: bytes, where: str) -> dict[str, str]:
    """The ``weight_map`` of an index file's bytes: tensor name -> shard file name (a plain ``*.safetensors`` name)."""
    if len(raw) > knobs.max_metadata_bytes():
        raise CorruptCheckpointError(f"{where}: {len(raw)} bytes, over the cap of {knobs.max_metadata_bytes()} "
                                     "(DISTCKPT_MAX_METADATA_BYTES)")
    doc = _json(raw, where)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CorruptCheckpointError(f"{where}: an index needs a non-empty \"weight_map\" of tensor names to shard files")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not _SHARD_NAME.fullmatch(shard) or shard.startswith("."):
            raise CorruptCheckpointError(
                f"{where}: tensor {name!r:.200} is mapped to {shard!r:.200}, which is not the name of a .safetensors file "
                "inside the checkpoint's directory; an index may not point elsewhere")
        if not name or len(name) > _MAX_KEY or "\0" in name:
            raise CorruptCheckpointError(f"{where}: a tensor name of {len(name)} characters, or holding NUL: {name[:100]!r}")
    return weight_map


def parse_shard_header(pread: Callable[[int, int], bytes], file_size: int, where: str) -> ShardHeader:
    """The header of a safetensors file of ``file_size`` bytes that ``pread(n, offset)`` reads, checked whole."""
    if file_size < 8:
        raise CorruptCheckpointError(f"{where}: {file_size} bytes, too short for a safetensors file; it is truncated")
    (n,) = struct.unpack("<Q", pread(8, 0).ljust(8, b"\0"))
    cap = knobs.max_header_bytes()
    if n > min(cap, file_size - 8):
        raise CorruptCheckpointError(f"{where}: the header claims {n} bytes, but the file holds {file_size - 8} after "
                                     f"its length and the cap is {cap} (DISTCKPT_MAX_HEADER_BYTES); it is truncated or not "
                                     "a safetensors file")
    raw = pread(n, 8)
    if len(raw) != n:
        raise CorruptCheckpointError(f"{where}: the header ends after {len(raw)} of its {n} bytes; the file is truncated")
    doc = _json(raw, where)  # decided by parsing: any valid JSON object, however spaced, is a header
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: the header is not a JSON object; not a safetensors file")
    meta = doc.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptCheckpointError(f"{where}: \"__metadata__\" must map strings to strings")
    start = 8 + n
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
    spans = []
    for name, entry in doc.items():
        here = f"{where}, tensor {name!r:.200}"
        if not name or len(name) > _MAX_KEY or "\0" in name:
            raise CorruptCheckpointError(f"{where}: a tensor name of {len(name)} characters, or holding NUL: {name[:100]!r}")
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise CorruptCheckpointError(f"{here}: an entry needs exactly \"dtype\", \"shape\" and \"data_offsets\"")
        code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(code, str) or code not in _DTYPES:
            raise CorruptCheckpointError(f"{here}: dtype {code!r:.40} is not one of {sorted(_DTYPES)}")
        if not isinstance(shape, list) or len(shape) > 64 or not all(type(d) is int and 0 <= d <= MAX_DIM for d in shape):
            raise CorruptCheckpointError(f"{here}: shape {shape!r:.200} is not a list of sizes")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise CorruptCheckpointError(f"{here}: data_offsets {offsets!r:.100} is not a pair begin <= end")
        nbytes = math.prod(shape) * ITEMSIZE[code]
        if offsets[1] - offsets[0] != nbytes:
            raise CorruptCheckpointError(f"{here}: {code} of shape {shape} is {nbytes} bytes, but data_offsets {offsets} "
                                         f"hold {offsets[1] - offsets[0]}")
        tensors[name] = (_DTYPES[code], tuple(shape), start + offsets[0], nbytes)
        spans.append((offsets[0], offsets[1], name))
    spans.sort()
    end = 0
    for begin, stop, name in spans:
        if begin != end:
            raise CorruptCheckpointError(
                f"{where}: tensor {name!r:.200} starts at data byte {begin}, but the one before it ends at {end}: the "
                f"tensors {'overlap' if begin < end else 'leave a gap'}; the file is damaged or forged")
        end = stop
    if start + end != file_size:
        raise CorruptCheckpointError(f"{where}: the tensors end at byte {start + end}, but the file holds {file_size}: it is "
                                     f"{'truncated' if start + end > file_size else 'longer than its header says'}")
    return ShardHeader(tensors, meta, start)


def find_index(names: list[str], where: str) -> Optional[str]:
    """The index file among a directory's ``names``: the one ``*.safetensors.index.json``; None where there is
    none (a single ``model.safetensors``)."""
    indexes = sorted(n for n in names if n.endswith(HF_INDEX_SUFFIX))
    if len(indexes) > 1:
        raise CheckpointError(f"{where}: holds several indexes {indexes}; pass the one to load, "
                              "HuggingFaceReader(path, index=name)")
    return indexes[0] if indexes else None


def is_hf_listing(names: list[str]) -> bool:
    """Whether a directory listing looks like a Hugging Face checkpoint (an index, or ``model.safetensors``)."""
    return METADATA_FILE not in names and (SINGLE_FILE in names or any(n.endswith(HF_INDEX_SUFFIX) for n in names))


def is_hf_directory(checkpoint_id: Union[str, os.PathLike, None]) -> bool:
    """A local directory holding a Hugging Face checkpoint (an index or ``model.safetensors``), no distckpt metadata."""
    if checkpoint_id is None:
        return False
    path = os.fspath(checkpoint_id)
    if path.startswith("hf://"):
        return True
    if not isinstance(path, str) or "://" in path or not os.path.isdir(path):
        return False
    try:
        return is_hf_listing(os.listdir(path))
    except OSError:
        return False


def hf_layout(weight_map: Optional[dict[str, str]], headers: dict[str, ShardHeader], file_sizes: dict[str, int],
              where: str, checkpoint_id: Optional[str], load_id: str) -> Metadata:
    """The metadata of an HF checkpoint from its index (None: one file) and the parsed header of every shard."""
    sdm: dict[str, Any] = {}
    items: dict[MetadataIndex, StorageInfo] = {}
    for shard, header in sorted(headers.items()):
        for name, (dtype, shape, offset, nbytes) in header.tensors.items():
            listed = weight_map.get(name) if weight_map is not None else shard
            if listed != shard:
                raise CorruptCheckpointError(
                    f"{where}: shard {shard!r} holds tensor {name!r}, which the index "
                    f"{'places in ' + repr(listed) if listed else 'does not list'}; the index and the shards disagree")
            if name in sdm:
                raise CorruptCheckpointError(f"{where}: tensor {name!r} is stored twice")
            size = torch.Size(shape)
            sdm[name] = TensorStorageMetadata(TensorProperties(dtype), size, [ChunkStorageMetadata(torch.Size([0] * len(shape)), size)])
            items[MetadataIndex(name, torch.Size([0] * len(shape)))] = StorageInfo(shard, offset, nbytes, None)
    if weight_map is not None:
        for name, shard in weight_map.items():
            if name not in sdm:
                raise CorruptCheckpointError(f"{where}: the index places tensor {name!r} in {shard!r}, whose header does not "
                                             "list it; the index and the shards disagree")
    files = {name: FileInfo(file_sizes[name], 0, 0) for name in headers}
    fsd = ForeignStorageData("", files, items, layout="Hugging Face safetensors", every_key=True)
    md = Metadata(state_dict_metadata=sdm, storage_data=fsd,
                  storage_meta=StorageMeta(checkpoint_id=checkpoint_id, load_id=load_id))
    check_layout(md, where)
    return md


def shard_names(weight_map: Optional[dict[str, str]]) -> list[str]:
    """The shard files an index names (or the single file)."""
    return sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_FILE]

