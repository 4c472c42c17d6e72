"""Reading each stored chunk once per load: one rank reads a chunk that several ranks need and sends it to them.

A replicated tensor (DDP's parameters, an optimizer's step counter) or a chunk that several ranks of another
sharding overlap is needed by more than one rank. Read by each, it costs storage traffic times the number of
ranks; here one of them reads it, checks its checksum, and sends the bytes it checked to the others.

The plan is shared_plan.py's; this module is the transport and the load sequence's steps. During load
planning every rank lists the chunks its plan reads (file number, offset, length, and the bytes of
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

import queue
import threading
from datetime import timedelta
from typing import Any, Callable, Optional, Union

import torch

from .. import faults, knobs
from ..errors import CheckpointError
from ..metadata import Metadata
from ..planner import LoadPlan
from .blobs import PAGE_CACHE, BlobStore
from .prefetched import PrefetchedStore
from .shared_plan import (
    ERROR_BYTES,
    RECEIVE,
    SEND,
    Message,
    Shares,
    decode_table,
    encode_table,
    fingerprint,
    may_share,
    node_number,
    plan_shares,
    planned_chunks,
)

try:
    import torch.distributed as dist
except ImportError:  # pragma: no cover
    dist = None  # type: ignore[assignment]

__all__ = ["SharedReads", "Peers", "PeerLost", "Shares", "Message", "planned_chunks", "may_share", "encode_table",
           "decode_table", "plan_shares", "fingerprint", "SEND", "RECEIVE"]


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
            self._wait(works, "sending to every other rank")
        else:
            works = [dist.isend(wire, group=self.group, group_dst=r) for r in receivers]
            self._wait(works, f"sending to ranks {list(receivers)}")

    def receive(self, buf: torch.Tensor, src: int, everyone: bool) -> None:
        """Receive ``buf`` from ``src``; ``everyone``: the message goes to every rank but ``src`` (a broadcast)."""
        wire = buf if self.device.type == "cpu" else torch.empty_like(buf, device=self.device)
        faults.point("collective", "shared read")
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
            raise PeerLost(f"rank {self.rank}: shared read, {what}, failed: {exc}. The other rank probably died, "
                           f"stopped, or waited out the timeout ({self.timeout_s:.0f}s, DISTCKPT_TIMEOUT_S) on "
                           "another; check its log.") from exc


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

    def may_share_reads(self, plan: LoadPlan, held_alone: set) -> bool:
        """Whether another rank may need a chunk ``plan`` reads (:func:`may_share`; ``held_alone``: the keys whose
        destination only this rank holds). Every rank, after its local plan; only where some rank may do the ranks
        build and exchange their chunk tables."""
        return may_share(self.metadata, plan, held_alone)

    def read_chunks(self, plan: LoadPlan, held_alone: Optional[set] = None) -> tuple[list, bytes]:
        """The chunks ``plan`` reads that another rank may need too, and their table for the coordinator (``held_alone``
        as for :meth:`may_share_reads`: chunks read whole into those keys are left out). Every rank."""
        chunks, own_bytes = planned_chunks(self.metadata, plan, held_alone)
        if isinstance(self.store, PrefetchedStore):  # what a prefetch holds, this rank copies from memory itself
            held = [self.store.holds(c[0], c[1], c[2]) for c in chunks]
            own_bytes += sum(c[2] for c, h in zip(chunks, held) if h)
            chunks = [c for c, h in zip(chunks, held) if not h]
        cached = self.store is not None and PAGE_CACHE in self.store.capabilities
        table = encode_table(self.metadata, chunks, knobs.shared_read_bucket_bytes(), self.verify_checksums, cached,
                             self.shared_read_mode() == "on", node_number(knobs.node_id()), own_bytes)
        return chunks, table

    def assign_readers(self, tables: list[bytes]) -> list[bytes]:
        """Every rank's table -> one payload per rank: the messages it sends and receives. Coordinator."""
        decoded = [decode_table(t) for t in tables]
        prints: dict[int, int] = {}
        # "auto": where every rank reads through a page cache, ranks of one node leave their common reads to it
        by_node = all(d[5] for d in decoded) and not any(d[6] for d in decoded)
        return plan_shares([d[0] for d in decoded], min(d[1] for d in decoded), any(d[2] for d in decoded),
                           verifying=[d[2] for d in decoded], kinds=[prints.setdefault(d[3], len(prints)) for d in decoded],
                           nodes=[d[4] for d in decoded] if by_node else None, own_bytes=[d[7] for d in decoded],
                           min_run=knobs.shared_read_min_bytes())

    def accept_readers(self, chunks: list, payload: bytes, peers: Peers) -> None:
        """Take this rank's part of the shared reads; the next ``read_data`` sends and receives it. Every rank."""
        self.shares = Shares.decode(payload, chunks, peers)
