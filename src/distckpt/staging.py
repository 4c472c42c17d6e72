"""async_save(): copy the state out of device memory, then write it in the background.

Training is blocked only while tensors are copied into host buffers. The
buffers come from a pool reused across saves (pinned memory on CUDA, filled
with non-blocking copies and one stream synchronisation), so steady-state
saves allocate nothing. The background save runs the ordinary save sequence
over its own gloo process group, so its collectives never interleave with
the training's.
"""

from __future__ import annotations

import copy
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional, Union

import torch

from ._sequence import pick_storage, split_stateful, tell_rank
from .distributed import Coordinator, dist
from .errors import CheckpointError
from .metadata import STATE_DICT_TYPE, Metadata
from .planner import SavePlanner
from .planning import DefaultSavePlanner, RankLocal
from .planning.tensors import is_dtensor
from .saving import run_save
from .storage import StorageWriter

__all__ = ["async_save", "AsyncSaveHandle"]


class AsyncSaveHandle:
    """The progress of one :func:`async_save`.

    ``staged`` resolves once the state has been copied: the caller may modify
    its tensors from then on (async_save returns only after that). ``committed``
    resolves to the checkpoint's Metadata once it is committed, or raises the
    save's error.
    """

    def __init__(self, checkpoint_id: Any):
        self.checkpoint_id = checkpoint_id
        self.staged: Future = Future()
        self.committed: Future = Future()

    def result(self, timeout: Optional[float] = None) -> Metadata:
        """Wait for the commit; return the metadata or raise the save's error."""
        return self.committed.result(timeout)

    def done(self) -> bool:
        return self.committed.done()


class _BufferPool:
    """Host buffers for staging, keyed by (key path, shape, dtype); reused across saves."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}

    def get(self, key: tuple, like: torch.Tensor) -> torch.Tensor:
        full_key = (key, tuple(like.shape), like.dtype)
        buf = self.buffers.get(full_key)
        if buf is None:
            pin = like.device.type == "cuda" and torch.cuda.is_available()
            buf = torch.empty(like.shape, dtype=like.dtype, pin_memory=pin)
            self.buffers[full_key] = buf
        return buf


class _AsyncState:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight: list[AsyncSaveHandle] = []
        self.free_pools: list[_BufferPool] = []
        self.executor: Optional[ThreadPoolExecutor] = None
        self.groups: dict[Any, Any] = {}


_STATE = _AsyncState()


def _background_group(process_group: Any) -> Any:
    """A gloo group with the same ranks as ``process_group``, for the background save's collectives."""
    if not (dist is not None and dist.is_available() and dist.is_initialized()):
        return None
    key = id(process_group) if process_group is not None else None
    group = _STATE.groups.get(key)
    if group is None:
        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        group = dist.new_group(ranks=ranks, backend="gloo")  # collective: every rank calls async_save
        _STATE.groups[key] = group
    return group


def _stage(obj: Any, pool: _BufferPool, path: tuple, streams_used: list) -> Any:
    """A copy of ``obj`` whose tensors live in pool buffers on the host."""
    if isinstance(obj, torch.Tensor):
        if is_dtensor(obj):
            from torch.distributed.tensor import DTensor

            local = _stage(obj.to_local(), pool, path, streams_used)
            return DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False,
                                      shape=obj.shape, stride=obj.stride())
        buf = pool.get(path, obj)
        src = obj.detach()
        if src.device.type == "cuda":
            buf.copy_(src, non_blocking=True)
            streams_used.append(torch.cuda.current_stream(src.device))
        else:
            buf.copy_(src)
        return buf
    if isinstance(obj, RankLocal):
        return RankLocal(_stage(obj.value, pool, path + ("$rank_local",), streams_used))
    if isinstance(obj, dict):
        return {k: _stage(v, pool, path + (k,), streams_used) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_stage(v, pool, path + (i,), streams_used) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(_stage(v, pool, path + (i,), streams_used) for i, v in enumerate(obj))
    return copy.deepcopy(obj)


def async_save(
    state_dict: STATE_DICT_TYPE,
    *,
    checkpoint_id: Union[str, os.PathLike, None] = None,
    storage_writer: Optional[StorageWriter] = None,
    planner: Optional[SavePlanner] = None,
    process_group: Any = None,
    coordinator_rank: int = 0,
    max_in_flight: int = 1,
    wait_for_previous: bool = True,
    on_commit: Optional[Callable[[Metadata], None]] = None,
) -> AsyncSaveHandle:
    """Save like :func:`distckpt.save`, blocking only while the state is copied to host memory.

    Every rank calls it. It returns once the state is staged; the write and
    commit continue in a background thread, and the returned handle reports
    them. At most ``max_in_flight`` saves run at once: a further call waits
    for the oldest (``wait_for_previous=True``) or raises CheckpointError.
    The bytes on disk are the state as it was when this call returned.
    ``on_commit(metadata)`` runs in the background after the commit.
    """
    if max_in_flight < 1:
        raise CheckpointError("max_in_flight must be at least 1")
    while True:
        with _STATE.lock:
            _STATE.in_flight = [h for h in _STATE.in_flight if not h.done()]
            if len(_STATE.in_flight) < max_in_flight:
                break
            oldest = _STATE.in_flight[0]
        if not wait_for_previous:
            raise CheckpointError(
                f"an async save of {str(oldest.checkpoint_id)!r} is still in flight; wait for handle.result() "
                "or pass wait_for_previous=True or a larger max_in_flight")
        try:
            oldest.committed.exception()  # its error stays on its own handle
        except BaseException:  # noqa: BLE001 - cancelled futures
            pass

    storage_writer = pick_storage("writer", checkpoint_id, storage_writer)
    planner = planner if planner is not None else DefaultSavePlanner()
    group = _background_group(process_group)
    coord = Coordinator(group, coordinator_rank)
    tell_rank(planner, coord.rank)

    handle = AsyncSaveHandle(checkpoint_id)
    with _STATE.lock:
        pool = _STATE.free_pools.pop() if _STATE.free_pools else _BufferPool()
        if _STATE.executor is None:
            _STATE.executor = ThreadPoolExecutor(max(1, max_in_flight), thread_name_prefix="distckpt-async")
        _STATE.in_flight.append(handle)
        executor = _STATE.executor
    try:
        plain, _ = split_stateful(state_dict)
        streams: list = []
        staged = _stage(plain, pool, (), streams)
        for stream in {id(s): s for s in streams}.values():
            stream.synchronize()
    except BaseException as exc:
        with _STATE.lock:
            _STATE.free_pools.append(pool)
        handle.staged.set_exception(exc)
        handle.committed.set_exception(exc)
        raise
    handle.staged.set_result(None)

    def background() -> None:
        try:
            md = run_save(staged, storage_writer, planner, coord)
            if on_commit is not None:
                on_commit(md)
            handle.committed.set_result(md)
        except BaseException as exc:  # noqa: BLE001 - delivered on the handle
            handle.committed.set_exception(exc)
        finally:
            with _STATE.lock:
                _STATE.free_pools.append(pool)

    executor.submit(background)
    return handle
