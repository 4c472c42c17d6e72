"""The plan of shared reads (shared_reads.py): which stored chunks each rank reads, which of them one rank reads for
the others, and the messages that carry them, in the one order every rank walks them. Pure: tables in, payloads
out, nothing read or sent."""

from __future__ import annotations

import hashlib
import struct
from typing import Any, NamedTuple, Optional

import numpy as np

from ..errors import CorruptCheckpointError
from ..format.locations import ChunkLocations
from ..format.records import FileStorageData, ForeignStorageData
from ..item_columns import BYTES, ReadColumns
from ..metadata import Metadata
from ..planner import LoadItemType, LoadPlan
from .chunk_reads import ChunkShapes
from .shared_verification import partial_chunks

__all__ = ["Shares", "Message", "planned_chunks", "may_share", "encode_table", "decode_table", "plan_shares",
           "fingerprint", "node_number", "SEND", "RECEIVE", "ERROR_BYTES"]

SEND, RECEIVE = 1, 2
# chunk count, the bucket size this rank proposes, whether it verifies checksums, the checkpoint it reads (fingerprint)
_TABLE = struct.Struct("<QQQQQ")
_COLUMNS = 6
_ALIGN = 64  # pieces start at multiples of this in a message, so that any dtype views them in place
ERROR_BYTES = 512  # a failed piece's message, in every message's tail
Key = tuple  # (file name, offset)


def planned_chunks(md: Metadata, plan: LoadPlan) -> list[tuple[int, ...]]:
    """The stored chunks ``plan`` reads, each once: (file, offset, length, bytes of one row, or the whole length
    where a chunk is not cut: values, chunks through a codec, scalars; and the range of its bytes this rank needs,
    whole rows: first, end). Empty chunks are left out."""
    fsd: FileStorageData = md.storage_data
    locations = fsd.items
    shapes = ChunkShapes(md)
    at: dict = {}
    out: list[list] = []
    apart: set = set()  # offsets that items of other lengths share (views of one storage): read by this rank alone

    def add(name: str, offset: int, length: int, rows: Optional[int], codec: str, span: Optional[tuple]) -> None:
        if length <= 0:
            return
        row = length // rows if rows and codec == "identity" and length % rows == 0 else length
        first, end = (0, length) if span is None or row == length else (span[0] * row, span[1] * row)
        j = at.get((name, offset))
        if j is None:
            at[(name, offset)] = len(out)
            out.append([name, offset, length, row, first, end])
        elif out[j][2] != length:
            apart.add(j)
        elif out[j][3] != row:  # one storage viewed with two shapes (tied weights): travels whole
            out[j][3:] = [length, 0, length]
        else:
            out[j][4], out[j][5] = min(out[j][4], first), max(out[j][5], end)

    items = plan.items
    if isinstance(items, ReadColumns) and items.intact and isinstance(locations, ChunkLocations):
        tensors = [i for i, code in enumerate(items.code) if code != BYTES]
        rows = locations.rows([items.fqn[i] for i in tensors], [items.chunk_offsets[i] for i in tensors])
        names = [name for name, _ in locations.file_list]
        for i, row in zip(tensors, rows):
            if row is None:
                raise CorruptCheckpointError(f"key {items.fqn[i]!r} chunk {list(items.chunk_offsets[i])} has no storage "
                                             "entry in the metadata")
            size = items.size[i]
            add(names[locations.file_no[row]], locations.begin[row], locations.length[row], size[0] if size else None,
                "identity", None)
        items = items.general + [items.column_item(i) for i, code in enumerate(items.code) if code == BYTES]
    for item in items:
        index = item.storage_index
        info = locations.get(index)
        if info is None:
            raise CorruptCheckpointError(f"key {index.fqn!r} chunk {list(index.offset or [])} has no storage entry in "
                                         "the metadata")
        shape = shapes.get(index) if item.type == LoadItemType.TENSOR else None
        span = (item.storage_offsets[0], item.storage_offsets[0] + item.lengths[0]) if shape else None
        add(info.file, info.offset, info.length, shape[0] if shape else None, info.codec, span)
    return [tuple(c) for j, c in enumerate(out) if j not in apart]


def may_share(md: Metadata, plan: LoadPlan, held_alone: set) -> bool:
    """Whether another rank of the load may need a chunk ``plan`` reads: one read partly, or into a destination
    not in ``held_alone`` (keys no other rank holds any part of). Where no rank may, chunk lists are not exchanged."""
    items = plan.items
    if isinstance(items, ReadColumns) and items.intact:
        if any(fqn not in held_alone for fqn in items.fqn):  # a column item's destination has the chunk's key
            return True
        items = items.general
    if any(item.dest_index.fqn not in held_alone for item in items):
        return True
    return bool(partial_chunks(md, plan))


def fingerprint(md: Metadata) -> int:
    """64 bits that differ between checkpoints: the save id, the data files (names, sizes, header checksums), and
    where the checkpoint records no save id (another program's), its path. Ranks share the reads of one checkpoint
    only: a rank loading another save (a node-local copy of another step) is never sent its peers' bytes."""
    fsd: FileStorageData = md.storage_data
    h = hashlib.blake2b(digest_size=8)
    parts = [str(fsd.save_id), type(fsd).__name__, fsd.layout if isinstance(fsd, ForeignStorageData) else ""]
    if not fsd.save_id:
        parts.append(str(md.storage_meta.checkpoint_id if md.storage_meta is not None else None))
    parts += [f"{name}\0{info.size}\0{info.header_crc32c}" for name, info in sorted(fsd.files.items())]
    for part in parts:
        h.update(part.encode("utf-8", "surrogatepass") + b"\1")
    return int.from_bytes(h.digest(), "little")


_VERIFY, _CACHED, _ALWAYS = 1, 2, 4  # flags of a table: verifies checksums, reads through a page cache, shares "on"


def node_number(name: str) -> int:
    """A node's name (knobs.node_id) as a number for a table's header."""
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=7).digest(), "little")


def encode_table(md: Metadata, chunks: list[tuple], bucket: int, verify: bool, cached: bool = False,
                 always: bool = True, node: int = 0) -> bytes:
    """``chunks`` as six little-endian int64 columns (file number, offset, length, row bytes, the range needed:
    first and end byte), after a header (count, bucket, flags: whether this rank verifies checksums, reads through
    its node's page cache, shares whatever the nodes; the checkpoint's :func:`fingerprint`; this rank's node)."""
    file_no = {name: i for i, name in enumerate(md.storage_data.files)}
    table = np.array([(file_no[c[0]],) + tuple(c[1:]) for c in chunks], dtype="<i8")
    flags = (_VERIFY if verify else 0) | (_CACHED if cached else 0) | (_ALWAYS if always else 0)
    return (_TABLE.pack(len(chunks), bucket, flags, fingerprint(md), node)
            + table.reshape(-1, _COLUMNS).T.copy().tobytes())


def decode_table(raw: bytes) -> tuple[np.ndarray, int, bool, int, int, bool, bool]:
    """The (6, n) table, the bucket size, the verify flag, the fingerprint, the node and the cached and always flags
    :func:`encode_table` wrote."""
    if len(raw) < _TABLE.size:
        raise CorruptCheckpointError("chunk table from a rank is truncated")
    n, bucket, flags, print_, node = _TABLE.unpack_from(raw)
    verify = flags & _VERIFY
    if len(raw) != _TABLE.size + 8 * _COLUMNS * n or bucket < 1:
        raise CorruptCheckpointError("chunk table from a rank has the wrong length")
    table = np.frombuffer(raw, dtype="<i8", offset=_TABLE.size).reshape(_COLUMNS, n)
    if n and (table[2].min() < 1 or table[3].min() < 1 or table[0].min() < 0 or table[1].min() < 0
              or (table[4] < 0).any() or (table[5] > table[2]).any() or (table[4] >= table[5]).any()):
        raise CorruptCheckpointError("chunk table from a rank has negative, empty or out-of-chunk entries")
    return table, bucket, bool(verify), print_, node, bool(flags & _CACHED), bool(flags & _ALWAYS)


def _overlap(spans: list[tuple[int, int]]) -> bool:
    """Whether any two of the byte ranges meet."""
    spans = sorted(spans)
    return any(b[0] < a[1] for a, b in zip(spans, spans[1:]))


def _pick_readers(tables: list[np.ndarray], verify: bool, verifying: Optional[list[bool]] = None,
                  kinds: Optional[list[int]] = None, nodes: Optional[list[int]] = None) -> tuple[dict, dict, dict]:
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
    load = [0] * len(tables)
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
        level = (total + sum(load[r] for r in ranks)) / len(ranks)
        at = 0
        for key in keys:
            while at < len(order) - 1 and load[order[at]] + sizes[key][0] / 2 > level:
                at += 1
            reader[key] = order[at]
            load[order[at]] += sizes[key][0]
    return needers, sizes, reader


def plan_shares(tables: list[np.ndarray], bucket: int, verify: bool = True, verifying: Optional[list[bool]] = None,
                kinds: Optional[list[int]] = None, nodes: Optional[list[int]] = None) -> list[bytes]:
    """The coordinator's step: every rank's table of chunks -> one payload per rank (:meth:`Shares.decode`),
    the messages it sends or receives, in the one order every rank walks them (``verify``: whether the ranks
    verify checksums; ``verifying``, ``kinds``, ``nodes``: each rank's, see :func:`_pick_readers`)."""
    needers, sizes, reader = _pick_readers(tables, verify, verifying, kinds, nodes)
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


class Message(NamedTuple):
    """One buffer from ``src`` to ``receivers``: ``pieces`` are (chunk key, first byte, end byte) of chunks."""

    src: int
    receivers: tuple[int, ...]
    pieces: list[tuple[Key, int, int]]

    def layout(self) -> tuple[list[int], int]:
        """Where each piece starts in the buffer, and the buffer's size: the pieces, their status bytes, and the
        first failure's text."""
        starts, end = [], 0
        for _, b0, b1 in self.pieces:
            end = -(-end // _ALIGN) * _ALIGN
            starts.append(end)
            end += b1 - b0
        return starts, end + len(self.pieces) + ERROR_BYTES


class Shares:
    """This rank's part of the shared reads of one load: which of its chunks it sends or receives, and the
    messages it takes part in, in order."""

    def __init__(self, messages: list[Message], rank: int, peers: Any, lengths: dict[Key, int]) -> None:
        """``peers``: the transport (shared_reads.Peers), kept for the exchange; the plan reads its rank and size."""
        self.messages, self.rank, self.peers, self.lengths = messages, rank, peers, lengths
        self.walked = False  # whether this rank has begun walking its messages (exchange)
        self.roles: dict[Key, int] = {}
        for m in messages:
            for key, _, _ in m.pieces:
                self.roles[key] = SEND if m.src == rank else RECEIVE

    @classmethod
    def decode(cls, payload: bytes, chunks: list[tuple[str, int, int, int]], peers: Any) -> "Shares":
        """This rank's payload from :func:`plan_shares`, its chunk numbers resolved against ``chunks`` (this rank's
        table, in order)."""
        if len(payload) < 16 or (len(payload) - 16) % 8:
            raise CorruptCheckpointError("shared-read plan from the coordinator is malformed")
        _, count = struct.unpack_from("<QQ", payload)
        row = np.frombuffer(payload, dtype="<i8", offset=16).tolist()
        messages, at = [], 0
        world = peers.world_size
        try:
            for _ in range(count):
                src, n_recv, n_pieces = row[at:at + 3]
                if n_recv == -1:  # every other rank
                    receivers, n_recv = tuple(r for r in range(world) if r != src), 0
                elif n_recv < 0:
                    raise ValueError("negative receiver count")
                else:
                    receivers = tuple(row[at + 3:at + 3 + n_recv])
                at += 3 + n_recv
                pieces = []
                for _ in range(n_pieces):
                    j, b0, b1 = row[at:at + 3]
                    if j < 0:
                        raise ValueError("chunk number below zero")
                    name, offset, length = chunks[j][:3]
                    if not 0 <= b0 < b1 <= length:
                        raise ValueError("piece outside its chunk")
                    pieces.append(((name, offset), b0, b1))
                    at += 3
                if not 0 <= src < world or any(not 0 <= r < world for r in receivers) or not pieces:
                    raise ValueError("rank out of range")
                if src in receivers or len(set(receivers)) != len(receivers):
                    raise ValueError(f"message from rank {src} lists a receiver twice, or its sender")
                if peers.rank != src and peers.rank not in receivers:
                    raise ValueError(f"a message from rank {src} to ranks {list(receivers)} is not this rank's")
                messages.append(Message(src, receivers, pieces))
        except (ValueError, IndexError) as exc:
            raise CorruptCheckpointError(f"shared-read plan from the coordinator is malformed: {exc}") from None
        if at != len(row):
            raise CorruptCheckpointError("shared-read plan from the coordinator has trailing entries")
        return cls(messages, peers.rank, peers, {(c[0], c[1]): c[2] for c in chunks})


