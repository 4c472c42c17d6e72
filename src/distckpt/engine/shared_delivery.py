"""The read engine's side of shared reads: reading the pieces this rank sends, and copying the pieces it sends or
receives into its destinations (the transport and the plan are shared_reads.py's)."""

from __future__ import annotations

import io
from typing import Any, Optional

import torch

from .. import knobs
from ..errors import CheckpointError, CorruptCheckpointError
from ..format.checksum import crc32c
from ..format.dtypes import itemsize
from ..metadata import MetadataIndex
from ..planner import LoadItemType
from ..planning.resharding import volume
from .budget import ByteBudget
from .chunk_reads import check_checksum, copy_rows, read_into, rows_meet
from .shared_reads import Endpoint, Failing, Message, PeerLost, Shares, exchange

__all__ = ["SharedChunks", "answer_failed"]


class SharedChunks(Endpoint):
    """One rank's pieces of the shared chunks of a :class:`~distckpt.engine.read.Read` (``read``): the chunks it
    reads for others are checksummed as they are read, and the bytes checked are the bytes sent; what it needs of
    any shared chunk is copied out of the message buffer. A chunk that fails has its destinations zeroed."""

    def __init__(self, read: Any, shares: Any) -> None:
        self.read = read
        self.crc: dict[tuple, int] = {}
        self.failed: dict[tuple, BaseException] = {}  # chunks that failed on this rank
        self.unsent: dict[tuple, str] = {}  # chunks this rank reads for others that failed: why, for the receivers
        self.errors: list[BaseException] = []
        self.dests: dict[MetadataIndex, list] = {}
        self.whole: set = set()  # chunks whose every piece this rank has copied out

    def abandon(self) -> None:
        """The exchange broke off: zero what was copied of every chunk not copied whole (its checksum, checked at
        its last piece, never was), so that no unchecked byte stays in the caller's tensors."""
        for key in self.read.shared:
            if key not in self.whole and key not in self.failed:
                self.zero(key)

    def raise_first(self) -> None:
        if self.errors:
            raise self.errors[0]

    # ------------------------------------------------------------ the sender

    def fill(self, message: Message, views: list[memoryview]) -> list[Optional[str]]:
        out: list[Optional[str]] = []
        for (key, b0, b1), view in zip(message.pieces, views):
            if key not in self.unsent:
                try:
                    self.fill_piece(key, b0, b1, view)
                except Exception as exc:  # noqa: BLE001 - sent to every receiver, raised here after the exchange
                    self.unsent[key] = str(self.fail(key, exc))
                else:  # the bytes are good for the others, whatever this rank's own destinations do with them
                    self.deliver_safely(key, view, b0, b1)
            out.append(self.unsent.get(key))
        return out

    def fill_piece(self, key: tuple, b0: int, b1: int, view: memoryview) -> None:
        read = self.read
        indices = [i for i in read.shared.get(key, ()) if i in read.infos]
        if not indices:
            raise CheckpointError(f"rank's plan no longer reads the chunk at {key[0]!r} offset {key[1]}: the plan changed "
                                  "between planning and reading (finish_plan)")
        index = indices[0]
        info = read.infos[index]
        read_into(read.reader(info.file), view, info.offset + b0, read.here(index), info.file)
        if read.verify:
            self.crc[key] = crc32c(view, self.crc.get(key, 0))
            if b1 == info.length:
                crc = self.crc.pop(key)
                for i in indices:  # each item stored there carries its own checksum
                    check_checksum(True, crc, read.infos[i], read.here(i), self.dests_of(key))

    # ------------------------------------------------------------ every rank that needs the chunk

    def take(self, message: Message, views: list[memoryview], failures: list[Optional[str]]) -> None:
        for (key, b0, b1), view, why in zip(message.pieces, views, failures):
            if key in self.failed:
                continue
            if key not in self.read.shared:
                continue  # the plan changed after planning; the chunk is not this rank's any more
            if why is not None:
                self.fail(key, CorruptCheckpointError(f"{self.here(key)}: {why}"))
                continue
            self.deliver_safely(key, view, b0, b1)

    def deliver_safely(self, key: tuple, view: memoryview, b0: int, b1: int) -> None:
        """:meth:`deliver` into each chunk stored at ``key``, a failure recorded (raised after the exchange, which
        the other ranks still need)."""
        if key in self.failed:
            return
        try:
            for index in self.read.shared[key]:
                self.deliver(key, index, view, b0, b1)
        except Exception as exc:  # noqa: BLE001
            self.fail(key, exc)
        else:
            if b1 == self.read.shared_info[key].length:
                self.whole.add(key)

    def dests_of(self, key: tuple) -> list:
        return [dest for index in self.read.shared.get(key, ()) for dest in self.dests.get(index, ())]

    def deliver(self, key: tuple, index: MetadataIndex, view: memoryview, b0: int, b1: int) -> None:
        """Copy the piece [b0, b1) of a chunk into every destination that needs part of it; after its last
        piece, commit the items."""
        read = self.read
        items, info, shape = read.by_chunk[index], read.shared_info[key], read.chunk_shapes[index]
        codec = read.codecs[index]
        if items[0].type == LoadItemType.BYTE_IO:
            data = bytes(view) if codec.identity else bytes(codec.decode(view, -1, read.here(index)))
            with read.lock:
                read.planner.load_bytes(items[0], io.BytesIO(data))
            return
        dests = self.dests.get(index)
        if dests is None:
            dests = self.dests[index] = read.destinations(index)
        dtype = read.md.state_dict_metadata[index.fqn].properties.dtype
        if not codec.identity:
            nbytes = volume(shape) * itemsize(dtype)
            raw = codec.decode(view, nbytes, read.here(index))
            raw = raw if isinstance(raw, memoryview) and not raw.readonly else bytearray(raw)  # the read buffer: no copy
            chunk = torch.frombuffer(raw, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
            slab, a, b = chunk.view(dtype).reshape(shape), 0, shape[0] if shape else 1
        else:
            raw = torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.empty(0, dtype=torch.uint8)
            if shape:
                row_bytes = info.length // shape[0]
                a, b = b0 // row_bytes, b1 // row_bytes
                slab = raw.view(dtype).reshape((b - a,) + tuple(shape[1:]))
            else:
                a, b, slab = 0, 1, raw.view(dtype).reshape(())
        # copied as the read engine's direct reads write: into parameters that require grad, inference tensors too
        with torch.inference_mode():
            for item, dest in zip(items, dests):
                if rows_meet(item, a, b, shape):
                    copy_rows(item, dest, slab, a, b, shape, None)
        if b1 == info.length:
            with read.lock:
                for item, dest in zip(items, dests):
                    if id(item) not in read.preset:
                        read.planner.commit_tensor(item, dest)

    def fail(self, key: tuple, exc: BaseException) -> BaseException:
        """Record the first failure of a chunk on this rank, and zero what was copied of it: bytes that were not
        checked, or failed, never stay in the caller's tensors. Returns the error recorded."""
        if key in self.failed:
            return self.failed[key]
        if not isinstance(exc, CheckpointError):
            exc = CheckpointError(f"{self.here(key)}: {type(exc).__name__}: {exc}")
        self.failed[key] = exc
        self.errors.append(exc)
        self.zero(key)
        return exc

    def zero(self, key: tuple) -> None:
        for dest in self.dests_of(key):
            if isinstance(dest, torch.Tensor) and dest.device.type != "meta":
                try:
                    with torch.inference_mode():
                        dest.zero_()
                except Exception as exc:  # noqa: BLE001 - the chunk's failure is what this rank reports
                    self.errors.append(CheckpointError(f"{self.here(key)}: its destination could not be zeroed after "
                                                       f"the chunk failed ({type(exc).__name__}: {exc}); it holds "
                                                       "bytes that were not checked"))

    def here(self, key: tuple) -> str:
        indices = self.read.shared.get(key)
        if not indices:
            return f"{self.read.where}: file {key[0]!r} offset {key[1]}"
        return self.read.here(indices[0]) + "".join(f" (and key {i.fqn!r})" for i in indices[1:])


def answer_failed(shares: Shares, exc: BaseException) -> None:
    """This rank failed (``exc``) before walking its shared reads: walk them, sending its failure for every chunk it
    owes, so that no rank waits for it. Where a peer is lost on the way, raise :class:`PeerLost` saying both."""
    budget = ByteBudget(knobs.memory_budget_bytes())
    try:
        exchange(shares, Failing(f"{type(exc).__name__}: {exc}"), budget.hold, budget.limit)
    except PeerLost as lost:
        raise PeerLost(f"{type(exc).__name__}: {exc}; then, telling the ranks that wait for this rank's shared reads: "
                       f"{lost}") from exc
