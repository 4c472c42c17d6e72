"""Global save planning on column plans: the default planner's coordinator work with arrays.

:func:`plan_columns` does what ``DefaultSavePlanner.create_global_plan``
does (dedup of items held by several ranks, balancing of write bytes,
the checks behind the metadata) with the same result, item for item, but
on numpy arrays: sorting groups equal items, and only the items held by
several ranks are placed one by one. The commit (``engine/commit.py``) then
writes the metadata document straight from the arrays and the ranks' column
write results.

Whenever the plans are not regular enough to decide here (disagreeing
replicas, missing shards, a key used in two ways) it raises
:class:`Declined`; the caller then runs the object path, which raises the
error that names the problem.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from ..format.codec import dec_props, opaque_from
from ..format.dtypes import dtype_from_name, itemsize
from ..item_columns import BYTES, PlanColumns
from ..metadata import BytesStorageMetadata, ChunkStorageMetadata, Metadata, TensorProperties, TensorStorageMetadata

__all__ = ["Declined", "ColumnarPlan", "PlannedMetadata", "plan_columns", "to_metadata"]


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

    def planner_json(self) -> Any:
        """The merged planner data (tagged-JSON form) the object path would store."""
        merged: dict = {}
        previous: Optional[bytes] = None
        for c in self.all_cols:
            if c.planner_blob != previous and isinstance(c.planner_json, dict):
                merged.update(c.planner_json)
            previous = c.planner_blob
        return merged or None

    def chunk_rows(self) -> tuple[list, list]:
        """Per group: offsets and sizes as lists of the key's rank."""
        n = len(self.group_gid)
        offs: list = [None] * n
        sizes: list = [None] * n
        nd = self.ndim[self.group_gid]
        for d in np.unique(nd).tolist():
            idx = np.flatnonzero(nd == d)
            for i, o, sz in zip(idx.tolist(), self.group_off[idx, :d].tolist(), self.group_size[idx, :d].tolist()):
                offs[i], sizes[i] = o, sz
        return offs, sizes

    def key_ranges(self) -> tuple[np.ndarray, np.ndarray]:
        """Per key: the first group of its chunks and the one past its last."""
        keys = np.arange(len(self.rows))
        return np.searchsorted(self.group_gid, keys, "left"), np.searchsorted(self.group_gid, keys, "right")


def plan_columns(all_cols: list[PlanColumns], dedup: bool = True) -> ColumnarPlan:
    """Global save planning on the ranks' column plans, in named steps: one key table, every item as flat
    arrays, groups of equal items, balance, and the chunk table of the metadata."""
    if not dedup:
        raise Declined("replicas are written by every holder")
    keys = _KeyTable(all_cols)
    items = _Items(all_cols, keys)
    groups = _Groups(items, keys)
    owner = _balance(groups, items, keys, len(all_cols))
    return _chunk_table(groups, items, owner, keys, all_cols)


class _KeyTable:
    """One global key table; identical rank tables (the usual case) are checked once."""

    def __init__(self, all_cols: list[PlanColumns]) -> None:
        gid_of: dict[str, int] = {}
        self.rows: list = []
        by_blob: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
        self.rank_gids, self.rank_nbytes = [], []
        for c in all_cols:
            hit = by_blob.get(c.key_blob)
            if hit is None:
                ids = []
                for row in c.keys:
                    g = gid_of.get(row[0])
                    if g is None:
                        g = gid_of[row[0]] = len(self.rows)
                        self.rows.append(row)
                    elif self.rows[g][:4] != row[:4]:
                        raise Declined(f"key {row[0]!r} differs across ranks")
                    ids.append(g)
                hit = by_blob[c.key_blob] = (np.array(ids, dtype=np.int64), np.array([r[4] or 0 for r in c.keys], dtype=np.int64))
            if c.item_key.size and int(c.item_key.max()) >= len(hit[0]):
                raise ValueError("a column plan names a key its table lacks")
            self.rank_gids.append(hit[0])
            self.rank_nbytes.append(hit[1])
        rows = self.rows
        self.code = np.array([r[1] for r in rows], dtype=np.int64)
        self.ndim = np.array([0 if r[3] is None else len(r[3]) for r in rows], dtype=np.int64)
        self.width = np.array([0 if r[2] is None else itemsize(dtype_from_name(r[2][0], "save plan")) for r in rows], dtype=np.int64)
        self.is_tensor = self.code != BYTES


class _Items:
    """Every item of every rank, as flat arrays: key, rank, position in the rank's plan, chunk, bytes."""

    def __init__(self, all_cols: list[PlanColumns], keys: _KeyTable) -> None:
        self.counts = counts = [len(c) for c in all_cols]
        self.total = total = sum(counts)
        depth = self.depth = max([c.offsets.shape[1] for c in all_cols] + [0])
        self.gid = np.concatenate([g[c.item_key] for g, c in zip(keys.rank_gids, all_cols)] + [np.zeros(0, np.int64)])
        vbytes = np.concatenate([nb[c.item_key] for nb, c in zip(keys.rank_nbytes, all_cols)] + [np.zeros(0, np.int64)])
        self.rank = np.repeat(np.arange(len(all_cols), dtype=np.int64), counts)
        self.pos = np.concatenate([np.arange(n, dtype=np.int64) for n in counts] + [np.zeros(0, np.int64)])
        self.off = np.zeros((total, depth), dtype=np.int64)
        self.size = np.zeros((total, depth), dtype=np.int64)
        start = 0
        for c, n in zip(all_cols, counts):
            d = c.offsets.shape[1]
            self.off[start:start + n, :d] = c.offsets
            self.size[start:start + n, :d] = c.sizes
            start += n
        valid = np.arange(depth)[None, :] < keys.ndim[self.gid][:, None]
        self.elems = np.where(valid, self.size, 1).prod(axis=1)
        self.nbytes = np.where(keys.is_tensor[self.gid], self.elems * keys.width[self.gid], vbytes)


class _Groups:
    """Equal items (same key and offsets) grouped, members ordered by rank; every tensor's chunks checked to
    cover it exactly."""

    def __init__(self, items: _Items, keys: _KeyTable) -> None:
        total, off = items.total, items.off
        self.order = order = np.lexsort([items.rank] + [off[:, d] for d in reversed(range(items.depth))] + [items.gid])
        self.g_s, self.off_s, self.size_s, self.rank_s = items.gid[order], off[order], items.size[order], items.rank[order]
        g_s, rank_s = self.g_s, self.rank_s
        new = np.ones(total, dtype=bool)
        if total:
            new[1:] = (g_s[1:] != g_s[:-1]) | (self.off_s[1:] != self.off_s[:-1]).any(axis=1)
        self.group_of = np.cumsum(new) - 1
        self.starts = starts = np.flatnonzero(new)
        self.members = np.diff(np.append(starts, total))
        if total and ((self.size_s != self.size_s[starts][self.group_of]).any() or ((rank_s[1:] == rank_s[:-1]) & ~new[1:]).any()):
            raise Declined("replicas disagree, or a rank lists an item twice")
        cover = np.zeros(len(keys.rows), dtype=np.int64)
        np.add.at(cover, g_s[starts], items.elems[order][starts])
        full = np.array([math.prod(r[3]) if r[3] is not None else 0 for r in keys.rows], dtype=np.int64)
        if (cover[keys.is_tensor] != full[keys.is_tensor]).any():
            raise Declined("chunks do not cover their tensors")
        self.bytes = items.nbytes[order][starts]


def _balance(groups: _Groups, items: _Items, keys: _KeyTable, world: int) -> np.ndarray:
    """The writing rank of each group: unique items stay; shared ones go largest first to the least loaded holder."""
    starts, members, rank_s = groups.starts, groups.members, groups.rank_s
    load = np.zeros(world, dtype=np.int64)
    single = members == 1
    np.add.at(load, rank_s[starts[single]], groups.bytes[single])
    owner = np.where(single, rank_s[starts], -1)
    shared = np.flatnonzero(~single)
    if shared.size:
        n_keys = len(keys.rows)
        names = [r[0] for r in keys.rows]
        name_rank = np.empty(n_keys, dtype=np.int64)
        name_rank[sorted(range(n_keys), key=names.__getitem__)] = np.arange(n_keys)
        first = starts[shared]
        seq = shared[np.lexsort((items.pos[groups.order][first], rank_s[first], name_rank[groups.g_s[first]], -groups.bytes[shared]))]
        load_l, ranks_l, starts_l, members_l = load.tolist(), rank_s.tolist(), starts.tolist(), members.tolist()
        for gi, b in zip(seq.tolist(), groups.bytes[seq].tolist()):
            hs = ranks_l[starts_l[gi]:starts_l[gi] + members_l[gi]]
            best = min(hs, key=load_l.__getitem__)  # first minimum: the lowest rank among the least loaded
            owner[gi] = best
            load_l[best] += b
    return owner


def _chunk_table(groups: _Groups, items: _Items, owner: np.ndarray, keys: _KeyTable, all_cols: list[PlanColumns]) -> ColumnarPlan:
    """Which items each rank keeps, and the chunk table: one row per group, in key then offsets order."""
    total, counts, order = items.total, items.counts, groups.order
    keep_s = groups.rank_s == owner[groups.group_of]
    keep = np.empty(total, dtype=bool)
    keep[order] = keep_s
    bounds = np.cumsum([0] + counts)
    keep_by_rank = [keep[bounds[r]:bounds[r + 1]] for r in range(len(counts))]
    kept_item = order[np.flatnonzero(keep_s)]  # the writing member of each group
    ordinal = np.empty(total, dtype=np.int64)
    for r in range(len(counts)):
        ordinal[bounds[r]:bounds[r + 1]] = np.cumsum(keep_by_rank[r]) - 1
    # keys in order of first appearance in the deduplicated plans, as the object path lists them
    first_seen = np.full(len(keys.rows), np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(first_seen, items.gid[keep], np.flatnonzero(keep))
    key_order = np.argsort(first_seen, kind="stable")
    starts = groups.starts
    return ColumnarPlan(keep=keep_by_rank, rows=keys.rows, code=keys.code, ndim=keys.ndim, width=keys.width, key_order=key_order,
                        group_gid=groups.g_s[starts], group_off=groups.off_s[starts], group_size=groups.size_s[starts],
                        group_bytes=groups.bytes, group_rank=items.rank[kept_item], group_ordinal=ordinal[kept_item],
                        all_cols=all_cols)


def to_metadata(plan: ColumnarPlan) -> Metadata:
    """The Metadata object (without storage data) that the object path's create_global_plan returns."""
    offs, sizes = plan.chunk_rows()
    lo, hi = plan.key_ranges()
    sdm: dict = {}
    for g in plan.key_order.tolist():
        fqn, code, props, gsize, _ = plan.rows[g]
        if code == BYTES:
            sdm[fqn] = BytesStorageMetadata()
            continue
        p = dec_props(props, "save plan")
        chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in zip(offs[lo[g]:hi[g]], sizes[lo[g]:hi[g]])]
        sdm[fqn] = TensorStorageMetadata(TensorProperties(p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory),
                                         torch.Size(gsize), chunks)
    planner = plan.planner_json()
    return Metadata(state_dict_metadata=sdm, planner_data=None if planner is None else opaque_from(planner, "save plan", True))


_FIELDS = tuple(f.name for f in dataclasses.fields(Metadata))


class PlannedMetadata(Metadata):
    """The Metadata of a columnar plan, handed to the storage writer's ``finish``: its fields are built from
    the arrays (:func:`to_metadata`) on first use, and a writer that declares the columnar commit builds the
    document from ``plan`` instead, without them (at thousands of ranks they are millions of objects)."""

    def __init__(self, plan: ColumnarPlan) -> None:  # noqa: D107 - replaces the dataclass __init__ on purpose
        object.__setattr__(self, "plan", plan)

    def __getattribute__(self, name: str) -> Any:
        if name in _FIELDS:
            state = object.__getattribute__(self, "__dict__")
            if "state_dict_metadata" not in state:
                md = to_metadata(state["plan"])
                state.update({f: getattr(md, f) for f in _FIELDS if f not in state})
        return object.__getattribute__(self, name)

    @property  # type: ignore[misc]
    def __class__(self):  # noqa: D105 - compares, copies and prints as the Metadata it stands for
        return Metadata

    def __reduce__(self):
        return (Metadata, tuple(getattr(self, f) for f in _FIELDS))
