"""Reading each stored chunk once per load: one rank reads a chunk that several ranks need and sends it to them.

A replicated tensor (DDP's parameters, an optimizer's step counter) or a chunk that several ranks of another
sharding overlap is needed by more than one rank. Read by each, it costs storage traffic times the number of
ranks; here one of them reads it, checks its checksum, and sends the bytes it checked to the others.

During load planning every rank lists the chunks its plan reads (file number, offset, length, and the bytes of
one row, so that a large chunk is cut on row boundaries). The coordinator picks one reader among the ranks that
need each shared chunk, evening out the bytes each rank reads (chunks only one rank needs count toward its
share); the chunks one set of ranks needs are cut into runs contiguous in the files, one run per rank, so that
storage is read in long ranges. It then packs the shared chunks into messages of at most the bucket size, one
sender and its set of receivers per message, and tells each rank the messages it takes part in, in one global
order, the senders taking turns.

Each rank then walks its messages in that order: as the sender it sends the buffer that a thread of its own
read (and checksummed) ahead; as a receiver it waits for the buffer and copies the pieces into its destinations. Every rank
walks the messages in the same global order and blocks only on its own, so the earliest unfinished message
always has all of its ranks waiting on it: no cycle of waits can form. A chunk that fails at its reader (a
checksum mismatch, a truncated file, any error of that rank) travels as a failed status with the reader's
message; each receiver zeroes what it copied of that chunk and the load fails on every rank that needed it.
A sender that dies leaves its receivers with a broken connection or, at worst, the checkpoint timeout.

Where every rank reads through its node's page cache (a file system) and no rank asks for "on", a chunk only
ranks of one node need is left to that cache ("auto", knobs.shared_reads): they fetch it from storage once
between them anyway, and copying it from one to the others would cost more than reading it from memory.

Messages go to the ranks that need them only: point to point, so that a chunk shared by the two ranks of one
replica pair crosses the network once whatever the size of the job; a message for every other rank of the group
(a fully replicated state) is the backend's broadcast, a ring or tree on NCCL rather than one copy per receiver.
"""

from __future__ import annotations

import hashlib
import queue
import struct
import threading
from datetime import timedelta
from typing import Any, Callable, NamedTuple, Optional, Union

import numpy as np
import torch

from .. import faults, knobs
from ..errors import CheckpointError, CorruptCheckpointError
from ..format.locations import ChunkLocations
from ..format.records import FileStorageData, ForeignStorageData
from ..item_columns import BYTES, ReadColumns
from ..metadata import Metadata
from ..planner import LoadItemType, LoadPlan
from .blobs import PAGE_CACHE, BlobStore
from .chunk_reads import ChunkShapes
from .shared_verification import partial_chunks

try:
    import torch.distributed as dist
except ImportError:  # pragma: no cover
    dist = None  # type: ignore[assignment]

__all__ = ["SharedReads", "Peers", "PeerLost", "Shares", "Message", "planned_chunks", "may_share", "encode_table",
           "decode_table", "plan_shares", "fingerprint", "SEND", "RECEIVE"]

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

    def __init__(self, messages: list[Message], rank: int, peers: "Peers", lengths: dict[Key, int]) -> None:
        self.messages, self.rank, self.peers, self.lengths = messages, rank, peers, lengths
        self.walked = False  # whether this rank has begun walking its messages (exchange)
        self.roles: dict[Key, int] = {}
        for m in messages:
            for key, _, _ in m.pieces:
                self.roles[key] = SEND if m.src == rank else RECEIVE

    @classmethod
    def decode(cls, payload: bytes, chunks: list[tuple[str, int, int, int]], peers: "Peers") -> "Shares":
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


class PeerLost(CheckpointError):
    """The transport of a shared read failed (a peer died, or did not answer within the checkpoint timeout): the
    ranks are no longer in step, and no further collective of this load can succeed."""


class Peers:
    """Point-to-point transport between the ranks of one load's process group, each wait bounded by the
    checkpoint timeout. Buffers travel on the group's device (a CUDA device for NCCL, else host memory)."""

    def __init__(self, group: Any, rank: int, world_size: int, device: torch.device, timeout_s: float) -> None:
        self.group, self.rank, self.world_size, self.device, self.timeout_s = group, rank, world_size, device, timeout_s

    def send(self, buf: torch.Tensor, receivers: tuple[int, ...]) -> None:
        """Send ``buf`` to ``receivers``: a broadcast where they are every other rank of the group (the backend's
        own algorithm, a ring or tree on NCCL, instead of one copy per receiver from this rank), else point to point."""
        wire = buf if self.device.type == "cpu" else buf.to(self.device)
        faults.point("collective", "shared read")
        if len(receivers) == self.world_size - 1:
            works = [dist.broadcast(wire, group=self.group, group_src=self.rank, async_op=True)]
        else:
            works = [dist.isend(wire, group=self.group, group_dst=r) for r in receivers]
        self._wait(works, f"sending to ranks {list(receivers)}")

    def receive(self, buf: torch.Tensor, src: int, everyone: bool) -> None:
        """Receive ``buf`` from ``src``; ``everyone``: the message goes to every rank but ``src`` (a broadcast)."""
        wire = buf if self.device.type == "cpu" else torch.empty_like(buf, device=self.device)
        if everyone:
            work = dist.broadcast(wire, group=self.group, group_src=src, async_op=True)
        else:
            work = dist.irecv(wire, group=self.group, group_src=src)
        self._wait([work], f"receiving from rank {src}")
        if wire is not buf:
            buf.copy_(wire)

    def _wait(self, works: list, what: str) -> None:
        try:
            for work in works:
                if work is not None and not work.wait(timeout=timedelta(seconds=self.timeout_s)):
                    raise PeerLost(f"rank {self.rank}: shared read, {what}, did not finish within "
                                   f"{self.timeout_s:.0f}s (DISTCKPT_TIMEOUT_S)")
        except CheckpointError:
            raise
        except Exception as exc:  # a peer died or the group broke
            raise PeerLost(f"rank {self.rank}: shared read, {what}, failed: {exc}. The other rank probably died "
                           "or timed out; check its log.") from exc


class Endpoint:
    """What a rank does with a message's pieces: ``fill`` reads this rank's pieces into a buffer and returns,
    per piece, None or why it failed; ``take`` copies received pieces into destinations, given the failures."""

    def fill(self, message: Message, views: list[memoryview]) -> list[Optional[str]]:
        raise NotImplementedError

    def take(self, message: Message, views: list[memoryview], failures: list[Optional[str]]) -> None:
        raise NotImplementedError


class Failing(Endpoint):
    """A rank that failed before its reads: it sends its failure for every piece it owes, and drops what it
    receives, so that no other rank waits for it."""

    def __init__(self, why: str) -> None:
        self.why = why

    def fill(self, message: Message, views: list[memoryview]) -> list[Optional[str]]:
        return [self.why] * len(views)

    def take(self, message: Message, views: list[memoryview], failures: list[Optional[str]]) -> None:
        pass


def exchange(shares: Shares, endpoint: Endpoint, hold: Callable[[int], Any], limit: Optional[int] = None) -> None:
    """Walk this rank's messages in order (see the module docstring). A thread reads this rank's next messages to
    send ahead of the walk, into one of two buffers, so that reading overlaps the exchange of other ranks'
    messages. ``hold(n)`` is a context that keeps ``n`` bytes of buffer within the memory budget (``limit``
    bytes: where two buffers to send ahead do not fit beside the one received into, one does). A transport
    failure (a dead peer, the timeout) raises :class:`PeerLost` at once: the ranks are no longer in step. Any other
    error of this rank's endpoint is sent as the failure of the pieces it concerned, and raised once every message
    has gone: the other ranks still wait for them."""
    shares.walked = True
    if not shares.messages:
        return
    sends = [m for m in shares.messages if m.src == shares.rank]
    received = [m.layout()[1] for m in shares.messages if m.src != shares.rank]
    send_size = max((m.layout()[1] for m in sends), default=0)
    spare = 2 if len(sends) > 1 else len(sends)
    if spare == 2 and limit is not None and max(received, default=0) + 2 * send_size > limit:
        spare = 1  # rows larger than the bucket: reading ahead must not take the budget past its limit
    errors: list[BaseException] = []
    with hold(max(received, default=0) + spare * send_size):
        ahead = _ReadAhead(sends, endpoint, send_size, spare, errors)
        try:
            inbox = torch.empty(max(received, default=0), dtype=torch.uint8)
            for message in shares.messages:
                if message.src == shares.rank:
                    buf = ahead.next()
                    shares.peers.send(buf, message.receivers)
                    ahead.recycle(buf)
                else:
                    size = message.layout()[1]
                    buf = inbox[:size]
                    shares.peers.receive(buf, message.src, len(message.receivers) == shares.peers.world_size - 1)
                    views, status_at = _views(message, buf)
                    try:
                        endpoint.take(message, views, _get_status(memoryview(buf.numpy()), status_at,
                                                                  len(message.pieces), message.src))
                    except Exception as exc:  # noqa: BLE001 - raised once every message has gone
                        errors.append(exc)
        finally:
            ahead.stop()
    if errors:
        raise errors[0]


def _views(message: Message, buf: torch.Tensor) -> tuple[list[memoryview], int]:
    """The pieces of ``message`` in its buffer, and where its status bytes begin."""
    raw = memoryview(buf.numpy())
    starts, size = message.layout()
    return [raw[s:s + b1 - b0] for s, (_, b0, b1) in zip(starts, message.pieces)], size - len(message.pieces) - ERROR_BYTES


class _ReadAhead:
    """Fills this rank's messages to send, in order, on a thread of its own, at most ``spare`` ahead."""

    def __init__(self, sends: list[Message], endpoint: Endpoint, size: int, spare: int, errors: list) -> None:
        self.errors = errors  # the endpoint's errors, each sent as its message's failure
        self.free: queue.Queue = queue.Queue()
        self.filled: queue.Queue = queue.Queue()
        for _ in range(spare):
            self.free.put(torch.empty(size, dtype=torch.uint8))
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, args=(sends, endpoint), name="distckpt-shared-read", daemon=True)
        self.thread.start()

    def run(self, sends: list[Message], endpoint: Endpoint) -> None:
        try:
            for message in sends:
                while True:
                    if self.stopping.is_set():
                        return
                    try:
                        whole = self.free.get(timeout=0.2)
                        break
                    except queue.Empty:
                        continue
                buf = whole[:message.layout()[1]]
                views, status_at = _views(message, buf)
                try:
                    failures = endpoint.fill(message, views)
                except Exception as exc:  # noqa: BLE001 - every piece of the message fails; raised after the walk
                    self.errors.append(exc)
                    failures = [f"{type(exc).__name__}: {exc}"] * len(views)
                _put_status(memoryview(buf.numpy()), status_at, failures)
                self.filled.put((whole, buf))
        except BaseException as exc:  # noqa: BLE001 - raised by next() on the walking thread
            self.filled.put((None, exc))

    def next(self) -> torch.Tensor:
        whole, buf = self.filled.get()
        if whole is None:
            raise buf
        self.pending = whole
        return buf

    def recycle(self, buf: torch.Tensor) -> None:
        self.free.put(self.pending)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()


def _put_status(raw: memoryview, at: int, failures: list[Optional[str]]) -> None:
    text = next((why for why in failures if why), "")
    raw[at:at + len(failures)] = bytes(1 if why else 0 for why in failures)
    encoded = text.encode("utf-8", "replace")[:ERROR_BYTES]
    tail = at + len(failures)
    raw[tail:tail + ERROR_BYTES] = encoded + bytes(ERROR_BYTES - len(encoded))


def _get_status(raw: memoryview, at: int, n: int, src: int) -> list[Optional[str]]:
    flags = bytes(raw[at:at + n])
    if not any(flags):
        return [None] * n
    text = bytes(raw[at + n:at + n + ERROR_BYTES]).rstrip(b"\0").decode("utf-8", "replace")
    why = f"rank {src}, which read it for this rank, failed: {text or 'no reason given'}"
    return [why if flag else None for flag in flags]


class SharedReads:
    """The load sequence's steps of shared reads, as a reader's methods (for readers declaring ``SHARED_READS``).
    The reader sets ``metadata`` (``set_up_storage_reader``), resets ``shares`` to None there, and passes
    ``shares`` to the read engine."""

    metadata: Optional[Metadata] = None
    shared_reads: Optional[Union[bool, str]] = None  # None: the DISTCKPT_SHARED_READS setting; "auto", True, False
    shares: Optional[Shares] = None
    verify_checksums: bool = True
    store: Optional[BlobStore] = None  # the store of the data files (set_up_storage_reader)

    def shares_reads(self) -> bool:
        """Whether this reader takes part in shared reads (its ``shared_reads``, else DISTCKPT_SHARED_READS)."""
        return self.shared_read_mode() != "off"

    def shared_read_mode(self) -> str:
        """"auto", "on" or "off": this reader's ``shared_reads`` (None: DISTCKPT_SHARED_READS; a bool: on or off)."""
        if self.shared_reads is None:
            return knobs.shared_reads()
        if isinstance(self.shared_reads, str):
            return self.shared_reads
        return "on" if self.shared_reads else "off"

    def read_chunks(self, plan: LoadPlan, held_alone: set) -> tuple[list, bytes, bool]:
        """The chunks ``plan`` reads, their table for the coordinator, and whether another rank may need any of
        them (:func:`may_share`; ``held_alone``: the keys whose destination only this rank holds). Every rank,
        after its local plan."""
        chunks = planned_chunks(self.metadata, plan)
        cached = self.store is not None and PAGE_CACHE in self.store.capabilities
        table = encode_table(self.metadata, chunks, knobs.shared_read_bucket_bytes(), self.verify_checksums, cached,
                             self.shared_read_mode() == "on", node_number(knobs.node_id()))
        return chunks, table, bool(chunks) and may_share(self.metadata, plan, held_alone)

    def assign_readers(self, tables: list[bytes]) -> list[bytes]:
        """Every rank's table -> one payload per rank: the messages it sends and receives. Coordinator."""
        decoded = [decode_table(t) for t in tables]
        prints: dict[int, int] = {}
        # "auto": where every rank reads through a page cache, ranks of one node leave their common reads to it
        by_node = all(d[5] for d in decoded) and not any(d[6] for d in decoded)
        return plan_shares([d[0] for d in decoded], min(d[1] for d in decoded), any(d[2] for d in decoded),
                           verifying=[d[2] for d in decoded], kinds=[prints.setdefault(d[3], len(prints)) for d in decoded],
                           nodes=[d[4] for d in decoded] if by_node else None)

    def accept_readers(self, chunks: list, payload: bytes, peers: Peers) -> None:
        """Take this rank's part of the shared reads; the next ``read_data`` sends and receives it. Every rank."""
        self.shares = Shares.decode(payload, chunks, peers)
