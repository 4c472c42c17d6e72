"""Save plans and write results as columns: the compact form ranks send the coordinator.

A rank's local plan from the default planner is a list of WriteItems whose
structure repeats: every item of a key shares its type, dtype and global
shape. :class:`PlanColumns` stores that per key once and per item only the
key number and the chunk's offsets and sizes, in numpy arrays. The
coordinator plans on the arrays (see ``columnar.py``) without building one
Python object per item; :meth:`PlanColumns.to_plan` gives back the exact
SavePlan when a path needs objects.

Encoders return None for anything the columns cannot hold exactly; the
caller then sends the plan in the general JSON form.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from ..format.chunk_codec import IDENTITY
from ..format.codec import dec_props, enc_props, opaque_from, opaque_to
from ..format.records import FileInfo, FileResult, StorageInfo
from ..item_columns import WriteColumns
from ..metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from ..planner import BytesIOWriteData, SavePlan, TensorWriteData, WriteItem, WriteItemType
from ..storage import WriteResult
from .frames import decode_frame, encode_frame, pack_json, smallest_uint, unpack_json

__all__ = ["PLAN_MAGIC", "KEEP_MAGIC", "RESULTS_MAGIC", "PlanColumns", "ResultColumns", "encode_plan_columns",
           "encode_keep", "decode_keep", "encode_result_columns", "plain_dict", "ColumnResults",
           "local_plan_columns"]

PLAN_MAGIC = b"\x00DPL"
KEEP_MAGIC = b"\x00DKP"
RESULTS_MAGIC = b"\x00DWR"

_TYPE_CODE = {WriteItemType.TENSOR: 0, WriteItemType.SHARD: 1, WriteItemType.BYTE_IO: 2}
_CODE_TYPE = {v: k for k, v in _TYPE_CODE.items()}
BYTES_CODE = 2
_UNSET = object()


def plain_dict(value: Any) -> bool:
    """A dict whose tagged-JSON form is an object with the same keys (so forms merge like dicts)."""
    return type(value) is dict and all(type(k) is str for k in value) and "$t" not in value


class PlanColumns:
    """One rank's save plan, column-wise.

    ``keys`` is the rank's key table, one row per distinct key in order of
    first use: ``[fqn, type code, encoded properties or None, global size or
    None, value bytes or None]``. ``key_blob`` is its compressed form (equal
    blobs mean equal tables, so the coordinator reads a table that many ranks
    share once; ``keys`` and ``planner_json`` are decoded on first use). Per
    item: ``item_key`` (row in ``keys``), ``offsets`` and ``sizes`` (n x D,
    zero-padded past the key's ndim).
    """

    def __init__(self, key_blob: bytes, item_key: np.ndarray, offsets: np.ndarray, sizes: np.ndarray,
                 planner_blob: bytes, storage_data: Any, usable: bool, where: str = "save plan"):
        self.key_blob, self.item_key, self.offsets, self.sizes = key_blob, item_key, offsets, sizes
        self.planner_blob, self.storage_data, self.usable, self.where = planner_blob, storage_data, usable, where
        self._keys: Optional[list] = None
        self._planner: Any = _UNSET

    @property
    def keys(self) -> list:
        if self._keys is None:
            keys = unpack_json(self.key_blob, self.where)
            if not isinstance(keys, list) or (self.item_key.size and int(self.item_key.max()) >= len(keys)):
                raise ValueError(f"{self.where}: malformed column plan")
            self._keys = keys
        return self._keys

    @property
    def planner_json(self) -> Any:
        if self._planner is _UNSET:
            self._planner = unpack_json(self.planner_blob, self.where)
        return self._planner

    def __len__(self) -> int:
        return len(self.item_key)

    def to_plan(self) -> SavePlan:
        """The SavePlan these columns encode, item for item."""
        items = []
        props_cache: dict = {}
        for k, offs, sizes in zip(self.item_key.tolist(), self.offsets.tolist(), self.sizes.tolist()):
            fqn, code, props, gsize, nbytes = self.keys[k]
            if code == BYTES_CODE:
                items.append(WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO, BytesIOWriteData(nbytes)))
                continue
            p = props_cache.get(k)
            if p is None:
                p = props_cache[k] = dec_props(props, "save plan")
            nd = len(gsize)
            off = torch.Size(offs[:nd])
            items.append(WriteItem(MetadataIndex(fqn, off), _CODE_TYPE[code], tensor_data=TensorWriteData(
                ChunkStorageMetadata(off, torch.Size(sizes[:nd])), p, torch.Size(gsize))))
        planner_data = None if self.planner_json is None else opaque_from(self.planner_json, "save plan", True)
        return SavePlan(items, self.storage_data, planner_data, self.usable)

    @staticmethod
    def decode(raw: bytes, where: str = "save plan") -> "PlanColumns":
        key_blob, meta_blob, planner_blob, item_key, offsets, sizes = decode_frame(raw, PLAN_MAGIC, where)
        meta = unpack_json(meta_blob, where)
        if not isinstance(meta, dict) or item_key.ndim != 1 or offsets.shape != sizes.shape \
                or offsets.ndim != 2 or offsets.shape[0] != item_key.shape[0]:
            raise ValueError(f"{where}: malformed column plan")
        return PlanColumns(bytes(key_blob), item_key.astype(np.int64), offsets.astype(np.int64), sizes.astype(np.int64),
                           bytes(planner_blob), opaque_from(meta["storage_data"], where, True), bool(meta["usable"]), where)


def encode_plan_columns(plan: SavePlan) -> Optional[bytes]:
    """The plan as a column frame, or None when its items do not have the regular shape columns hold."""
    if plan.planner_data is not None and not plain_dict(plan.planner_data):
        return None
    if isinstance(plan.items, WriteColumns) and plan.items.intact:
        return _encode_write_columns(plan, plan.items)
    key_row: dict[str, int] = {}
    keys: list = []
    item_key: list[int] = []
    offs: list = []
    sizes: list = []
    depth = 0
    for it in plan.items:
        index, td = it.index, it.tensor_data
        if index.index is not None:
            return None
        code = _TYPE_CODE.get(it.type)
        if code is None:
            return None
        if code == BYTES_CODE:
            if td is not None or it.bytes_io_data is None or index.offset is not None:
                return None
            row = [index.fqn, code, None, None, int(it.bytes_io_data.nbytes)]
            off = size = ()
        else:
            if td is None or it.bytes_io_data is not None or index.offset != td.chunk.offsets \
                    or len(td.chunk.offsets) != len(td.size) or len(td.chunk.sizes) != len(td.size):
                return None
            row = [index.fqn, code, enc_props(td.properties), list(td.size), None]
            off, size = td.chunk.offsets, td.chunk.sizes
        k = key_row.get(index.fqn)
        if k is None:
            k = key_row[index.fqn] = len(keys)
            keys.append(row)
        elif keys[k] != row:  # a key whose items differ in kind: not regular
            return None
        item_key.append(k)
        offs.append(off)
        sizes.append(size)
        depth = max(depth, len(off))
    n = len(item_key)
    off_arr = np.zeros((n, depth), dtype=np.int64)
    size_arr = np.zeros((n, depth), dtype=np.int64)
    for i, (o, s) in enumerate(zip(offs, sizes)):
        if o:
            off_arr[i, :len(o)] = o
            size_arr[i, :len(s)] = s
    planner_json = None if plan.planner_data is None else opaque_to(plan.planner_data, "plan planner_data", True)
    meta = {"storage_data": opaque_to(plan.storage_data, "plan storage_data", True), "usable": bool(plan.usable)}
    return encode_frame(PLAN_MAGIC, [pack_json(keys), pack_json(meta), pack_json(planner_json),
                                     smallest_uint(np.asarray(item_key, dtype=np.int64)), smallest_uint(off_arr), smallest_uint(size_arr)])


def _encode_write_columns(plan: SavePlan, cols: WriteColumns) -> Optional[bytes]:
    """:func:`encode_plan_columns` straight from the planner's columns, without building the items."""
    parts = _write_column_parts(plan, cols)
    if parts is None:
        return None
    keys, meta, planner_json, item_key, off_arr, size_arr = parts
    return encode_frame(PLAN_MAGIC, [pack_json(keys), pack_json(meta), pack_json(planner_json),
                                     smallest_uint(item_key), smallest_uint(off_arr), smallest_uint(size_arr)])


def local_plan_columns(plan: SavePlan) -> Optional[PlanColumns]:
    """The PlanColumns a plan of intact WriteColumns would arrive as, without the frame: for a process that
    plans its own save alone. None for any other plan."""
    cols = plan.items
    if not (isinstance(cols, WriteColumns) and cols.intact) or (plan.planner_data is not None and not plain_dict(plan.planner_data)):
        return None
    parts = _write_column_parts(plan, cols)
    if parts is None:
        return None
    keys, _, planner_json, item_key, off_arr, size_arr = parts
    out = PlanColumns(b"this process", item_key, off_arr, size_arr, b"", plan.storage_data, plan.usable)
    out._keys, out._planner = keys, planner_json
    return out


def _write_column_parts(plan: SavePlan, cols: WriteColumns) -> Optional[tuple]:
    key_row: dict[str, int] = {}
    keys: list = []
    item_key: list[int] = []
    props: dict = {}
    for fqn, code, dtype, rg, size, nbytes in zip(cols.fqn, cols.code, cols.dtype, cols.requires_grad, cols.size, cols.nbytes):
        if code == BYTES_CODE:
            row = [fqn, code, None, None, nbytes]
        else:
            p = props.get((dtype, rg))
            if p is None:
                p = props[(dtype, rg)] = enc_props(TensorProperties(dtype=dtype, requires_grad=bool(rg)))
            row = [fqn, code, p, list(size), None]
        k = key_row.get(fqn)
        if k is None:
            k = key_row[fqn] = len(keys)
            keys.append(row)
        elif keys[k] != row:
            return None
        item_key.append(k)
    depth = max(map(len, cols.offsets), default=0)
    n = len(item_key)
    off_arr = np.zeros((n, depth), dtype=np.int64)
    size_arr = np.zeros((n, depth), dtype=np.int64)
    for nd in set(map(len, cols.offsets)):
        if nd:
            rows = [i for i, o in enumerate(cols.offsets) if len(o) == nd]
            off_arr[rows, :nd] = [cols.offsets[i] for i in rows]
            size_arr[rows, :nd] = [cols.sizes[i] for i in rows]
    planner_json = None if plan.planner_data is None else opaque_to(plan.planner_data, "plan planner_data", True)
    meta = {"storage_data": opaque_to(plan.storage_data, "plan storage_data", True), "usable": bool(plan.usable)}
    return keys, meta, planner_json, np.asarray(item_key, dtype=np.int64), off_arr, size_arr


def encode_keep(keep: np.ndarray, storage_data: Any) -> bytes:
    """The coordinator's reply to a column plan: which of the rank's items it writes, and the storage data."""
    return encode_frame(KEEP_MAGIC, [pack_json({"n": int(len(keep)), "storage_data": opaque_to(storage_data, "plan storage_data", True)}),
                                     np.packbits(keep.astype(bool))])


def decode_keep(raw: bytes, local: SavePlan) -> SavePlan:
    """The central plan of this rank: its own local plan's items that the coordinator kept."""
    meta_blob, bits = decode_frame(raw, KEEP_MAGIC, "save plan")
    meta = unpack_json(meta_blob, "save plan")
    n = meta["n"]
    if n != len(local.items):
        raise ValueError(f"the coordinator's reply covers {n} items, this rank planned {len(local.items)}")
    keep = np.unpackbits(bits, count=n).astype(bool).tolist()
    if isinstance(local.items, WriteColumns) and local.items.intact:
        items = local.items.select(keep)
    else:
        items = [it for it, k in zip(local.items, keep) if k]
    return SavePlan(items, opaque_from(meta["storage_data"], "save plan", True), local.planner_data, True)


@dataclass
class ResultColumns:
    """One rank's write results relative to its central plan: item i of the plan is
    at ``offset[i]`` of ``files[file_no[i]]`` with checksum ``crc[i]``; ``files``
    holds [name, size, rank, header crc] of each file the rank wrote."""

    files: list
    file_no: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    crc: np.ndarray

    @staticmethod
    def decode(raw: bytes, where: str = "write results") -> "ResultColumns":
        files_blob, file_no, offset, length, crc = decode_frame(raw, RESULTS_MAGIC, where)
        files = unpack_json(files_blob, where)
        n = len(file_no)
        if not isinstance(files, list) or not (len(offset) == len(length) == len(crc) == n) or (n and int(file_no.max()) >= len(files)):
            raise ValueError(f"{where}: malformed column results")
        return ResultColumns(files, file_no.astype(np.int64), offset.astype(np.int64), length.astype(np.int64), crc.astype(np.int64))

    def to_results(self, plan_items: list) -> list[WriteResult]:
        out = [WriteResult(it.index, ln, StorageInfo(self.files[f][0], off, ln, c))
               for it, f, off, ln, c in zip(plan_items, self.file_no.tolist(), self.offset.tolist(), self.length.tolist(),
                                            self.crc.tolist())]
        out += [FileResult.of(name, FileInfo(size, rank, hcrc)) for name, size, rank, hcrc in self.files]
        return out


class ColumnResults(Sequence):
    """A rank's write results as :class:`ResultColumns`, standing in for the list of WriteResults
    ``write_data`` returns: the objects are built (once) when someone reads them."""

    def __init__(self, columns: ResultColumns, items: WriteColumns) -> None:
        self.columns, self._plan_items = columns, items
        self._results: Optional[list[WriteResult]] = None

    def results(self) -> list[WriteResult]:
        if self._results is None:
            self._results = self.columns.to_results(list(self._plan_items))
        return self._results

    def __len__(self) -> int:
        return len(self.columns.file_no) + len(self.columns.files)

    def __getitem__(self, i):
        return self.results()[i]

    def __iter__(self):
        return iter(self.results())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, (list, ColumnResults)) and self.results() == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __add__(self, other) -> list:
        return self.results() + list(other)

    def __radd__(self, other) -> list:
        return list(other) + self.results()

    def __repr__(self) -> str:
        return f"ColumnResults({len(self.columns.file_no)} items, {len(self.columns.files)} files)"


def encode_result_columns(results: list[WriteResult], plan: SavePlan) -> Optional[bytes]:
    """Results of writing ``plan`` as columns, or None unless they are exactly one StorageInfo per
    plan item, in plan order, followed by one FileResult per data file."""
    if isinstance(results, ColumnResults) and results.columns.file_no.shape[0] == len(plan.items):
        c = results.columns
        return encode_frame(RESULTS_MAGIC, [pack_json(c.files)] + [smallest_uint(a) for a in (c.file_no, c.offset, c.length, c.crc)])
    n = len(plan.items)
    if len(results) < n:
        return None
    names: dict[str, int] = {}
    files: list = []
    for r in results[n:]:
        sd = r.storage_data
        if not isinstance(r, FileResult) or not isinstance(sd, FileInfo):
            return None
        name = r.file
        names[name] = len(files)
        files.append([name, sd.size, sd.rank, sd.header_crc32c])
    cols = np.zeros((4, n), dtype=np.int64)
    for i, (r, it) in enumerate(zip(results, plan.items)):
        sd = r.storage_data
        if (not isinstance(sd, StorageInfo) or r.index != it.index or sd.length != r.size_in_bytes or sd.file not in names
                or sd.codec != IDENTITY.name):
            return None
        cols[0, i], cols[1, i], cols[2, i], cols[3, i] = names[sd.file], sd.offset, sd.length, sd.crc32c
    return encode_frame(RESULTS_MAGIC, [pack_json(files)] + [smallest_uint(c) for c in cols])
