"""The rules of shared reads' assignment stated entry by entry, in plain Python: what the array version
(distckpt.engine.share_assignment.plan_shares) must answer byte for byte. Small inputs only: it is slow."""

from __future__ import annotations

import struct
from typing import Optional

import numpy as np

from distckpt.errors import CorruptCheckpointError


def _overlap(spans: list[tuple[int, int]]) -> bool:
    """Whether any two of the byte ranges meet."""
    spans = sorted(spans)
    return any(b[0] < a[1] for a, b in zip(spans, spans[1:]))


def _pick_readers(tables: list[np.ndarray], verify: bool, verifying: Optional[list[bool]] = None,
                  kinds: Optional[list[int]] = None, nodes: Optional[list[int]] = None,
                  own_bytes: Optional[list[int]] = None, min_run: int = 1) -> tuple[dict, dict, dict]:
    """For every chunk: the ranks (with its row in their table) that need it, its length and row bytes; and for
    each chunk to share, the rank that reads it.

    A chunk is shared where several ranks need it and some of its bytes are needed twice, or where checksums are
    verified (its checksum covers it whole: read once, it need not be read again in parts). Unverified chunks whose
    parts go to different ranks are read by each, its own part: storage serves each byte once either way.

    ``kinds``: which checkpoint each rank reads (equal numbers, the same one); a chunk is shared only among the
    ranks reading one checkpoint, and only where they agree on its length (else each reads its own: views of one
    storage, or forged metadata). ``verifying``: whether each rank verifies checksums; a chunk that a rank
    verifying them needs is read by such a rank, so that no rank is sent bytes checked less than it asked.
    ``nodes``: each rank's node, where ranks of one node need not share (their reads go through one page cache):
    a chunk only ranks of one node need is read by each of them."""
    needers: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    sizes: dict[tuple[int, int, int], tuple[int, int]] = {}
    spans: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    apart: set = set()
    for rank, table in enumerate(tables):
        kind = kinds[rank] if kinds is not None else 0
        for j, (f, o, n, row, first, end) in enumerate(table.T.tolist()):
            key = (kind, f, o)
            listed = needers.setdefault(key, [])
            if listed and listed[-1][0] == rank:
                raise CorruptCheckpointError(f"chunk table from rank {rank} lists file {f} offset {o} twice")
            listed.append((rank, j))
            spans.setdefault(key, []).append((first, end))
            known = sizes.get(key)
            if known is None or known == (n, row):
                sizes[key] = (n, row)
            elif known[0] != n:
                apart.add(key)
            else:  # one storage viewed with two shapes: sent whole
                sizes[key] = (n, n)
    load = list(own_bytes) if own_bytes is not None else [0] * len(tables)
    shared = []
    for key, ranks in needers.items():
        if key in apart:
            for (r, j) in ranks:
                load[r] += int(tables[r][2, j])
        elif (len(ranks) > 1 and (verify or _overlap(spans[key]))
              and (nodes is None or len({nodes[r] for r, _ in ranks}) > 1)):
            shared.append(key)
        else:
            for (r, _), (first, end) in zip(ranks, spans[key]):
                load[r] += sizes[key][0] if verify else end - first
    # each set of ranks needing the same chunks splits them into runs that are contiguous in the files, one run per
    # rank, sized to even out what every rank reads: a rank reading every other chunk would have its storage
    # read ahead into the chunks between (page cache read-ahead, an object store's larger ranges)
    by_set: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for key in shared:
        by_set.setdefault(tuple(sorted(r for r, _ in needers[key])), []).append(key)
    reader: dict[tuple[int, int], int] = {}
    for ranks, keys in sorted(by_set.items(), key=lambda kv: -sum(sizes[k][0] for k in kv[1])):
        keys.sort()
        total = sum(sizes[k][0] for k in keys)
        order = sorted(ranks, key=lambda r: (load[r], r))
        if verifying is not None and any(verifying[r] for r in order):
            order = [r for r in order if verifying[r]]
        level2 = 2 * (total + sum(load[r] for r in ranks))  # the level, times 2 len(ranks): exact in integers
        m = len(ranks)
        readers = max(1, -(-total // min_run))  # a small set's chunks: fewer readers, min_run bytes or so each
        if readers < len(order):
            order = order[:readers]
            m, level2 = readers, 2 * (total + sum(load[r] for r in order))
        at = 0
        for key in keys:
            while at < len(order) - 1 and 2 * m * load[order[at]] + m * sizes[key][0] > level2:
                at += 1
            reader[key] = order[at]
            load[order[at]] += sizes[key][0]
    return needers, sizes, reader


def plan_shares(tables: list[np.ndarray], bucket: int, verify: bool = True, verifying: Optional[list[bool]] = None,
                kinds: Optional[list[int]] = None, nodes: Optional[list[int]] = None,
                own_bytes: Optional[list[int]] = None, min_run: int = 1) -> list[bytes]:
    """The coordinator's step: every rank's table of chunks -> one payload per rank (:meth:`Shares.decode`),
    the messages it sends or receives, in the one order every rank walks them (``verify``: whether the ranks
    verify checksums; ``verifying``, ``kinds``, ``nodes``: each rank's, see :func:`_pick_readers`)."""
    needers, sizes, reader = _pick_readers(tables, verify, verifying, kinds, nodes, own_bytes, min_run)
    groups: dict[tuple[int, tuple[int, ...]], list[tuple[int, int]]] = {}
    for key, src in reader.items():
        receivers = tuple(sorted(r for r, _ in needers[key] if r != src))
        groups.setdefault((src, receivers), []).append(key)
    messages: list[tuple[int, tuple[int, ...], list[tuple[tuple[int, int], int, int]]]] = []
    for (src, receivers), keys in sorted(groups.items()):
        pieces: list = []
        held = 0
        for key in sorted(keys):
            length, row = sizes[key]
            step = max(row, bucket // row * row)
            for b0 in range(0, length, step):
                b1 = min(length, b0 + step)
                if pieces and held + (b1 - b0) > bucket:
                    messages.append((src, receivers, pieces))
                    pieces, held = [], 0
                pieces.append((key, b0, b1))
                held += b1 - b0
        if pieces:
            messages.append((src, receivers, pieces))
    # one order for every rank: the senders' messages taken in turn, so that while one message travels, its
    # receivers' own next messages are being read (exchange reads ahead)
    by_src: dict[int, list] = {}
    for message in messages:
        by_src.setdefault(message[0], []).append(message)
    turns = [by_src[src] for src in sorted(by_src)]
    messages = [m for at in range(max((len(t) for t in turns), default=0)) for t in turns if at < len(t) for m in (t[at],)]
    world = len(tables)
    rows: list[list[int]] = [[] for _ in tables]
    count = [0] * world
    row_of = {key: dict(ranks) for key, ranks in needers.items() if key in reader}  # chunk -> {rank: its row there}
    for src, receivers, pieces in messages:
        # a message to every other rank says so in one number (-1), not with the list of every rank
        head = [src, -1, len(pieces)] if len(receivers) == world - 1 else [src, len(receivers), len(pieces), *receivers]
        for rank in (src,) + receivers:
            rows[rank] += head
            for key, b0, b1 in pieces:
                rows[rank] += [row_of[key][rank], b0, b1]
            count[rank] += 1
    return [struct.pack("<QQ", bucket, count[r]) + np.array(rows[r], dtype="<i8").tobytes() for r in range(world)]


