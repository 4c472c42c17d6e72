"""The column schema (:mod:`distckpt.item_columns`) as frames: the compact form ranks send the coordinator.

A rank's local plan from the default planner is a list of WriteItems whose
structure repeats: every item of a key shares its type, dtype and global
shape. A plan frame stores that per key once and per item only the key
number and the chunk's offsets and sizes; the coordinator plans on the
decoded :class:`PlanColumns` (``planning/columnar.py``) without building one
Python object per item.

Encoders return None for anything the columns cannot hold exactly; the
caller then sends the plan in the general JSON form.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..errors import CorruptCheckpointError
from ..format.codec import enc_props, opaque_from, opaque_to
from ..format.records import FileInfo, FileResult, StorageInfo
from ..item_columns import BYTES, ColumnResults, PlanColumns, ResultColumns, WriteColumns, type_code
from ..metadata import TensorProperties
from ..planner import SavePlan
from ..storage import WriteResult
from .frames import decode_frame, encode_frame, pack_json, smallest_uint, unpack_json

__all__ = ["PLAN_MAGIC", "KEEP_MAGIC", "RESULTS_MAGIC", "encode_plan_columns", "decode_plan_columns", "encode_keep", "decode_keep",
           "encode_result_columns", "decode_result_columns", "plain_dict", "local_plan_columns"]

PLAN_MAGIC = b"\x00DPL"
KEEP_MAGIC = b"\x00DKP"
RESULTS_MAGIC = b"\x00DWR"


def plain_dict(value: Any) -> bool:
    """A dict whose tagged-JSON form is an object with the same keys (so forms merge like dicts)."""
    return type(value) is dict and all(type(k) is str for k in value) and "$t" not in value


def _sections(raw: bytes, magic: bytes, where: str, kinds: str) -> list:
    """The sections of a frame, one per letter of ``kinds``: ``b`` bytes, ``1``/``2`` an array of unsigned integers
    of that many dimensions (every index and size a frame carries is one: a signed -1 would pick the last entry)."""
    parts = decode_frame(raw, magic, where)
    if len(parts) != len(kinds):
        raise CorruptCheckpointError(f"{where}: a frame of {len(parts)} sections, not {len(kinds)}")
    for part, kind in zip(parts, kinds):
        if kind == "b" and isinstance(part, np.ndarray) or kind != "b" and not (
                isinstance(part, np.ndarray) and part.dtype.kind == "u" and part.ndim == int(kind)):
            raise CorruptCheckpointError(f"{where}: malformed frame section")
    return parts


def _json_object(blob: Any, where: str, members: tuple) -> dict:
    value = unpack_json(blob, where)
    if not isinstance(value, dict) or any(m not in value for m in members):
        raise CorruptCheckpointError(f"{where}: malformed frame section (want an object with {', '.join(members)})")
    return value


def decode_plan_columns(raw: bytes, where: str = "save plan") -> PlanColumns:
    """The PlanColumns of a plan frame (keys and planner data decoded on first use)."""
    key_blob, meta_blob, planner_blob, item_key, offsets, sizes = _sections(raw, PLAN_MAGIC, where, "bbb122")
    meta = _json_object(meta_blob, where, ("storage_data", "usable"))
    if offsets.shape != sizes.shape or offsets.shape[0] != item_key.shape[0]:
        raise CorruptCheckpointError(f"{where}: malformed column plan")
    return PlanColumns(bytes(key_blob), item_key.astype(np.int64), offsets.astype(np.int64), sizes.astype(np.int64),
                       bytes(planner_blob), opaque_from(meta["storage_data"], where, True), bool(meta["usable"]), where,
                       unpack=unpack_json)


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
        code = type_code(it.type)
        if code is None:
            return None
        if code == BYTES:
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
    return PlanColumns(b"this process", item_key, off_arr, size_arr, b"", plan.storage_data, plan.usable, keys=keys,
                       planner_json=planner_json)


def _write_column_parts(plan: SavePlan, cols: WriteColumns) -> Optional[tuple]:
    key_row: dict[str, int] = {}
    keys: list = []
    item_key: list[int] = []
    props: dict = {}
    for fqn, code, dtype, rg, size, nbytes in zip(cols.fqn, cols.code, cols.dtype, cols.requires_grad, cols.size, cols.nbytes):
        if code == BYTES:
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
    meta_blob, bits = _sections(raw, KEEP_MAGIC, "save plan", "b1")
    meta = _json_object(meta_blob, "save plan", ("n", "storage_data"))
    n = meta["n"]
    if type(n) is not int or n != len(local.items) or bits.dtype != np.uint8 or len(bits) * 8 < n:
        raise CorruptCheckpointError(f"the coordinator's reply covers {n!r:.20} items, this rank planned {len(local.items)}")
    keep = np.unpackbits(bits, count=n).astype(bool).tolist()
    if isinstance(local.items, WriteColumns) and local.items.intact:
        items = local.items.select(keep)
    else:
        items = [it for it, k in zip(local.items, keep) if k]
    return SavePlan(items, opaque_from(meta["storage_data"], "save plan", True), local.planner_data, True)


def decode_result_columns(raw: bytes, where: str = "write results") -> ResultColumns:
    files_blob, file_no, offset, length, crc, codecs_blob, codec = _sections(raw, RESULTS_MAGIC, where, "b1111b1")
    files, codecs = unpack_json(files_blob, where), unpack_json(codecs_blob, where)
    n = len(file_no)
    if (not isinstance(files, list) or not all(_file_row(f) for f in files) or not isinstance(codecs, list)
            or not codecs or not all(isinstance(c, str) for c in codecs)
            or not (len(offset) == len(length) == len(crc) == len(codec) == n) or (n and int(file_no.max()) >= len(files))
            or (n and int(codec.max()) >= len(codecs))):
        raise CorruptCheckpointError(f"{where}: malformed column results")
    return ResultColumns(files, file_no.astype(np.int64), offset.astype(np.int64), length.astype(np.int64), crc.astype(np.int64),
                         codecs, codec.astype(np.int64))


def _file_row(row: Any) -> bool:
    """[name, size, rank, header crc], as the write engine reports a data file; and the id of the save that stored it,
    for a file of an earlier checkpoint an incremental save references."""
    return (type(row) is list and len(row) in (4, 5) and type(row[0]) is str and all(type(x) is int and x >= 0 for x in row[1:4])
            and (len(row) == 4 or type(row[4]) is str))


def _results_frame(files: list, columns: list[np.ndarray], codecs: list[str]) -> bytes:
    return encode_frame(RESULTS_MAGIC, [pack_json(files)] + [smallest_uint(c) for c in columns[:4]]
                        + [pack_json(codecs), smallest_uint(columns[4])])


def encode_result_columns(results: list[WriteResult], plan: SavePlan) -> Optional[bytes]:
    """Results of writing ``plan`` as columns, or None unless they are exactly one StorageInfo per
    plan item, in plan order, followed by one FileResult per data file."""
    if isinstance(results, ColumnResults) and results.columns.file_no.shape[0] == len(plan.items):
        c = results.columns
        return _results_frame(c.files, [c.file_no, c.offset, c.length, c.crc, c.codec_column()], c.codecs)
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
        files.append([name, sd.size, sd.rank, sd.header_crc32c] + ([] if sd.save_id is None else [sd.save_id]))
    codecs: dict[str, int] = {}
    cols = np.zeros((5, n), dtype=np.int64)
    for i, (r, it) in enumerate(zip(results, plan.items)):
        sd = r.storage_data
        if not isinstance(sd, StorageInfo) or r.index != it.index or sd.length != r.size_in_bytes or sd.file not in names:
            return None
        cols[:, i] = names[sd.file], sd.offset, sd.length, sd.crc32c, codecs.setdefault(sd.codec, len(codecs))
    return _results_frame(files, list(cols), list(codecs) or ["identity"])
