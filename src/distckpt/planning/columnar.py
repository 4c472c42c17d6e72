"""Global save planning on column plans: the default planner's coordinator work with arrays.

:func:`plan_columns` does what ``DefaultSavePlanner.create_global_plan``
does (dedup of items held by several ranks, balancing of write bytes,
the checks behind the metadata) with the same result, item for item, but
on numpy arrays: sorting groups equal items, and only the items held by
several ranks are placed one by one. :func:`metadata_document` then writes
the metadata document straight from the arrays and the ranks' column write
results.

Whenever the plans are not regular enough to decide here (disagreeing
replicas, missing shards, a key used in two ways) it raises
:class:`Declined`; the caller then runs the object path, which raises the
error that names the problem.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from ..format.codec import bytes_row, dec_props, file_table, opaque_from, quote, tensor_row
from ..format.codec import metadata_document as document_bytes
from ..format.dtypes import dtype_from_name, itemsize
from ..format.tensor_table import TableWriter
from ..metadata import BytesStorageMetadata, ChunkStorageMetadata, Metadata, StorageMeta, TensorProperties, TensorStorageMetadata
from ..wire.columns import BYTES_CODE, PlanColumns, ResultColumns

__all__ = ["Declined", "ColumnarPlan", "plan_columns"]


class Declined(Exception):
    """These plans need the general (object) path of global planning."""


@dataclass
class ColumnarPlan:
    """The outcome of :func:`plan_columns`.

    ``keep[r]`` says which of rank r's local items it writes. Keys: ``rows``
    (the global key table, rows as in :class:`PlanColumns`), per key ``code``,
    ``ndim``, ``width`` (item size) and ``key_order`` (the order the metadata
    lists them in). Chunks, one per group of equal items, sorted by key then
    offsets: ``group_gid``, ``group_off``, ``group_size``, ``group_bytes``, and
    the writer of each, ``group_rank`` and ``group_ordinal`` (its position
    among that rank's kept items).
    """

    keep: list
    rows: list
    code: np.ndarray
    ndim: np.ndarray
    width: np.ndarray
    key_order: np.ndarray
    group_gid: np.ndarray
    group_off: np.ndarray
    group_size: np.ndarray
    group_bytes: np.ndarray
    group_rank: np.ndarray
    group_ordinal: np.ndarray
    all_cols: list


def plan_columns(all_cols: list[PlanColumns], dedup: bool = True) -> ColumnarPlan:
    if not dedup:
        raise Declined("replicas are written by every holder")
    world = len(all_cols)
    # ---- one global key table; identical rank tables (the usual case) are checked once
    gid_of: dict[str, int] = {}
    rows: list = []
    by_blob: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
    rank_gids, rank_nbytes = [], []
    for c in all_cols:
        hit = by_blob.get(c.key_blob)
        if hit is None:
            ids = []
            for row in c.keys:
                g = gid_of.get(row[0])
                if g is None:
                    g = gid_of[row[0]] = len(rows)
                    rows.append(row)
                elif rows[g][:4] != row[:4]:
                    raise Declined(f"key {row[0]!r} differs across ranks")
                ids.append(g)
            hit = by_blob[c.key_blob] = (np.array(ids, dtype=np.int64), np.array([r[4] or 0 for r in c.keys], dtype=np.int64))
        if c.item_key.size and int(c.item_key.max()) >= len(hit[0]):
            raise ValueError("a column plan names a key its table lacks")
        rank_gids.append(hit[0])
        rank_nbytes.append(hit[1])
    n_keys = len(rows)
    code = np.array([r[1] for r in rows], dtype=np.int64)
    ndim = np.array([0 if r[3] is None else len(r[3]) for r in rows], dtype=np.int64)
    width = np.array([0 if r[2] is None else itemsize(dtype_from_name(r[2][0], "save plan")) for r in rows], dtype=np.int64)
    is_tensor = code != BYTES_CODE

    # ---- every item of every rank, as flat arrays
    counts = [len(c) for c in all_cols]
    total = sum(counts)
    depth = max([c.offsets.shape[1] for c in all_cols] + [0])
    gid = np.concatenate([g[c.item_key] for g, c in zip(rank_gids, all_cols)] + [np.zeros(0, np.int64)])
    vbytes = np.concatenate([nb[c.item_key] for nb, c in zip(rank_nbytes, all_cols)] + [np.zeros(0, np.int64)])
    rank = np.repeat(np.arange(world, dtype=np.int64), counts)
    pos = np.concatenate([np.arange(n, dtype=np.int64) for n in counts] + [np.zeros(0, np.int64)])
    off = np.zeros((total, depth), dtype=np.int64)
    size = np.zeros((total, depth), dtype=np.int64)
    start = 0
    for c, n in zip(all_cols, counts):
        d = c.offsets.shape[1]
        off[start:start + n, :d] = c.offsets
        size[start:start + n, :d] = c.sizes
        start += n
    valid = np.arange(depth)[None, :] < ndim[gid][:, None]
    elems = np.where(valid, size, 1).prod(axis=1)
    nbytes = np.where(is_tensor[gid], elems * width[gid], vbytes)

    # ---- group equal items: same key and offsets; members ordered by rank
    order = np.lexsort([rank] + [off[:, d] for d in reversed(range(depth))] + [gid])
    g_s, off_s, size_s, rank_s = gid[order], off[order], size[order], rank[order]
    new = np.ones(total, dtype=bool)
    if total:
        new[1:] = (g_s[1:] != g_s[:-1]) | (off_s[1:] != off_s[:-1]).any(axis=1)
    group_of = np.cumsum(new) - 1
    starts = np.flatnonzero(new)
    members = np.diff(np.append(starts, total))
    if total and ((size_s != size_s[starts][group_of]).any() or ((rank_s[1:] == rank_s[:-1]) & ~new[1:]).any()):
        raise Declined("replicas disagree, or a rank lists an item twice")
    cover = np.zeros(n_keys, dtype=np.int64)
    np.add.at(cover, g_s[starts], elems[order][starts])
    full = np.array([math.prod(r[3]) if r[3] is not None else 0 for r in rows], dtype=np.int64)
    if (cover[is_tensor] != full[is_tensor]).any():
        raise Declined("chunks do not cover their tensors")

    # ---- balance: unique items stay; shared ones largest first to the least loaded holder
    group_bytes = nbytes[order][starts]
    load = np.zeros(world, dtype=np.int64)
    single = members == 1
    np.add.at(load, rank_s[starts[single]], group_bytes[single])
    owner = np.where(single, rank_s[starts], -1)
    shared = np.flatnonzero(~single)
    if shared.size:
        names = [r[0] for r in rows]
        name_rank = np.empty(n_keys, dtype=np.int64)
        name_rank[sorted(range(n_keys), key=names.__getitem__)] = np.arange(n_keys)
        first = starts[shared]
        seq = shared[np.lexsort((pos[order][first], rank_s[first], name_rank[g_s[first]], -group_bytes[shared]))]
        load_l, ranks_l, starts_l, members_l = load.tolist(), rank_s.tolist(), starts.tolist(), members.tolist()
        for gi, b in zip(seq.tolist(), group_bytes[seq].tolist()):
            hs = ranks_l[starts_l[gi]:starts_l[gi] + members_l[gi]]
            best = min(hs, key=load_l.__getitem__)  # first minimum: the lowest rank among the least loaded
            owner[gi] = best
            load_l[best] += b
    keep_s = rank_s == owner[group_of]
    keep = np.empty(total, dtype=bool)
    keep[order] = keep_s
    bounds = np.cumsum([0] + counts)
    keep_by_rank = [keep[bounds[r]:bounds[r + 1]] for r in range(world)]

    # ---- the chunk table: one row per group, in key then offsets order
    kept_item = order[np.flatnonzero(keep_s)]  # the writing member of each group
    ordinal = np.empty(total, dtype=np.int64)
    for r in range(world):
        ordinal[bounds[r]:bounds[r + 1]] = np.cumsum(keep_by_rank[r]) - 1
    # keys in order of first appearance in the deduplicated plans, as the object path lists them
    first_seen = np.full(n_keys, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(first_seen, gid[keep], np.flatnonzero(keep))
    key_order = np.argsort(first_seen, kind="stable")
    return ColumnarPlan(keep=keep_by_rank, rows=rows, code=code, ndim=ndim, width=width, key_order=key_order,
                        group_gid=g_s[starts], group_off=off_s[starts], group_size=size_s[starts], group_bytes=group_bytes,
                        group_rank=rank[kept_item], group_ordinal=ordinal[kept_item], all_cols=all_cols)


def _planner_json(all_cols: list[PlanColumns]) -> Any:
    """The merged planner data (tagged-JSON form) the object path would store."""
    merged: dict = {}
    previous: Optional[bytes] = None
    for c in all_cols:
        if c.planner_blob != previous and isinstance(c.planner_json, dict):
            merged.update(c.planner_json)
        previous = c.planner_blob
    return merged or None


def _group_rows(plan: ColumnarPlan) -> tuple[list, list]:
    """Per group: offsets and sizes as lists of the key's rank."""
    n = len(plan.group_gid)
    offs: list = [None] * n
    sizes: list = [None] * n
    nd = plan.ndim[plan.group_gid]
    for d in np.unique(nd).tolist():
        idx = np.flatnonzero(nd == d)
        for i, o, s in zip(idx.tolist(), plan.group_off[idx, :d].tolist(), plan.group_size[idx, :d].tolist()):
            offs[i], sizes[i] = o, s
    return offs, sizes


def _key_ranges(plan: ColumnarPlan) -> tuple[np.ndarray, np.ndarray]:
    keys = np.arange(len(plan.rows))
    return np.searchsorted(plan.group_gid, keys, "left"), np.searchsorted(plan.group_gid, keys, "right")


def metadata_document(plan: ColumnarPlan, results: list[ResultColumns], save_id: str, checkpoint_id: Optional[str]) -> bytes:
    """The metadata document (format 2.x) of the save, built from the arrays."""
    if len(results) != len(plan.keep):
        raise ValueError(f"write results from {len(results)} ranks for a plan of {len(plan.keep)}")
    files: dict[str, list] = {}
    for r, res in enumerate(results):
        if len(res.file_no) != int(plan.keep[r].sum()):
            raise ValueError(f"rank {r} reported {len(res.file_no)} written items, its plan had {int(plan.keep[r].sum())}")
        for f in res.files:
            if f[0] in files:
                raise ValueError(f"data file {f[0]!r} was written by two ranks")
            files[f[0]] = f
    names = sorted(files)
    number = {name: i for i, name in enumerate(names)}
    base = np.cumsum([0] + [len(res.file_no) for res in results])
    file_no = np.concatenate([np.array([number[f[0]] for f in res.files], dtype=np.int64)[res.file_no] if len(res.files) else
                              np.zeros(0, np.int64) for res in results] + [np.zeros(0, np.int64)])
    begin = np.concatenate([res.offset for res in results] + [np.zeros(0, np.int64)])
    length = np.concatenate([res.length for res in results] + [np.zeros(0, np.int64)])
    crc = np.concatenate([res.crc for res in results] + [np.zeros(0, np.int64)])
    row = base[plan.group_rank] + plan.group_ordinal
    tensor_group = plan.code[plan.group_gid] != BYTES_CODE
    if (length[row][tensor_group] != plan.group_bytes[tensor_group]).any():
        raise ValueError("a rank wrote a chunk with a length other than planned")
    f_l, b_l, c_l, len_l = file_no[row].tolist(), begin[row].tolist(), crc[row].tolist(), length[row].tolist()
    offs, sizes = _group_rows(plan)
    lo, hi = _key_ranges(plan)
    members = []
    add = members.append
    table = TableWriter()
    add_whole = table.add
    rows = plan.rows
    for g, a, b in zip(plan.key_order.tolist(), lo[plan.key_order].tolist(), hi[plan.key_order].tolist()):
        fqn, code, props, gsize, _ = rows[g]
        if code == BYTES_CODE:
            add(f"{quote(fqn)}:{bytes_row((f_l[a], b_l[a], len_l[a], c_l[a]))}")
            continue
        if b - a == 1 and sizes[a] == gsize and len(gsize) <= 64 and not any(offs[a]):  # one chunk: the whole tensor
            add_whole(fqn, gsize, props, f_l[a], b_l[a], c_l[a])
        else:
            add(f"{quote(fqn)}:{tensor_row(gsize, props, list(zip(offs[a:b], sizes[a:b], f_l[a:b], b_l[a:b], c_l[a:b])))}")
    storage = file_table(save_id, [files[n] for n in names])
    return document_bytes(members, storage, _planner_json(plan.all_cols), StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id),
                          table=table)


def to_metadata(plan: ColumnarPlan) -> Metadata:
    """The Metadata object (without storage data) that the object path's create_global_plan returns."""
    offs, sizes = _group_rows(plan)
    lo, hi = _key_ranges(plan)
    sdm: dict = {}
    for g in plan.key_order.tolist():
        fqn, code, props, gsize, _ = plan.rows[g]
        if code == BYTES_CODE:
            sdm[fqn] = BytesStorageMetadata()
            continue
        p = dec_props(props, "save plan")
        chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in zip(offs[lo[g]:hi[g]], sizes[lo[g]:hi[g]])]
        sdm[fqn] = TensorStorageMetadata(TensorProperties(p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory),
                                         torch.Size(gsize), chunks)
    planner = _planner_json(plan.all_cols)
    return Metadata(state_dict_metadata=sdm, planner_data=None if planner is None else opaque_from(planner, "save plan", True))
