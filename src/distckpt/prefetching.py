"""Reading a restore's bytes ahead: while a job builds its model, compiles and warms up, a thread reads the data files
of the checkpoint this rank will load into host memory, within a byte budget. The load then copies those bytes from
memory and reads only the rest from storage.

A prefetch is one rank's business: it reads the metadata and the files on its own and takes part in no collective,
so it cannot stall the others or be stalled by them. What it reads: the chunks the rank's local load plan reads
where the caller gives the state dict to load into (a plan needs only shapes and placements; Stateful objects are
left out, since their ``state_dict()`` may run collectives), else the data files this rank wrote, where the world
is the size that saved the checkpoint (a restart's case: each rank reads its own shards back). Bytes past the
budget are left to the load. Each chunk read whole is checked against its checksum as it is read, in the
background; the load then copies it without checking it again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist

from . import knobs
from .engine.device_copy import host_buffer
from .engine.prefetched import PrefetchCache
from .engine.shared_plan import planned_chunks
from .errors import CheckpointError
from .format.checksum import crc32c
from .planning import DefaultLoadPlanner
from .stateful import Stateful

__all__ = ["Prefetch"]

log = logging.getLogger("distckpt")
_PIECE = 64 << 20  # bytes read at once: a cancel waits for one piece at most


class Prefetch:
    """A prefetch of checkpoint ``checkpoint_id`` by this rank, running in a thread from the start.

    ``reader``: the storage reader the load will use (its store and options: a distckpt BlobStorageReader);
    ``state_dict``: what the load will fill (only shapes and placements are read), else this rank's own files;
    ``max_bytes``: the most bytes held (default: DISTCKPT_MEMORY_BUDGET_BYTES); ``rank``, ``world_size``: this
    rank's (default: the default process group's, else 0 and 1).
    """

    def __init__(self, checkpoint_id: str, reader: Any, *, state_dict: Optional[dict] = None,
                 max_bytes: Optional[int] = None, rank: Optional[int] = None, world_size: Optional[int] = None) -> None:
        if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0):
            raise CheckpointError(f"prefetch(max_bytes={max_bytes!r}): a number of bytes, 0 or more")
        if state_dict is not None and not isinstance(state_dict, Mapping):
            raise CheckpointError(f"prefetch(state_dict=...): a dict of what the load will fill, not a "
                                  f"{type(state_dict).__name__}")
        if state_dict is not None:  # a Stateful's state_dict() may run collectives, which a prefetch must not join
            state_dict = {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor) or not isinstance(v, Stateful)}
        self.checkpoint_id, self.reader, self.state_dict = checkpoint_id, reader, state_dict
        self.max_bytes = knobs.memory_budget_bytes() if max_bytes is None else max_bytes
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        self.cache: Optional[PrefetchCache] = None
        self.error: Optional[BaseException] = None
        self.seconds = 0.0
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._run, name="distckpt-prefetch", daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    @property
    def nbytes(self) -> int:
        """Bytes read so far."""
        return self.cache.nbytes if self.cache is not None else 0

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait for the prefetch to finish (at most ``timeout`` seconds); the bytes it holds. A prefetch that failed
        holds what it read before; its error is ``error`` (the load reads the rest)."""
        self._thread.join(timeout)
        return self.nbytes

    def cancel(self) -> None:
        """Stop reading (within one piece of 64 MiB); what was read stays usable."""
        self._cancel.set()
        self._thread.join()

    def attach(self, reader: Any) -> None:
        """Hand what was read to ``reader`` for the load about to run, once the prefetch is done: what it still has
        to read, the load would read from the same storage, and then not from memory."""
        self._thread.join()
        if self.cache is not None:
            reader.prefetched = self.cache

    def release(self, wait: bool = True) -> None:
        """Give the memory back (``wait=False``: from a thread of its own, off the caller's way: freeing a few GiB of
        buffers takes tens of milliseconds)."""
        self.cancel()
        cache = self.cache
        if cache is None:
            return
        if wait:
            cache.release()
        else:
            threading.Thread(target=cache.release, name="distckpt-prefetch-release", daemon=True).start()

    def _run(self) -> None:
        started = time.monotonic()
        try:
            self._read()
        except Exception as exc:  # noqa: BLE001 - the load reads what the prefetch could not; the error is kept for the caller
            self.error = exc
            log.warning("prefetch of %s stopped after %d bytes: %s; the load reads the rest from storage",
                        self.checkpoint_id, self.nbytes, exc)
        finally:
            self.seconds = time.monotonic() - started

    def _read(self) -> None:
        reader = self.reader
        reader.reset(self.checkpoint_id)
        md = reader.read_metadata()
        store = reader.data_store(md)
        self.cache = PrefetchCache(reader.checkpoint_id, md.storage_data.save_id)
        left = self.max_bytes
        wanted = self._wanted(md)
        chunks = _chunks_in(md, {name for name, _, _ in wanted})
        for name, start, length in wanted:
            if self._cancel.is_set() or left <= 0:
                return
            blob = store.open(name)
            try:
                version = (blob.size, blob.identity())  # before the read: bytes are bound to the version they came from
                length = min(length, max(0, blob.size - start), left)  # a file shorter than its table holds no more
                if length <= 0:
                    continue
                # plain memory: the load copies these bytes into its destinations, never straight to a device, and
                # torch's page-locked allocator would round each buffer up to a power of two and keep it after release
                buf = host_buffer(length, False)
                left -= length
                view = memoryview(buf.numpy()).cast("B")
                inside = sorted((c for c in chunks.get(name, ()) if start <= c[1].offset), key=lambda c: c[1].offset)
                checked: set = set()
                got = 0
                while got < length and not self._cancel.is_set():
                    n = blob.readinto(view[got:got + min(_PIECE, length - got)], start + got)
                    if n <= 0:
                        break
                    got += n
                    # the chunks this piece completed, checked while the next piece is read (the read waits on storage)
                    done = [c for c in inside if c[1].offset + c[1].length <= start + got]
                    inside = inside[len(done):]
                    checked |= self._checked(done, start, view[:got])
                if got and (blob.size, blob.identity()) == version:  # changed meanwhile: neither kept nor checked
                    self.cache.add(name, version[0], version[1], start, buf[:got], checked)
            finally:
                blob.close()

    def _checked(self, chunks: Any, start: int, data: memoryview) -> set:
        """The chunks wholly inside ``data`` (file bytes from ``start``) that match their checksums, checked here,
        in the background: the load then copies them without checking again. One that fails is left to the load,
        which reads it from memory, checks it and fails naming it, as a load from storage would."""
        out: set = set()
        for index, info in chunks:
            if self._cancel.is_set():
                break
            a = info.offset - start
            if 0 <= a and a + info.length <= len(data) and crc32c(data[a:a + info.length]) == info.crc32c:
                out.add(index)
        return out

    def _wanted(self, md: Any) -> list[tuple[str, int, int]]:
        """(file, first byte, length) runs to read, in file order."""
        if self.state_dict is not None:
            planner = DefaultLoadPlanner(allow_partial_load=True)  # keys the checkpoint lacks are the load's to report
            planner.set_up_planner(self.state_dict, md, False)
            chunks, _ = planned_chunks(md, planner.create_local_plan())
            return _runs([(c[0], c[1], c[2]) for c in chunks])
        files = md.storage_data.files
        saved_world = 1 + max((info.rank for info in files.values()), default=0)
        if saved_world != self.world_size:
            log.info("prefetch of %s: saved by %d ranks, loaded by %d; without the state dict to load into, this rank "
                     "cannot tell what it will read, and reads nothing ahead", self.checkpoint_id, saved_world,
                     self.world_size)
            return []
        return [(name, 0, info.size) for name, info in sorted(files.items()) if info.rank == self.rank]


def _chunks_in(md: Any, files: set) -> dict[str, list]:
    """The chunks stored as they are (no codec) with a checksum, of each of ``files``: (index, location)."""
    out: dict[str, list] = {}
    if not files:
        return out
    for index, info in md.storage_data.items.items():
        if info.file in files and info.codec == "identity" and info.crc32c is not None:
            out.setdefault(info.file, []).append((index, info))
    return out


def _runs(pieces: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Byte ranges merged where they touch or overlap, per file, in file order."""
    out: list[list] = []
    for name, start, length in sorted(pieces):
        if out and out[-1][0] == name and start <= out[-1][1] + out[-1][2]:
            out[-1][2] = max(out[-1][2], start + length - out[-1][1])
        else:
            out.append([name, start, length])
    return [tuple(r) for r in out]


def _rank_and_world(rank: Optional[int], world_size: Optional[int]) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    if dist.is_available() and dist.is_initialized():
        return (dist.get_rank() if rank is None else rank), (dist.get_world_size() if world_size is None else world_size)
    return (0 if rank is None else rank), (1 if world_size is None else world_size)
