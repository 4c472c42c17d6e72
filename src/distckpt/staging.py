"""Host buffers for async_save: a copy of the state in host memory, reused across saves.

The buffers come from pools reused across saves, so that steady-state saves
allocate nothing. A pool allocates the buffers a state lacks together, in one
arena: one page-locked allocation when the state comes from a GPU, filled with
non-blocking copies and one stream synchronisation. :func:`stage` copies a
state into a pool's buffers; :func:`take_pool` and :func:`return_pool` lend
pools out to the saves that write from them (:mod:`distckpt.async_saving`).
"""

from __future__ import annotations

import copy
import threading
import warnings
from typing import Any, Callable, Iterator, Optional

import torch

from . import faults, knobs, process_state
from .engine.device_copy import pin_in_place, unpin_in_place
from .errors import CheckpointError, StagingMemoryError
from .planning import RankLocal
from .planning.flatten import leaves
from .planning.tensors import is_dtensor, is_sharded_tensor, local_tensor, with_local_shards

__all__ = ["BufferPool", "stage", "allocate", "fill", "take_pool", "return_pool", "take_free_pools"]


_ALIGN = 64  # bytes: every buffer in an arena starts at a multiple, enough for any dtype
# buffers of at least _PAGE_MIN bytes start on a page, so that direct I/O can write them without a copy
# (backends/direct_io.py); the padding costs under 1/16 of such a buffer
_PAGE, _PAGE_MIN = knobs.PAGE_BYTES, 64 << 10


class _Arena:
    """One host allocation backing many staging buffers.

    For CUDA sources it is page-locked as a whole with cudaHostRegister: one
    call instead of one pinned allocation per tensor, and no rounding up (torch's
    caching pinned allocator rounds each allocation to a power of two, which can
    nearly double the pinned memory of a state). Where the driver refuses, the
    arena stays pageable, with a warning: the save still happens, its copy out
    of device memory just blocks longer.
    """

    def __init__(self, nbytes: int, pinned: bool, shared: bool = False):
        self.nbytes = nbytes
        raw = torch.empty(nbytes + _PAGE, dtype=torch.uint8)
        if shared:  # a writer process maps the same memory (async_save with PROCESS)
            raw.share_memory_()
        start = -raw.data_ptr() % _PAGE  # the arena starts on a page
        self.base: Optional[torch.Tensor] = raw[start:start + nbytes]
        self.users = 0
        self.registered = bool(pinned and nbytes) and pin_in_place(self.base)
        if pinned and nbytes and not self.registered:
            warnings.warn(f"async_save could not page-lock {nbytes} bytes of host memory for staging (cudaHostRegister "
                          "refused); staging into pageable memory instead, which blocks training longer. Free host "
                          "memory, or raise the container's locked-memory limit, to stage at the bus's speed.",
                          RuntimeWarning)

    def view(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        n = like.numel() * like.element_size()
        return self.base[offset:offset + n].view(like.dtype).reshape(like.shape)

    def release(self) -> None:
        """Unpin; the memory itself goes once no buffer refers to it."""
        if self.registered:
            unpin_in_place(self.base)
            self.registered = False
        self.base = None


class BufferPool:
    """Host buffers for staging, keyed by (key path, shape, dtype) and reused across saves.

    The buffers a staging lacks are allocated together in one arena. Buffers
    unused by the latest two stagings are dropped, so a run alternating between
    two state layouts reuses both and a changing layout does not grow the pool.
    """

    def __init__(self, shared: bool = False) -> None:
        self.buffers: dict[tuple, tuple[torch.Tensor, _Arena, int]] = {}
        self.generation = 0
        self.shared = shared  # arenas in shared memory, for a writer process

    def buffers_for(self, leaves: list[tuple[tuple, torch.Tensor]]) -> list[torch.Tensor]:
        self.generation += 1
        gen = self.generation
        out: list[Optional[torch.Tensor]] = [None] * len(leaves)
        missing = []
        for i, (path, t) in enumerate(leaves):
            key = (path, tuple(t.shape), t.dtype)
            hit = self.buffers.get(key)
            if hit is None:
                missing.append((i, key, t))
            else:
                self.buffers[key] = (hit[0], hit[1], gen)
                out[i] = hit[0]
        if missing:
            offsets, total = [], 0
            for _, _, t in missing:
                n = t.numel() * t.element_size()
                align = _PAGE if n >= _PAGE_MIN else _ALIGN
                total = -(-total // align) * align
                offsets.append(total)
                total += n
            pinned = torch.cuda.is_available() and any(t.device.type == "cuda" for _, _, t in missing)
            arena = _Arena(total, pinned, self.shared)
            for (i, key, t), off in zip(missing, offsets):
                buf = arena.view(off, t)
                arena.users += 1
                self.buffers[key] = (buf, arena, gen)
                out[i] = buf
        for key in [k for k, (_, _, g) in self.buffers.items() if g < gen - 1]:
            _, arena, _ = self.buffers.pop(key)
            arena.users -= 1
            if arena.users == 0:
                arena.release()
        return out  # type: ignore[return-value]

    def clear(self) -> int:
        """Drop every buffer and release their arenas; the arenas' bytes."""
        arenas = {id(arena): arena for _, arena, _ in self.buffers.values()}
        self.buffers.clear()
        for arena in arenas.values():
            arena.release()
        return sum(arena.nbytes for arena in arenas.values())


class _Pools:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.free_pools: list[BufferPool] = []


_STATE = _Pools()


@process_state.on_fork_child
def _fresh_pools_in_child() -> None:
    global _STATE
    _STATE = _Pools()  # a forked child holds none of the parent's locks, and its saves are not the parent's


def take_pool(shared: bool = False) -> BufferPool:
    """A pool for one save: the one of that kind (``shared``: in shared memory) returned last, or a new, empty one."""
    with _STATE.lock:
        for i in range(len(_STATE.free_pools) - 1, -1, -1):
            if _STATE.free_pools[i].shared == shared:
                return _STATE.free_pools.pop(i)
        return BufferPool(shared)


def return_pool(pool: BufferPool) -> None:
    """``pool`` is free again, for the next save (or for :func:`take_free_pools`)."""
    with _STATE.lock:
        _STATE.free_pools.append(pool)


def take_free_pools() -> list[BufferPool]:
    """Every free pool, which no later :func:`take_pool` returns (the caller clears them)."""
    with _STATE.lock:
        pools, _STATE.free_pools = _STATE.free_pools, []
    return pools


def _tensor_leaves(obj: Any) -> list[tuple[tuple, torch.Tensor]]:
    """Every tensor in ``obj`` (a DTensor's local shard, each local shard of a ShardedTensor) with its key path,
    in the order of the state-dict walk (planning.flatten.leaves)."""
    out: list = []
    for path, value, _ in leaves(obj):
        if is_sharded_tensor(value):
            out.extend((path + (i,), shard.tensor) for i, shard in enumerate(value.local_shards()))
        elif isinstance(value, torch.Tensor):
            out.append((path, local_tensor(value)))
    return out


def _rebuild(obj: Any, buffers: Iterator[torch.Tensor]) -> Any:
    """``obj`` with its tensors replaced, in :func:`_tensor_leaves` order, by ``buffers`` (the same walk)."""
    if is_sharded_tensor(obj):
        return with_local_shards(obj, [next(buffers) for _ in obj.local_shards()])
    if isinstance(obj, torch.Tensor):
        buf = next(buffers)
        if is_dtensor(obj):
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(buf, obj.device_mesh, obj.placements, run_check=False,
                                      shape=obj.shape, stride=obj.stride())
        return buf
    if isinstance(obj, RankLocal):
        return RankLocal(_rebuild(obj.value, buffers))
    if isinstance(obj, dict):
        return {k: _rebuild(v, buffers) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rebuild(v, buffers) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_rebuild(v, buffers) for v in obj)
    return copy.deepcopy(obj)


def stage(obj: Any, pool: BufferPool) -> Any:
    """A copy of ``obj`` whose tensors live in pool buffers on the host.

    Copies from CUDA are queued without blocking on each device's current
    stream (after the kernels that produced the tensors) and waited for once.
    """
    staged, sources, buffers = allocate(obj, pool)
    fill(sources, buffers)
    return staged


def allocate(obj: Any, pool: BufferPool) -> tuple[Any, list[torch.Tensor], list[torch.Tensor]]:
    """The staged copy of ``obj`` before any byte is copied: its structure, with every value copied and every tensor
    a pool buffer; and the source tensors with their buffers, in the order :func:`fill` copies them. Everything that
    can fail before the bytes move fails here (the memory, a tensor with no data), so that a save whose ranks agree
    after this call can fill its buffers while another process writes from them."""
    leaves = _tensor_leaves(obj)
    empty = next((path for path, t in leaves if t.device.type == "meta"), None)
    if empty is not None:
        raise CheckpointError(f"async_save: the tensor at {'.'.join(map(str, empty))} is on the meta device and has no "
                              "data to stage; materialise it (to_empty and initialise) before saving")
    try:
        faults.point("stage", "host buffers")
        buffers = pool.buffers_for(leaves)
    except (RuntimeError, MemoryError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        need = sum(t.numel() * t.element_size() for _, t in leaves)
        raise StagingMemoryError(
            f"async_save could not allocate host memory to stage the state ({need} bytes in all; {exc}). "
            "Free host memory, call distckpt.release_buffers() after a save of another layout, or save with "
            "distckpt.save, which needs no copy.") from exc
    return _rebuild(obj, iter(buffers)), [t for _, t in leaves], buffers


def fill(sources: list[torch.Tensor], buffers: list[torch.Tensor],
         filled: Optional[Callable[[int], None]] = None) -> None:
    """Copy each source into its buffer; ``filled(n)`` says the first ``n`` buffers hold their bytes (a copy from
    a GPU counts once every copy queued so far is waited for: at the end)."""
    streams = {}
    for i, (src, buf) in enumerate(zip(sources, buffers)):
        src = src.detach()
        if src.device.type == "cuda":
            buf.copy_(src, non_blocking=True)
            streams.setdefault(src.device, torch.cuda.current_stream(src.device))
        else:
            buf.copy_(src)
            if filled is not None and not streams:
                filled(i + 1)
    for stream in streams.values():
        stream.synchronize()
    if filled is not None:
        filled(len(buffers))
