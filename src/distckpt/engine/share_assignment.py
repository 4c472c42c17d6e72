"""The coordinator's step of shared reads: every rank's table of the stored chunks it reads -> which rank reads each
chunk needed by several, and the messages that carry them, one payload per rank.

Ranks whose tables are the same (a replicated state, data-parallel replicas of one shard) are one class: their
entries are planned once, and they get one payload, since a message goes to every rank of the set needing its
chunks and so to the whole class. The work is array work over the classes' entries (sorts, group sums,
searches); Python loops run over sets of ranks, classes and messages, never over entries. Planning a load thus
costs the distinct tables plus the ranks, not ranks times chunks. Pure: tables in, payloads out.

The rules (``tests/unit/share_reference.py`` states them entry by entry, and the two must agree byte for byte):

- A chunk is shared where several ranks need it and some of its bytes are needed twice, or where checksums are
  verified (its checksum covers it whole: read once, it need not be read again in parts), and, where nodes are
  given, the ranks needing it are on more than one node. Ranks that disagree on its length each read their own.
- The ranks that need the same shared chunks split them, in file order, into runs, one run per rank, sized to even
  out what every rank reads (what it reads for itself alone included); only ranks verifying checksums read a chunk
  that such a rank needs.
- The chunks one rank reads for one set of receivers go in messages of at most ``bucket`` bytes (whole rows), and
  the senders' messages are taken in turn, so that while one message travels its receivers read their next.
"""

from __future__ import annotations

import struct
from typing import NamedTuple, Optional

import numpy as np

from ..errors import CorruptCheckpointError

__all__ = ["plan_shares"]

_RANDOM = np.random.default_rng(0x5EED).integers(0, np.iinfo(np.int64).max, size=(2, 1 << 16), dtype=np.int64)


class _Classes(NamedTuple):
    """Ranks with equal tables (and reading the same checkpoint), numbered by their lowest rank."""

    of_rank: np.ndarray
    ranks: list  # each class's ranks, ascending
    tables: list  # each class's table, (6, n)
    kind: np.ndarray


def _classes(tables: list, kinds: Optional[list[int]]) -> _Classes:
    world = len(tables)
    of_rank = np.empty(world, dtype=np.int64)
    found: dict[tuple, list[int]] = {}
    reps: list = []
    kind: list = []
    for r, raw in enumerate(tables):
        t = np.asarray(raw, dtype=np.int64).reshape(6, -1)
        k = kinds[r] if kinds is not None else 0
        sign = (k, t.shape[1], int(t.sum()), t[:, :1].tobytes(), t[:, -1:].tobytes())  # a cheap first sort
        same = found.setdefault(sign, [])
        for c in same:
            if np.array_equal(reps[c], t):
                break
        else:
            c = len(reps)
            reps.append(t)
            kind.append(k)
            same.append(c)
        of_rank[r] = c
    by_class = np.argsort(of_rank, kind="stable")
    cut = np.searchsorted(of_rank[by_class], np.arange(len(reps) + 1))
    return _Classes(of_rank, [by_class[a:b] for a, b in zip(cut[:-1], cut[1:])], reps, np.array(kind, dtype=np.int64))


class _Entries(NamedTuple):
    """The classes' table entries, sorted by chunk (kind, file, offset) and then by class; ``start`` begins each
    chunk's group of entries."""

    cls: np.ndarray
    row: np.ndarray  # the entry's row in its class's table
    cols: np.ndarray  # (6, n): file, offset, length, row bytes, first and end byte needed
    group: np.ndarray  # the chunk each entry is of, numbered in key order
    start: np.ndarray
    first_seen: np.ndarray  # per chunk: where the ranks' own order first meets it (rank-major place)


def _entries(k: _Classes, rank_counts: np.ndarray) -> _Entries:
    counts = np.array([t.shape[1] for t in k.tables], dtype=np.int64)
    cols = np.concatenate(k.tables, axis=1) if k.tables else np.zeros((6, 0), dtype=np.int64)
    cls = np.repeat(np.arange(len(k.tables), dtype=np.int64), counts)
    row = np.arange(cols.shape[1], dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    kind = k.kind[cls]
    order = _key_order(kind, cols[0], cols[1])  # stable: classes in order, a class's duplicates in table order
    cls, row, cols, kind = cls[order], row[order], cols[:, order], kind[order]
    same_key = (kind[1:] == kind[:-1]) & (cols[0, 1:] == cols[0, :-1]) & (cols[1, 1:] == cols[1, :-1])
    lowest = np.array([int(r[0]) for r in k.ranks], dtype=np.int64)  # a class's first rank
    twice = np.flatnonzero(same_key & (cls[1:] == cls[:-1]))
    if twice.size:
        at = twice[np.argmin(order[twice + 1])]  # the first the ranks' own order meets
        raise CorruptCheckpointError(f"chunk table from rank {int(lowest[cls[at]])} lists file {int(cols[0, at])} "
                                     f"offset {int(cols[1, at])} twice")
    start = np.flatnonzero(np.concatenate(([True], ~same_key))) if cls.size else np.zeros(0, dtype=np.int64)
    group = np.cumsum(np.concatenate(([0], ~same_key)), dtype=np.int64) if cls.size else cls
    rank_at = np.cumsum(rank_counts) - rank_counts  # where each rank's entries begin in rank-major order
    return _Entries(cls, row, cols, group, start, rank_at[lowest[cls[start]]] + row[start])


def _key_order(kind: np.ndarray, f: np.ndarray, o: np.ndarray) -> np.ndarray:
    """The stable order of entries by (kind, file, offset): one sort of a single number where the three fit in 63
    bits (they do but for files of over a petabyte), else a sort by the three."""
    if not kind.size:
        return np.zeros(0, dtype=np.int64)
    spans = [int(kind.max()) + 1, int(f.max()) + 1, int(o.max()) + 1]
    if spans[0] * spans[1] * spans[2] < 1 << 62:
        return np.argsort((kind * spans[1] + f) * spans[2] + o, kind="stable")
    return np.lexsort((o, f, kind))


def _any(flags: np.ndarray, start: np.ndarray) -> np.ndarray:
    return np.add.reduceat(flags.astype(np.int64), start) > 0 if start.size else np.zeros(0, dtype=bool)


def _sums(bins: np.ndarray, amounts: np.ndarray, size: int) -> np.ndarray:
    """Sums of ``amounts`` by bin, exact (bytes stay far below 2**53, where float sums are exact)."""
    return np.rint(np.bincount(bins, weights=amounts.astype(np.float64), minlength=size)).astype(np.int64)


class _Chunks(NamedTuple):
    length: np.ndarray  # per chunk: its length, and the bytes of one row as it travels
    row: np.ndarray
    shared: np.ndarray  # per chunk: read by one rank for the others
    load: np.ndarray  # per rank: bytes it reads for itself alone


def _classify(e: _Entries, k: _Classes, verify: bool, nodes: Optional[list[int]]) -> _Chunks:
    f, o, n, row, first, end = e.cols
    length = n[e.start]
    size = np.array([r.size for r in k.ranks], dtype=np.int64)
    count = np.add.reduceat(size[e.cls], e.start) if e.start.size else np.zeros(0, dtype=np.int64)
    apart = _any(n != length[e.group], e.start)  # ranks disagree on its length: views of one storage, or forged
    row_bytes = np.where(_any(row != row[e.start][e.group], e.start), length, row[e.start])  # two shapes: whole
    shared = (count > 1) & ~apart
    if not verify:  # then only chunks of which some bytes are needed twice
        shared &= _overlap(e, first, end, size)
    if nodes is not None and e.start.size:
        node = np.asarray(nodes, dtype=np.int64)
        low = np.array([node[r].min() for r in k.ranks], dtype=np.int64)
        high = np.array([node[r].max() for r in k.ranks], dtype=np.int64)
        shared &= np.minimum.reduceat(low[e.cls], e.start) != np.maximum.reduceat(high[e.cls], e.start)
    alone = ~shared[e.group]
    own = np.where(apart[e.group], n, length[e.group] if verify else end - first)
    return _Chunks(length, row_bytes, shared, _sums(e.cls[alone], own[alone], len(k.ranks))[k.of_rank])


def _overlap(e: _Entries, first: np.ndarray, end: np.ndarray, size: np.ndarray) -> np.ndarray:
    """Per chunk: whether two of the ranks needing it need some of the same bytes."""
    overlap = _any(size[e.cls] > 1, e.start)  # ranks of one class need the very same bytes
    picks = np.flatnonzero((np.diff(np.append(e.start, e.cls.size)) > 1)[e.group])
    by_span = picks[np.lexsort((end[picks], first[picks], e.group[picks]))]
    g, s0, s1 = e.group[by_span], first[by_span], end[by_span]
    overlap[g[1:][(g[1:] == g[:-1]) & (s0[1:] < s1[:-1])]] = True
    return overlap


class _Sets(NamedTuple):
    """The distinct sets of ranks that need shared chunks: each set's ranks and classes, and each chunk's set."""

    ranks: list
    classes: list
    of_chunk: np.ndarray


def _rank_sets(e: _Entries, k: _Classes, chunks: np.ndarray) -> _Sets:
    """Sets are told apart by two sums of random numbers per rank (wrapping), then checked exactly."""
    if not chunks.size:
        return _Sets([], [], np.zeros(0, dtype=np.int64))
    ends = np.append(e.start, e.cls.size)
    count = ends[chunks + 1] - e.start[chunks]
    starts = np.cumsum(count) - count
    members = e.cls[np.repeat(e.start[chunks] - starts, count) + np.arange(int(count.sum()), dtype=np.int64)]
    marks = [np.array([int((_RANDOM[h][r % _RANDOM.shape[1]] * (1 + r // _RANDOM.shape[1])).sum()) for r in k.ranks],
                      dtype=np.int64) for h in (0, 1)]
    hashed = [np.add.reduceat(m[members], starts) for m in marks]
    _, rep, of_chunk = np.unique(np.stack([count, hashed[0], hashed[1]], axis=1), axis=0, return_index=True,
                                 return_inverse=True)
    of_chunk = of_chunk.reshape(-1)
    if not (members == members[np.repeat(starts[rep[of_chunk]] - starts, count) + np.arange(members.size)]).all():
        lists = [tuple(members[s:s + c].tolist()) for s, c in zip(starts.tolist(), count.tolist())]
        number = {x: i for i, x in enumerate(sorted(set(lists)))}  # two sets with equal sums: their classes decide
        of_chunk = np.array([number[x] for x in lists], dtype=np.int64)
        rep = np.unique(of_chunk, return_index=True)[1]
    classes = [members[starts[r]:starts[r] + count[r]] for r in rep.tolist()]
    ranks = [np.sort(np.concatenate([k.ranks[c] for c in cs.tolist()])) for cs in classes]
    return _Sets(ranks, classes, of_chunk)


def _assign(sets: list[np.ndarray], set_of: np.ndarray, sizes: np.ndarray, first_seen: np.ndarray, load: np.ndarray,
            verifying: Optional[list[bool]], min_run: int) -> np.ndarray:
    """The reader of each shared chunk (given in key order with its size and first sighting): each set, largest
    total first, splits its chunks into runs, one a rank, the least loaded ranks first, up to the level that evens
    out the set's ranks. A rank takes the next chunk while its load plus half the chunk stays within the level.
    A set whose chunks come to less than ``min_run`` bytes a rank is read by fewer ranks, the least loaded, about
    ``min_run`` each: at thousands of ranks a small state is not sent in thousands of tiny messages."""
    reader = np.zeros(sizes.size, dtype=np.int64)
    if not sizes.size:
        return reader
    by_set = np.argsort(set_of, kind="stable")
    bounds = np.searchsorted(set_of[by_set], np.arange(len(sets) + 1))
    totals = np.add.reduceat(sizes[by_set], bounds[:-1])
    seen = np.minimum.reduceat(first_seen[by_set], bounds[:-1])
    checks = np.asarray(verifying, dtype=bool) if verifying is not None else None
    for s in np.lexsort((seen, -totals)).tolist():
        keys = by_set[bounds[s]:bounds[s + 1]]
        ranks = sets[s]
        order = ranks[np.lexsort((ranks, load[ranks]))]
        if checks is not None and checks[order].any():
            order = order[checks[order]]
        z = sizes[keys]
        before = np.concatenate(([0], np.cumsum(z)))
        edge = 2 * before[:-1] + z  # increasing: twice the bytes before a chunk plus the chunk
        m, level2 = len(ranks), 2 * (int(totals[s]) + int(load[ranks].sum()))
        readers = max(1, -(-int(totals[s]) // min_run))
        if readers < len(order):  # the level of the ranks that read
            order = order[:readers]
            m, level2 = readers, 2 * (int(totals[s]) + int(load[order].sum()))
        at = 0
        for a, q in enumerate(order.tolist()):
            if at == keys.size:
                break
            if a == len(order) - 1:
                end = keys.size
            else:  # take chunk i while 2m (load + bytes taken) + m size_i <= 2 (total + loads)
                room = level2 - 2 * m * (int(load[q]) - int(before[at]))
                end = int(np.searchsorted(edge, room // m, side="right")) if room >= 0 else at
            if end > at:
                reader[keys[at:end]] = q
                load[q] += int(before[end] - before[at])
                at = end
    return reader


class _Message(NamedTuple):
    src: int
    receivers: np.ndarray  # ascending, without src
    chunks: np.ndarray  # shared-chunk numbers (into the shared list), one per piece
    b0: np.ndarray
    b1: np.ndarray
    set: int  # the set of ranks it goes to (sender and receivers)


def _messages(sets: list[np.ndarray], set_of: np.ndarray, reader: np.ndarray, length: np.ndarray, row: np.ndarray,
              bucket: int) -> list[_Message]:
    """Each reader's chunks for each set of receivers, cut into pieces of whole rows and packed in order into
    messages of at most ``bucket`` bytes (a piece larger than that travels alone); the senders taken in turn."""
    if not reader.size:
        return []
    pair = np.lexsort((set_of, reader))  # by sender, then set; chunks stay in key order within each
    src_sorted, set_sorted = reader[pair], set_of[pair]
    cut = np.flatnonzero(np.concatenate(([True], (src_sorted[1:] != src_sorted[:-1]) | (set_sorted[1:] != set_sorted[:-1]))))
    groups = []
    for a, b in zip(cut.tolist(), np.append(cut[1:], pair.size).tolist()):
        src, members = int(src_sorted[a]), sets[int(set_sorted[a])]
        groups.append((src, members[members != src], pair[a:b], int(set_sorted[a])))
    _receivers_in_order(groups)
    turns: dict[int, list[_Message]] = {}
    for src, receivers, chunks, set_no in groups:
        n, r = length[chunks], row[chunks]
        step = np.maximum(r, bucket // r * r)
        pieces = -(-n // step)
        idx = np.repeat(chunks, pieces)
        k = np.arange(int(pieces.sum()), dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        b0 = k * np.repeat(step, pieces)
        b1 = np.minimum(b0 + np.repeat(step, pieces), np.repeat(n, pieces))
        held = np.concatenate(([0], np.cumsum(b1 - b0)))
        at = 0
        while at < idx.size:
            end = max(at + 1, int(np.searchsorted(held, held[at] + bucket, side="right")) - 1)
            turns.setdefault(src, []).append(_Message(src, receivers, idx[at:end], b0[at:end], b1[at:end], set_no))
            at = end
    lists = [turns[s] for s in sorted(turns)]
    return [t[i] for i in range(max(len(t) for t in lists)) for t in lists if i < len(t)]


def _receivers_in_order(groups: list) -> None:
    """Within one sender's groups (in place), the sets of receivers in the order their tuples compare."""
    at = 0
    while at < len(groups):
        end = at + 1
        while end < len(groups) and groups[end][0] == groups[at][0]:
            end += 1
        if end - at > 1:
            groups[at:end] = sorted(groups[at:end], key=lambda g: g[1].tolist())
        at = end


def _payloads(messages: list, sets: _Sets, n_classes: int, world: int, bucket: int, member_key: np.ndarray,
              member_row: np.ndarray) -> list[bytes]:
    """Each class's payload: for every message it takes part in (those of the sets holding it), in order, the head
    (sender, receivers: -1 for every other rank, pieces) and each piece as (its chunk's row in the class's table,
    first byte, end byte). ``member_key``: ascending ``chunk * classes + class`` for the classes needing each shared
    chunk, ``member_row`` that class's row of it."""
    if not messages:
        return [struct.pack("<QQ", bucket, 0)] * n_classes
    heads, who, which = [], [], []
    for i, m in enumerate(messages):
        everyone = m.receivers.size == world - 1
        heads.append(np.array([m.src, -1 if everyone else m.receivers.size, m.chunks.size]
                              + ([] if everyone else m.receivers.tolist()), dtype=np.int64))
        who.append(sets.classes[m.set])
        which.append(np.full(who[-1].size, i, dtype=np.int64))
    who, which = np.concatenate(who), np.concatenate(which)
    by_class = np.argsort(who, kind="stable")  # each class's messages stay in their global order
    who, which = who[by_class], which[by_class]
    head_len = np.array([h.size for h in heads], dtype=np.int64)
    n_pieces = np.array([m.chunks.size for m in messages], dtype=np.int64)
    hl, npc = head_len[which], n_pieces[which]
    seg = hl + 3 * npc
    seg_at = np.cumsum(seg) - seg
    out = np.empty(int(seg.sum()), dtype=np.int64)
    ramp = _ramp(hl)
    out[np.repeat(seg_at, hl) + ramp] = np.concatenate(heads)[np.repeat((np.cumsum(head_len) - head_len)[which], hl) + ramp]
    chunk = np.concatenate([m.chunks for m in messages])
    b0 = np.concatenate([m.b0 for m in messages])
    b1 = np.concatenate([m.b1 for m in messages])
    ramp = _ramp(npc)
    piece = np.repeat((np.cumsum(n_pieces) - n_pieces)[which], npc) + ramp
    found = np.searchsorted(member_key, chunk[piece] * n_classes + np.repeat(who, npc))
    place = np.repeat(seg_at + hl, npc) + 3 * ramp
    out[place], out[place + 1], out[place + 2] = member_row[found], b0[piece], b1[piece]
    count = np.bincount(who, minlength=n_classes)
    ends = np.cumsum(_sums(who, seg, n_classes))
    begins = ends - _sums(who, seg, n_classes)
    return [struct.pack("<QQ", bucket, int(count[c])) + out[begins[c]:ends[c]].tobytes() for c in range(n_classes)]


def _ramp(lengths: np.ndarray) -> np.ndarray:
    """0, 1, ... lengths[0]-1, 0, 1, ... lengths[1]-1, ..."""
    return np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)


def plan_shares(tables: list[np.ndarray], bucket: int, verify: bool = True, verifying: Optional[list[bool]] = None,
                kinds: Optional[list[int]] = None, nodes: Optional[list[int]] = None,
                own_bytes: Optional[list[int]] = None, min_run: int = 1) -> list[bytes]:
    """Every rank's table of chunks (:func:`~distckpt.engine.shared_plan.encode_table`'s columns) -> one payload per
    rank (:meth:`~distckpt.engine.shared_plan.Shares.decode`): the messages it sends or receives, in the one order
    every rank walks them. ``verify``: whether the ranks verify checksums; ``verifying``: whether each does;
    ``kinds``: which checkpoint each rank reads (equal numbers, the same one); ``nodes``: each rank's node, where
    ranks of one node need not share (their reads go through one page cache); ``own_bytes``: what each reads that
    it left out of its table (no other rank can need it), weighed with what it reads for itself alone; ``min_run``:
    the fewest bytes worth a rank's reading for the others (a smaller state is read by fewer ranks)."""
    world = len(tables)
    k = _classes(tables, kinds)
    e = _entries(k, np.array([np.asarray(t).reshape(6, -1).shape[1] for t in tables], dtype=np.int64))
    chunks = _classify(e, k, verify, nodes)
    if own_bytes is not None:
        chunks.load[:] += np.asarray(own_bytes, dtype=np.int64)
    shared = np.flatnonzero(chunks.shared)
    sets = _rank_sets(e, k, shared)
    reader = _assign(sets.ranks, sets.of_chunk, chunks.length[shared], e.first_seen[shared], chunks.load, verifying,
                     max(1, int(min_run)))
    messages = _messages(sets.ranks, sets.of_chunk, reader, chunks.length[shared], chunks.row[shared], bucket)
    ends = np.append(e.start, e.cls.size)
    count = ends[shared + 1] - e.start[shared]
    picks = np.repeat(e.start[shared] - np.cumsum(count) + count, count) + np.arange(int(count.sum()), dtype=np.int64)
    member_key = np.repeat(np.arange(shared.size, dtype=np.int64), count) * len(k.ranks) + e.cls[picks]
    by_class = _payloads(messages, sets, len(k.ranks), world, bucket, member_key, e.row[picks])
    return [by_class[c] for c in k.of_rank.tolist()]
