"""diff(): what differs between two checkpoints, key by key, reading as few bytes as it can.

Keys added or removed, and a tensor's shape, dtype or kind (tensor or value) changed, come from the metadata
alone. A tensor stored with the same chunking on both sides as plain bytes (identity codec) is compared by the
CRC-32C each chunk records: a differing checksum proves a difference, and equal checksums are reported as "same
by checksum" (``exact=True`` reads the bytes to confirm). Anything else is read and compared bit for bit,
streaming within DISTCKPT_MEMORY_BUDGET_BYTES: chunk against chunk where the chunkings agree, otherwise in
blocks of rows cut at chunk boundaries where they fit (checkpoints saved at different world sizes). Values are
compared by their decoded value.
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from . import knobs
from .errors import UnsafeValueError
from .format.values import decode_value
from .metadata import MetadataIndex, TensorStorageMetadata
from .opening import LazyTensor, OpenCheckpoint, open
from .planning.slices import row_blocks

__all__ = ["diff", "DiffReport"]

CHECKSUM, BYTES, VALUE = "checksum", "bytes", "value"


@dataclass
class DiffReport:
    """What :func:`diff` found. ``changed``: keys whose kind, shape or dtype differ (``{"key", "a", "b"}``, each
    side described); ``differ``: keys whose contents differ (``{"key", "decided_by"}``, and for tensors compared
    by bytes ``"elements"``, how many differ); ``same``: the rest (``{"key", "decided_by"}``: ``"checksum"`` means
    equal CRC-32Cs, not bytes read). ``bytes_read``: chunk and value bytes read from each side."""

    a: str
    b: str
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: list[dict] = field(default_factory=list)
    differ: list[dict] = field(default_factory=list)
    same: list[dict] = field(default_factory=list)
    bytes_read: dict = field(default_factory=dict)

    @property
    def identical(self) -> bool:
        return not (self.added or self.removed or self.changed or self.differ)

    def to_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "identical": self.identical, "added": self.added, "removed": self.removed,
                "changed": self.changed, "differ": self.differ, "same": self.same, "bytes_read": self.bytes_read}


def diff(a: Union[str, os.PathLike], b: Union[str, os.PathLike], *, exact: bool = False) -> DiffReport:
    """Compare checkpoints ``a`` and ``b`` (any ids ``distckpt.open`` takes), without a process group."""
    report = DiffReport(os.fspath(a), os.fspath(b))
    with open(a) as left, open(b) as right:
        keys_a, keys_b = set(left), set(right)
        report.removed = sorted(keys_a - keys_b)
        report.added = sorted(keys_b - keys_a)
        for key in sorted(keys_a & keys_b):
            _compare_key(key, left, right, exact, report)
        report.bytes_read = {"a": left.bytes_read, "b": right.bytes_read}
    return report


def describe(entry: Any) -> dict:
    """A key's kind, and a tensor's dtype and shape, from its metadata entry."""
    if isinstance(entry, TensorStorageMetadata):
        return {"kind": "tensor", "dtype": str(entry.properties.dtype).replace("torch.", ""), "shape": list(entry.size)}
    return {"kind": "value"}


def _compare_key(key: str, left: OpenCheckpoint, right: OpenCheckpoint, exact: bool, report: DiffReport) -> None:
    ea, eb = left.metadata.state_dict_metadata[key], right.metadata.state_dict_metadata[key]
    da, db = describe(ea), describe(eb)
    if da != db:
        report.changed.append({"key": key, "a": da, "b": db})
        return
    if da["kind"] == "value":
        same, how, extra = _same_value(key, left, right), VALUE, {}
    else:
        same, how, extra = _compare_tensor(key, left, right, exact)
    (report.same if same else report.differ).append({"key": key, "decided_by": how, **extra})


def _same_value(key: str, left: OpenCheckpoint, right: OpenCheckpoint) -> bool:
    """Whether value ``key`` is the same on both sides: the same decoded value, types and all (1, 1.0 and True
    differ, as do 0.0 and -0.0, wherever they are nested), or, for a value stored pickled (never unpickled
    here), the same stored bytes."""
    raw = [side._reads.read_value(key) for side in (left, right)]
    try:
        x, y = (decode_value(r, where=side._reads.here(key)) for r, side in zip(raw, (left, right)))
    except UnsafeValueError:
        return raw[0] == raw[1]
    return _canonical(x) == _canonical(y)


def _canonical(x: Any) -> Any:
    """``x`` as nested tuples that are equal exactly where the values are: tagged by type, floats by their bits
    (NaN equal to NaN), dicts as the set of their items whatever their order."""
    if isinstance(x, float):
        return ("float", x.hex())
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_canonical(v) for v in x))
    if isinstance(x, dict):
        return ("dict", frozenset((_canonical(k), _canonical(v)) for k, v in x.items()))
    if isinstance(x, io.BytesIO):
        return ("bytesio", x.getvalue())
    if x is None or isinstance(x, (bool, int, str, bytes, torch.dtype)):
        return (type(x).__name__, x)
    return (type(x).__name__, repr(x))  # torch.Size and what else a value decodes to: by type and text


def _compare_tensor(key: str, left: OpenCheckpoint, right: OpenCheckpoint, exact: bool) -> tuple[bool, str, dict]:
    ta, tb = left[key], right[key]
    if sorted(ta.chunks) == sorted(tb.chunks):
        crcs = [_checksums(left, key, ta.chunks), _checksums(right, key, ta.chunks)]
        if None not in crcs[0] and None not in crcs[1]:
            _check_stored(left, ta)
            _check_stored(right, tb)
            if crcs[0] != crcs[1]:
                return False, CHECKSUM, {}
            if not exact:
                return True, CHECKSUM, {}
        if not _through_codec(left, key, ta.chunks) and not _through_codec(right, key, ta.chunks):
            return _report(_chunk_by_chunk(ta, tb))
    return _report(_block_by_block(ta, tb))


def _report(differing: int) -> tuple[bool, str, dict]:
    return (True, BYTES, {}) if not differing else (False, BYTES, {"elements": differing})


def _infos(opened: OpenCheckpoint, key: str, chunks: list) -> list:
    items = opened.metadata.storage_data.items
    return [items.get(MetadataIndex(key, offsets)) for offsets, _ in chunks]


def _checksums(opened: OpenCheckpoint, key: str, chunks: list) -> list[Optional[int]]:
    """Each chunk's recorded CRC-32C where its stored bytes are its bytes (identity codec), else None."""
    return [info.crc32c if info is not None and info.codec == "identity" else None
            for info in _infos(opened, key, sorted(chunks))]


def _check_stored(opened: OpenCheckpoint, tensor: LazyTensor) -> None:
    """Check, reading no chunk, that the chunks a verdict by checksum speaks for are there as the metadata says:
    each data file validated as load validates it (size, header, save id: read once per file) and each chunk's
    entry in its file's header (dtype, shape, place). Else a checkpoint whose files are missing, truncated or
    another save's would be "the same" as its intact original."""
    entry = opened.metadata.state_dict_metadata[tensor.key]
    for offsets, sizes in tensor.chunks:
        opened._reads.stored(tensor.key, offsets, sizes, entry.properties.dtype)


def _through_codec(opened: OpenCheckpoint, key: str, chunks: list) -> bool:
    return any(info is None or info.codec != "identity" for info in _infos(opened, key, chunks))


def _piece_bytes() -> int:
    """Bytes of one side's piece in flight: a quarter of the budget, both sides with a copy each."""
    return max(1, min(knobs.read_slab_bytes(), knobs.memory_budget_bytes() // 4))


def _chunk_by_chunk(ta: LazyTensor, tb: LazyTensor) -> int:
    """Differing elements, comparing chunk with chunk, a slab of whole rows at a time (every chunk checksummed)."""
    order, n = sorted(ta.chunks), _piece_bytes()
    return sum(_count_differing(pa, pb) for (_, pa), (_, pb) in zip(ta.pieces(n, order), tb.pieces(n, order)))


def _block_by_block(ta: LazyTensor, tb: LazyTensor) -> int:
    """Differing elements, reading both sides a block of rows at a time; the blocks are cut at chunk boundaries
    where they fit, so that chunks lying whole in a block are read whole and checksummed."""
    shape = tuple(ta.shape)
    if not shape or ta.numel() == 0:
        return _count_differing(ta.read(), tb.read())
    row_bytes = max(1, math.prod(shape[1:]) * ta.dtype.itemsize)
    cuts = [offsets[0] + sizes[0] for offsets, sizes in ta.chunks + tb.chunks]
    differing = 0
    for r0, r1 in row_blocks(shape[0], cuts, _piece_bytes() // row_bytes):
        differing += _count_differing(ta[r0:r1], tb[r0:r1])
    return differing


def _count_differing(x: torch.Tensor, y: torch.Tensor) -> int:
    """Elements of ``x`` and ``y`` (same shape and dtype) whose bits differ."""
    bx, by = _bytes_of(x), _bytes_of(y)
    if torch.equal(bx, by):
        return 0
    size = max(1, x.dtype.itemsize)
    return int((bx.reshape(-1, size) != by.reshape(-1, size)).any(dim=1).sum())


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    if flat.numel() and flat.stride(0) != 1:  # a one-element view may keep any stride, and then will not view as bytes
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)
