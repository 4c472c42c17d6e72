"""Where each tensor of a Hugging Face sharded checkpoint goes, decided before a byte is written.

A publish from N ranks writes every tensor's rows straight into its place in the output shards, so the whole
layout is fixed first, from the global shapes and dtypes alone: which shard holds each tensor (``save_pretrained``'s
rule: tensors in order, a new shard when the next one would pass ``max_shard_size``, a larger tensor alone), each
shard's header, and each tensor's byte offset in its file. Within a shard, tensors are laid out as safetensors' own
writer does (larger element sizes first, then by name), after a header padded with spaces to 8 bytes: every
tensor's bytes start on a multiple of its element size. :func:`runs` turns a chunk of a tensor (a rank's rows, or a
column block) into the contiguous byte runs it covers in the file.

This module is pure: no I/O, no collectives.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import torch

from ..errors import CheckpointError, UnsupportedTensorError
from ..format.dtypes import itemsize
from .hf import _DTYPES, _MAX_KEY, HF_INDEX_SUFFIX, SINGLE_FILE

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "INDEX_FILE", "ShardedLayout", "parse_size", "plan_shards", "runs", "dtype_code"]

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # save_pretrained's default, "5GB"
INDEX_FILE = "model" + HF_INDEX_SUFFIX
_CODES = {dtype: code for code, dtype in _DTYPES.items()}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


def parse_size(size: Union[int, str]) -> int:
    """A byte count from an int or a string as ``save_pretrained`` takes it ("5GB" is 5 * 10**9, "500MiB" 500 * 2**20)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = _SIZE.fullmatch(str(size))
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise CheckpointError(f"max_shard_size {size!r}: not a size; give bytes as an int, or a string such as "
                                  "'5GB', '500MB' or '2GiB'")
        number = float(match.group(1))
        if not math.isfinite(number):  # a digit string too long for a float: "999...9GB"
            raise CheckpointError(f"max_shard_size {str(size)[:40]!r}...: a number too large for a size")
        value = int(number * _UNITS[unit])
    if value <= 0:
        raise CheckpointError(f"max_shard_size {size!r}: must be a positive number of bytes")
    return value


def dtype_code(fqn: str, dtype: torch.dtype) -> str:
    """The safetensors dtype code of ``dtype``; UnsupportedTensorError naming the key where safetensors has none."""
    code = _CODES.get(dtype)
    if code is None:
        raise UnsupportedTensorError(f"key {fqn!r}: dtype {dtype} has no safetensors code (safetensors stores "
                                     f"{', '.join(sorted(_CODES.values()))}); convert the tensor before publishing it")
    return code


@dataclass(frozen=True)
class ShardedLayout:
    """Every tensor's place: ``files`` maps a shard's name to (its header bytes, its size); ``placement`` maps a
    tensor to (its shard, the absolute offset of its first byte); ``index`` is the index document (None for one
    shard, which is then ``model.safetensors``)."""

    files: dict[str, tuple[bytes, int]]
    placement: dict[str, tuple[str, int]]
    index: Optional[bytes]
    total_bytes: int


def plan_shards(tensors: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], max_shard_size: int,
                metadata: Optional[dict[str, str]] = None, assignment: Optional[dict[str, int]] = None) -> ShardedLayout:
    """The layout of ``tensors`` (name, dtype, global shape; in the order a state dict lists them) in shards of at
    most ``max_shard_size`` bytes of tensor data each (a larger tensor gets a shard of its own, as in
    ``save_pretrained``), or in the shards
    ``assignment`` gives (tensor name -> shard number from 1, DCP's ``fqn_to_index_mapping``; every shard named
    ``model-0000i-of-0000N``, with an index)."""
    meta = {**(metadata or {}), "format": "pt"}
    _check_names(tensors)
    if assignment is not None:
        return _assigned(tensors, assignment, meta)
    # huggingface_hub's split, which save_pretrained uses: a tensor larger than a shard becomes a shard of its own
    # at once, and the shard being filled goes on filling after it
    groups: list[list[tuple[str, torch.dtype, tuple[int, ...], int]]] = []
    current: list[tuple[str, torch.dtype, tuple[int, ...], int]] = []
    used = 0
    for name, dtype, shape in tensors:
        nbytes = math.prod(shape) * itemsize(dtype)
        entry = (name, dtype, tuple(shape), nbytes)
        if nbytes > max_shard_size:
            groups.append([entry])
            continue
        if used + nbytes > max_shard_size:
            groups.append(current)
            current, used = [], 0
        current.append(entry)
        used += nbytes
    if current or not groups:
        groups.append(current)
    count = len(groups)
    names = [SINGLE_FILE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    return _layout(tensors, names, groups, meta, indexed=count > 1)


def _check_names(tensors: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
    """Every name a safetensors header can hold, once, with a dtype it has a code for: whichever way the shards are
    chosen (by size or by a mapping), a header never gets a key its readers refuse or that overwrites another."""
    seen: set = set()
    for name, dtype, _ in tensors:
        if name in seen:
            raise CheckpointError(f"key {name!r} appears twice among the tensors to publish")
        seen.add(name)
        if not isinstance(name, str) or not name or len(name) > _MAX_KEY or name == "__metadata__" or "\0" in name:
            raise CheckpointError(f"key {str(name)[:100]!r}: not a name a safetensors header can hold (empty, longer than "
                                  f"{_MAX_KEY} characters, holding NUL, or \"__metadata__\"); rename it before publishing")
        dtype_code(name, dtype)


def _assigned(tensors: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], assignment: dict[str, int], meta: dict) -> ShardedLayout:
    unplaced = [name for name, _, _ in tensors if name not in assignment]
    if unplaced:
        raise CheckpointError(f"fqn_to_index_mapping gives no shard for key(s) {unplaced[:5]}; map every tensor to a shard number")
    wrong = [assignment[name] for name, _, _ in tensors if type(assignment[name]) is not int or assignment[name] < 1]
    if wrong:
        raise CheckpointError(f"fqn_to_index_mapping: shard numbers are ints from 1, got {wrong[:5]}")
    numbers = sorted(set(assignment[name] for name, _, _ in tensors))
    count = max(numbers)
    # only the shards that hold a tensor: a number is a file's name, not a count of files (DCP names them so too)
    groups: dict[int, list] = {n: [] for n in numbers}
    for name, dtype, shape in tensors:
        groups[assignment[name]].append((name, dtype, tuple(shape), math.prod(shape) * itemsize(dtype)))
    names = [f"model-{n:05d}-of-{count:05d}.safetensors" for n in numbers]
    return _layout(tensors, names, [groups[n] for n in numbers], meta, indexed=True)


def _layout(tensors: Sequence, names: list[str], groups: list[list], meta: dict, indexed: bool) -> ShardedLayout:
    files, placement, weight_map = {}, {}, {}
    for file_name, group in zip(names, groups):
        header, data_start, offsets = _header(group, meta)
        for name, offset in offsets.items():
            placement[name] = (file_name, data_start + offset)
            weight_map[name] = file_name
        files[file_name] = (header, data_start + sum(g[3] for g in group))
    total = sum(math.prod(s) * itemsize(d) for _, d, s in tensors)
    index = None
    if indexed:
        index = json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                           indent=2).encode() + b"\n"
    return ShardedLayout(files, placement, index, total)


def _header(group: list, meta: dict[str, str]) -> tuple[bytes, int, dict[str, int]]:
    """A shard's bytes before its data (length, JSON header padded to 8 bytes), where its data starts, and each
    tensor's offset within the data."""
    order = sorted(group, key=lambda g: (-itemsize(g[1]), g[0]))
    doc: dict = {"__metadata__": meta}
    offsets, at = {}, 0
    for name, dtype, shape, nbytes in order:
        doc[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [at, at + nbytes]}
        offsets[name] = at
        at += nbytes
    raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    header = len(raw).to_bytes(8, "little") + raw
    return header, len(header), offsets


def runs(global_shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int], width: int) -> tuple[np.ndarray, int]:
    """The contiguous byte runs of the chunk at ``offsets`` of ``sizes`` in a row-major tensor of ``global_shape``
    with elements of ``width`` bytes: (the byte offset of each run from the tensor's first byte, in the chunk's own
    row-major order; the length of every run in bytes). The chunk's bytes, row-major, are these runs back to back."""
    n = len(global_shape)
    if math.prod(sizes) == 0:
        return np.zeros(0, dtype=np.int64), 0
    k = n - 1  # the outermost dimension from which the chunk is one run: every dimension after it is whole
    while k > 0 and sizes[k] == global_shape[k]:
        k -= 1
    strides = [1] * n
    for d in range(n - 2, -1, -1):
        strides[d] = strides[d + 1] * global_shape[d + 1]
    if n == 0:
        return np.zeros(1, dtype=np.int64), width
    length = sizes[k] * strides[k] * width
    start = np.zeros(1, dtype=np.int64) + sum(o * s for o, s in zip(offsets, strides)) * width
    for d in range(k):  # runs over the outer dimensions, the last of them fastest
        start = (start[:, None] + np.arange(sizes[d], dtype=np.int64)[None, :] * (strides[d] * width)).reshape(-1)
    return start, length
