"""The plan of shared reads (shared_reads.py): which stored chunks each rank reads, which of them one rank reads for
the others, and the messages that carry them, in the one order every rank walks them. Pure: tables in, payloads
out, nothing read or sent."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import numpy as np

from ..errors import CorruptCheckpointError
from ..format.locations import ChunkLocations
from ..format.records import FileStorageData, ForeignStorageData
from ..item_columns import BYTES, ReadColumns
from ..metadata import Metadata
from ..planner import LoadItemType, LoadPlan
from .chunk_reads import ChunkShapes
from .share_assignment import plan_shares
from .shared_verification import partial_chunks

__all__ = ["Shares", "Message", "planned_chunks", "may_share", "encode_table", "decode_table", "table_marks", "plan_shares",
           "fingerprint", "node_number", "SEND", "RECEIVE", "ERROR_BYTES"]

SEND, RECEIVE = 1, 2
# chunk count, the bucket size this rank proposes, whether it verifies checksums, the checkpoint it reads (fingerprint),
# its node, the bytes it reads that no other rank can need (not listed)
_TABLE = struct.Struct("<QQQQQQ")
_COLUMNS = 6
_MOST = 1 << 48  # no offset, length or byte count of a table reaches this
_ALIGN = 64  # pieces start at multiples of this in a message, so that any dtype views them in place
ERROR_BYTES = 512  # a failed piece's message, in every message's tail
Key = tuple  # (file name, offset)


def planned_chunks(md: Metadata, plan: LoadPlan, held_alone: Optional[set] = None) -> tuple[list[tuple[int, ...]], int]:
    """The stored chunks ``plan`` reads, each once: (file, offset, length, bytes of one row, or the whole length
    where a chunk is not cut: values, chunks through a codec, scalars; and the range of its bytes this rank needs,
    whole rows: first, end); and the bytes of the chunks left out as this rank's own. Left out: empty chunks, and
    chunks no other rank can need, read whole and only into keys of ``held_alone`` (no other rank holds an element
    of this rank's part of them)."""
    fsd: FileStorageData = md.storage_data
    locations = fsd.items
    shapes = ChunkShapes(md)
    at: dict = {}
    out: list[list] = []
    apart: set = set()  # offsets that items of other lengths share (views of one storage): read by this rank alone
    alone = held_alone or set()
    own: dict[int, bool] = {}  # chunks read only into keys held alone: whether an item reads it whole

    def add(name: str, offset: int, length: int, rows: Optional[int], codec: str, span: Optional[tuple], fqn: str,
            whole: bool) -> None:
        if length <= 0:
            return
        row = length // rows if rows and codec == "identity" and length % rows == 0 else length
        first, end = (0, length) if span is None or row == length else (span[0] * row, span[1] * row)
        j = at.get((name, offset))
        if j is None:
            j = at[(name, offset)] = len(out)
            out.append([name, offset, length, row, first, end])
            if fqn in alone:
                own[j] = whole
        elif out[j][2] != length:
            apart.add(j)
        elif out[j][3] != row:  # one storage viewed with two shapes (tied weights): travels whole
            out[j][3:] = [length, 0, length]
        else:
            out[j][4], out[j][5] = min(out[j][4], first), max(out[j][5], end)
        if j in own and fqn not in alone:
            del own[j]
        elif j in own:
            own[j] = own[j] or whole

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
            # a column item reads its chunk whole, into the key of the chunk
            add(names[locations.file_no[row]], locations.begin[row], locations.length[row], size[0] if size else None,
                "identity", None, items.fqn[i], True)
        items = items.general + [items.column_item(i) for i, code in enumerate(items.code) if code == BYTES]
    for item in items:
        index = item.storage_index
        info = locations.get(index)
        if info is None:
            raise CorruptCheckpointError(f"key {index.fqn!r} chunk {list(index.offset or [])} has no storage entry in "
                                         "the metadata")
        shape = shapes.get(index) if item.type == LoadItemType.TENSOR else None
        span = (item.storage_offsets[0], item.storage_offsets[0] + item.lengths[0]) if shape else None
        whole = item.type != LoadItemType.TENSOR or (shape is not None and not any(item.storage_offsets)
                                                     and tuple(item.lengths) == tuple(shape))
        add(info.file, info.offset, info.length, shape[0] if shape else None, info.codec, span, item.dest_index.fqn, whole)
    mine = {j for j, whole in own.items() if whole and j not in apart}
    return ([tuple(c) for j, c in enumerate(out) if j not in apart and j not in mine],
            sum(out[j][2] for j in mine))


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
                 always: bool = True, node: int = 0, own_bytes: int = 0) -> bytes:
    """``chunks`` as six little-endian int64 columns (file number, offset, length, row bytes, the range needed:
    first and end byte), after a header (count, bucket, flags: whether this rank verifies checksums, reads through
    its node's page cache, shares whatever the nodes; the checkpoint's :func:`fingerprint`; this rank's node; the
    bytes it reads that are left out of the table as its own)."""
    file_no = {name: i for i, name in enumerate(md.storage_data.files)}
    table = np.array([(file_no[c[0]],) + tuple(c[1:]) for c in chunks], dtype="<i8")
    flags = (_VERIFY if verify else 0) | (_CACHED if cached else 0) | (_ALWAYS if always else 0)
    return (_TABLE.pack(len(chunks), bucket, flags, fingerprint(md), node, own_bytes)
            + table.reshape(-1, _COLUMNS).T.copy().tobytes())


def table_marks(raw: bytes) -> tuple[int, int]:
    """Two independent hashes of a chunk table: a digest below 2**62 (ranks with equal tables send one of them) and
    a check the coordinator's answer carries (a rank planned on another's table of the same digest finds out)."""
    digest = int.from_bytes(hashlib.blake2b(raw, digest_size=8, person=b"distckpt-table").digest(), "little") >> 2
    check = int.from_bytes(hashlib.blake2b(raw, digest_size=8, person=b"distckpt-check").digest(), "little")
    return digest, check


def decode_table(raw: bytes) -> tuple[np.ndarray, int, bool, int, int, bool, bool, int]:
    """The (6, n) table, the bucket size, the verify flag, the fingerprint, the node, the cached and always flags and
    the bytes left out as the rank's own, as :func:`encode_table` wrote them."""
    if len(raw) < _TABLE.size:
        raise CorruptCheckpointError("chunk table from a rank is truncated")
    n, bucket, flags, print_, node, own_bytes = _TABLE.unpack_from(raw)
    verify = flags & _VERIFY
    if len(raw) != _TABLE.size + 8 * _COLUMNS * n or bucket < 1:
        raise CorruptCheckpointError("chunk table from a rank has the wrong length")
    table = np.frombuffer(raw, dtype="<i8", offset=_TABLE.size).reshape(_COLUMNS, n)
    if n and (table[2].min() < 1 or table[3].min() < 1 or table[0].min() < 0 or table[1].min() < 0
              or (table[4] < 0).any() or (table[5] > table[2]).any() or (table[4] >= table[5]).any()):
        raise CorruptCheckpointError("chunk table from a rank has negative, empty or out-of-chunk entries")
    # bytes and offsets far past any checkpoint's (2**48 is 256 TiB) would overflow the planner's integer sums
    if own_bytes >= _MOST or (n and (table[1].max() >= _MOST or table[2].max() >= _MOST)):
        raise CorruptCheckpointError("chunk table from a rank has offsets or lengths past any checkpoint's (2**48 bytes)")
    return table, bucket, bool(verify), print_, node, bool(flags & _CACHED), bool(flags & _ALWAYS), own_bytes


class EveryRankBut(Sequence):
    """The ranks of a group but one, in order, without listing them: a message to every other rank names its
    receivers so, and a rank walking thousands of such messages holds a number, not thousands of tuples."""

    __slots__ = ("world", "src")

    def __init__(self, world: int, src: int) -> None:
        self.world, self.src = world, src

    def __len__(self) -> int:
        return self.world - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self)[i]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        return i if i < self.src else i + 1

    def __contains__(self, rank: object) -> bool:
        return isinstance(rank, int) and 0 <= rank < self.world and rank != self.src

    def __iter__(self):
        yield from range(self.src)
        yield from range(self.src + 1, self.world)

    def __radd__(self, other: tuple) -> tuple:
        return tuple(other) + tuple(self)

    def __eq__(self, other: object) -> bool:
        return tuple(self) == tuple(other) if isinstance(other, (tuple, EveryRankBut)) else NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"EveryRankBut(world={self.world}, src={self.src})"


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
                    receivers, n_recv = EveryRankBut(world, src), 0
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
                if (not 0 <= src < world or not pieces
                        or not isinstance(receivers, EveryRankBut) and any(not 0 <= r < world for r in receivers)):
                    raise ValueError("rank out of range")
                if not isinstance(receivers, EveryRankBut) and (src in receivers or len(set(receivers)) != len(receivers)):
                    raise ValueError(f"message from rank {src} lists a receiver twice, or its sender")
                if peers.rank != src and peers.rank not in receivers:
                    raise ValueError(f"a message from rank {src} to ranks {list(receivers)} is not this rank's")
                messages.append(Message(src, receivers, pieces))
        except (ValueError, IndexError) as exc:
            raise CorruptCheckpointError(f"shared-read plan from the coordinator is malformed: {exc}") from None
        if at != len(row):
            raise CorruptCheckpointError("shared-read plan from the coordinator has trailing entries")
        return cls(messages, peers.rank, peers, {(c[0], c[1]): c[2] for c in chunks})


