"""async_save(): copy the state out of device memory, then write it in the background.

Training is blocked only while tensors are copied into host buffers
(:mod:`distckpt.staging`). The background save runs the ordinary save
sequence over its own gloo process group, so its collectives never
interleave with the training's.

Saves stay in step across ranks by construction:

- Before returning, every rank's call takes part in one agreement over a
  second gloo group, used only from the calling thread: each rank reports
  whether taking and staging its state succeeded, so a failure on one rank
  raises the same error on every rank, for the same save, and no rank's
  next save can pair with another rank's current one.
- Background saves run one at a time, in call order, on one thread: with
  ``max_in_flight > 1`` the caller stages ahead while earlier saves write,
  and their collectives never overlap on the group.
- A background save whose collectives timed out or broke leaves its group
  out of step. The agreement of the next call tells every rank, and all of
  them replace the group before that save runs.
"""

from __future__ import annotations

import atexit
import enum
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional, Union

from . import events, knobs, process_state
from ._sequence import split_stateful, storage_by_position, tell_rank
from .backends.direct_io import release_bounce_buffers
from .backends.registry import pick_storage
from .capabilities import WRITES_WHILE_STAGING, supports
from .distributed import Coordinator, dist, new_gloo_group
from .engine.filling import count, fail, new_counter
from .errors import CheckpointError, RankFailuresError
from .metadata import STATE_DICT_TYPE, Metadata
from .planner import SavePlanner
from .planning import DefaultSavePlanner
from .saving import run_save
from .staging import BufferPool, allocate, fill, return_pool, stage, take_free_pools, take_pool
from .storage import StorageWriter
from .torch_classes import adopt
from .writer_process import WriterProcess, check_picklable, packed_job, rendezvous_of

__all__ = ["async_save", "AsyncSaveHandle", "AsyncCheckpointerType", "release_buffers"]


class AsyncCheckpointerType(enum.Enum):
    """Where an async save writes (DCP's names; DCP's own enum is accepted too): ``THREAD``, a background thread of
    the training process; ``PROCESS``, a writer process of each rank (:mod:`distckpt.writer_process`)."""

    THREAD = "thread"
    PROCESS = "process"


class AsyncSaveHandle(Future):
    """The progress of one :func:`async_save`: a ``concurrent.futures.Future`` of the commit.

    It resolves to the checkpoint's Metadata once it is committed, or raises the save's error
    (``result``, ``exception``, ``add_done_callback`` as for any Future, which is what DCP's async_save
    returns). ``staged`` resolves once the state has been copied: the caller may modify its tensors from
    then on (async_save returns only after that). ``staging_completion`` and ``upload_completion`` are
    DCP's names (``AsyncSaveResponse``) for ``staged`` and the handle itself; ``committed`` is the handle.
    """

    def __init__(self, checkpoint_id: Any):
        super().__init__()
        self.checkpoint_id = checkpoint_id
        self.staged: Future = Future()

    @property
    def committed(self) -> "AsyncSaveHandle":
        return self

    def cancel(self) -> bool:
        """A save once staged is not cancelled (its ranks agreed to it, and its outcome must reach the handle): False,
        as for a Future already running."""
        return False

    @property
    def staging_completion(self) -> Future:
        return self.staged

    @property
    def upload_completion(self) -> "AsyncSaveHandle":
        return self


class _Channel:
    """The two gloo groups of async saves over one process group.

    ``background`` carries the background saves' collectives; ``control``
    the per-call agreement, only ever from the calling thread. ``broken``
    says why the background group fell out of step (a collective that
    timed out or failed), for the next agreement to replace it.
    """

    def __init__(self, ranks: Optional[list[int]]):
        self.ranks = ranks
        self.background = new_gloo_group(ranks)
        self.control = new_gloo_group(ranks)
        self.broken: Optional[str] = None
        self.control_lost: Optional[str] = None
        self.writer: Optional[WriterProcess] = None  # PROCESS: this rank's writer process


class _AsyncState:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight: list[AsyncSaveHandle] = []
        self.executor: Optional[ThreadPoolExecutor] = None
        self.channels: dict[Any, _Channel] = {}
        self.solo_writer: Optional[WriterProcess] = None  # PROCESS without a group of several ranks


_STATE = _AsyncState()


@process_state.on_fork_child
def _fresh_state_in_child() -> None:
    global _STATE
    _STATE = _AsyncState()  # a forked child has none of the parent's threads, and none of its saves are its own


def _channel(process_group: Any) -> Optional[_Channel]:
    """The async-save groups with the same ranks as ``process_group`` (None without torch.distributed)."""
    if not (dist is not None and dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size(process_group) == 1:
        return None
    key = id(process_group) if process_group is not None else None
    channel = _STATE.channels.get(key)
    if channel is None:
        # making groups is a collective of every rank: agree first, so that a rank calling anything else (save, load)
        # gets the typed out-of-step error on every rank, and one that calls nothing the arrival bound, instead of
        # torch's store error from new_group
        agreement = Coordinator(process_group)
        agreement.begin("async_save", "(its first call: making its process groups)")
        agreement.arrive("async_save")
        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        channel = _STATE.channels[key] = _Channel(ranks)
    return channel


def _agree(channel: Optional[_Channel], checkpoint_id: Any, coordinator_rank: int, failure: Optional[BaseException],
           current: Any = None, process: bool = False) -> int:
    """Every rank's report of its staging, exchanged before async_save returns; the save's number.

    Raises on every rank if any rank failed. When any rank's background
    group fell out of step, every rank replaces it here, together; with
    ``process``, the same for the writer processes (none yet, one gone, or
    one whose group fell out of step).
    """
    if channel is None:
        if failure is not None:
            raise failure if isinstance(failure, CheckpointError) else _as_checkpoint_error(failure)
        if process:
            _STATE.solo_writer = _fresh_writer(_STATE.solo_writer, None, coordinator_rank, current)
        return 0
    if channel.control_lost is not None:
        raise CheckpointError(channel.control_lost)
    ctrl = Coordinator(channel.control, coordinator_rank)
    ctrl.timeout_s = 3 * ctrl.timeout_s  # a rank may first wait out its previous save (itself bounded by the timeout)
    ctrl.begin("async_save (writer process)" if process else "async_save", checkpoint_id)
    if process:
        writer = channel.writer
        stale = writer is None or not writer.alive() or writer.out_of_step
    else:
        stale = channel.broken is not None
    try:
        replace = ctrl.vote("async_save staging", failure, stale)
    except RankFailuresError:
        raise
    except CheckpointError as exc:
        if ctrl.transport_failed:
            channel.control_lost = (
                f"async_save can no longer keep this rank's saves in step with the other ranks: their agreement "
                f"before a save failed ({exc}). A rank did not call async_save, or died. Restart the job, or save "
                "with distckpt.save.")
        raise
    if replace and process:
        channel.writer = _fresh_writer(channel.writer, ctrl, coordinator_rank, current)
    elif replace:
        _replace_background_group(channel, current)
    return ctrl.number


def _fresh_writer(old: Optional[WriterProcess], ctrl: Optional[Coordinator], coordinator_rank: int,
                  current: Any) -> WriterProcess:
    """A new writer process for this rank, in place of ``old`` (killed: it may be stuck in a collective of a group
    whose peer died), started by every rank together and joined in its group before this returns."""
    if ctrl is None and old is not None and old.alive() and not old.out_of_step:
        return old
    if old is not None:
        old.kill()
        with _STATE.lock:
            earlier = [h for h in _STATE.in_flight if h is not current]
        for handle in earlier:
            _wait_for(handle)  # they were that writer's: killing it failed them
    timeout_s = knobs.collective_timeout_s()
    if ctrl is None:
        writer = WriterProcess(0, 1, None, timeout_s)
    else:
        writer = WriterProcess(ctrl.rank, ctrl.world_size, rendezvous_of(ctrl), timeout_s)
    return writer  # saves handed to it queue while it starts (a failure to start fails them, on every rank)


def _replace_background_group(channel: _Channel, current: Any) -> None:
    """Swap in a fresh background group, on every rank at the same call. The old group is left alone, not
    destroyed: a collective of it that timed out may still be ending inside gloo."""
    with _STATE.lock:
        earlier = [h for h in _STATE.in_flight if h is not current]
    for handle in earlier:
        _wait_for(handle)  # they ran on the old group
    channel.background = new_gloo_group(channel.ranks)
    channel.broken = None


def _as_checkpoint_error(exc: BaseException) -> CheckpointError:
    error = CheckpointError(f"async_save failed before writing: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def _wait_for(handle: AsyncSaveHandle) -> None:
    """Wait until ``handle``'s save ends; its error stays on the handle."""
    try:
        handle.committed.exception()
    except BaseException:  # noqa: BLE001 - cancelled futures
        pass


def release_buffers() -> int:
    """Free the host memory distckpt keeps for the next save; return how many bytes that was.

    async_save keeps its staging buffers (a copy of the state, page-locked
    when it came from a GPU) and direct writes to local disk keep a few
    bounce buffers, so that steady-state saves allocate nothing. Call this
    when no save is coming soon, for example after training and before an
    evaluation that needs the memory. It first waits for the async saves in
    flight; the next save allocates its buffers again. Buffers still
    referenced elsewhere (a planner reused with plan caching keeps the last
    staged state) are freed only once that reference goes; writer processes (PROCESS)
    are told to let go of theirs. Pinned copies
    made by sync saves and loads of GPU tensors live in torch's caching host
    allocator instead: ``torch.accelerator.empty_host_cache()`` frees those.
    """
    while True:
        with _STATE.lock:
            pending = [h for h in _STATE.in_flight if not h.done()]
            if not pending:
                pools = take_free_pools()
                break
        for handle in pending:
            _wait_for(handle)
    for writer in _writers():
        if writer.alive():
            writer.release()
    return sum(pool.clear() for pool in pools) + release_bounce_buffers()


def _writers() -> list[WriterProcess]:
    return [c.writer for c in _STATE.channels.values() if c.writer is not None] + [w for w in [_STATE.solo_writer] if w]


_NICED = threading.local()


def _lower_priority() -> None:
    """Lower this background thread's CPU priority, once; the write threads it starts inherit it (Linux,
    where nice is per thread). Elsewhere nothing changes: there the id could name another process."""
    step = knobs.async_write_nice()
    if not step or getattr(_NICED, "done", False) or not sys.platform.startswith("linux"):
        return
    _NICED.done = True
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + step))
    except (AttributeError, OSError):
        pass


@storage_by_position("storage_writer")
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
    no_dist: bool = False,
    async_checkpointer_type: Any = None,
    async_stager: Any = None,
    use_collectives: bool = True,
    overwrite: Optional[bool] = None,
) -> AsyncSaveHandle:
    """Save like :func:`distckpt.save`, blocking only while the state is copied to host memory.

    Every rank calls it. It returns once the state is staged; the write and
    commit continue in the background, and the returned handle reports
    them. At most ``max_in_flight`` saves are staged and not yet committed:
    a further call waits for the oldest (``wait_for_previous=True``) or
    raises CheckpointError. Background saves write and commit one at a time,
    in call order. The bytes on disk are the state as it was when this call
    returned. ``on_commit(metadata)`` runs in the background after the commit.

    A failure on any rank before this call returns (taking the state,
    allocating the staging copy, an earlier save still in flight) raises on
    every rank, for this save; a failure after it is on every rank's handle.
    Either way nothing is committed and the next call starts in step.

    The background write runs at a lower CPU priority than the caller
    (``DISTCKPT_ASYNC_NICE``, default 10; docs/performance.md has the figures).

    ``async_checkpointer_type=PROCESS`` (ours, DCP's, or ``"process"``) writes from a writer process of each rank,
    started once and fed through shared memory, off the training loop's GIL (:mod:`distckpt.writer_process`); it is
    handed the save before the copy and writes each tensor as soon as it is staged, so the copy overlaps the write;
    THREAD, the default, from the thread. DCP's DefaultStager and BlockingAsyncStager are accepted (distckpt's
    own staging serves both); another ``async_stager``, or ``use_collectives=False``, raises CheckpointError.
    """
    start, started_at = time.perf_counter(), time.time()
    rank = dist.get_rank(process_group) if not no_dist and dist is not None and dist.is_initialized() else 0
    with events.context(checkpoint_id=events.named(checkpoint_id), rank=rank):
        try:
            with events.phase("async_save", "stage", retries=False):  # what the caller waits for
                handle = _begin(state_dict, checkpoint_id, storage_writer, planner, process_group, coordinator_rank,
                                max_in_flight, wait_for_previous, on_commit, no_dist, async_checkpointer_type,
                                async_stager, use_collectives, overwrite)
        except BaseException as exc:  # the operation ended here: its whole is this failure
            blocked = time.perf_counter() - start
            events.report("async_save", "total", blocked, started_at, blocked_seconds=blocked, error=type(exc).__name__)
            raise
        events.when_done(handle, "async_save", "total", start, blocked_seconds=time.perf_counter() - start)
    return handle


def _begin(state_dict: STATE_DICT_TYPE, checkpoint_id: Any, storage_writer: Optional[StorageWriter],
           planner: Optional[SavePlanner], process_group: Any, coordinator_rank: int, max_in_flight: int,
           wait_for_previous: bool, on_commit: Optional[Callable[[Metadata], None]], no_dist: bool,
           async_checkpointer_type: Any, async_stager: Any, use_collectives: bool, overwrite: Optional[bool]) -> AsyncSaveHandle:
    """:func:`async_save`, until it returns."""
    _check_dcp_async_options(async_checkpointer_type, async_stager, use_collectives)
    if max_in_flight < 1:
        raise CheckpointError("max_in_flight must be at least 1")
    process = _in_a_process(async_checkpointer_type)
    storage_writer, planner = adopt(storage_writer, "storage_writer"), adopt(planner, "planner")
    failure = _wait_for_room(max_in_flight, wait_for_previous)
    channel = None if no_dist else _channel(process_group)
    handle = AsyncSaveHandle(checkpoint_id)
    with _STATE.lock:
        pool = take_pool(shared=process)
        if _STATE.executor is None:  # one thread: saves run one at a time, in the order every rank called
            _STATE.executor = ThreadPoolExecutor(1, thread_name_prefix="distckpt-async")
        if failure is None:
            _STATE.in_flight.append(handle)
        executor = _STATE.executor
    staged: Any = None
    try:
        if failure is not None:
            raise failure
        storage_writer = pick_storage("writer", checkpoint_id, storage_writer, overwrite, own_copy=True)
        planner = planner if planner is not None else DefaultSavePlanner()
        staged = _staged(state_dict, pool, storage_writer, planner, process)
    except Exception as exc:  # noqa: BLE001 - reported to every rank by the agreement below
        failure = exc
    try:
        number = _agree(channel, checkpoint_id, coordinator_rank, failure, handle, process=process)
        coord = None if process else _background_coordinator(channel, coordinator_rank, no_dist, checkpoint_id, number, planner)
    except BaseException as exc:
        return_pool(pool)
        handle.staged.set_exception(exc)
        handle.committed.set_exception(exc)
        raise
    if process:
        _write_in_process(channel, handle, staged, storage_writer, planner, number, coordinator_rank, pool, on_commit)
    else:
        handle.staged.set_result(None)
        # the background's events carry this call's step and checkpoint, its bytes none of the staging's
        executor.submit(events.detached(_background), handle, staged, storage_writer, planner, coord, channel, number, pool,
                        on_commit)
    return handle


def _staged(state_dict: STATE_DICT_TYPE, pool: BufferPool, storage_writer: StorageWriter, planner: SavePlanner,
            process: bool) -> Any:
    """The state copied into ``pool``. For a writer process, checked to travel there too, and where the storage
    writer can write while the copy goes on (WRITES_WHILE_STAGING), only its buffers allocated: (the staged state,
    its sources, their buffers), filled once the ranks agree, while the writer starts (:func:`_write_in_process`)."""
    state = split_stateful(state_dict)[0]
    if not process:
        return stage(state, pool)
    if not supports(storage_writer, WRITES_WHILE_STAGING):  # it might read a buffer before it is filled: fill first
        staged = stage(state, pool)
        check_picklable(staged, storage_writer, planner)
        return staged, None, None
    staged = allocate(state, pool)
    check_picklable(staged[0], storage_writer, planner)
    return staged


def _write_in_process(channel: Optional[_Channel], handle: AsyncSaveHandle, staged: tuple, storage_writer: StorageWriter,
                      planner: SavePlanner, number: int, coordinator_rank: int, pool: BufferPool,
                      on_commit: Optional[Callable[[Metadata], None]]) -> None:
    """Hand the agreed save to this rank's writer process, then fill its staging: the writer writes each buffer as
    soon as it is filled (:mod:`distckpt.engine.filling`). A copy that fails fails the save on every rank's
    handle, through the writers, and raises here."""
    state, sources, buffers = staged
    if sources is None:  # filled already: nothing to wait for
        _hand_to_writer(channel, handle, (state, storage_writer, planner, None), number, coordinator_rank,
                        handle.checkpoint_id, lambda: return_pool(pool), on_commit)
        handle.staged.set_result(None)
        return
    counter = new_counter()
    lock, users = threading.Lock(), [2]  # the pool goes back once the writer is done with it and the copy has ended

    def give_back() -> None:
        with lock:
            users[0] -= 1
            last = users[0] == 0
        if last:
            return_pool(pool)

    handed = _hand_to_writer(channel, handle, (state, storage_writer, planner, (counter, buffers)), number,
                             coordinator_rank, handle.checkpoint_id, give_back, on_commit)
    try:
        if handed:  # else the writer is gone, and the handle says so
            fill(sources, buffers, lambda n: count(counter, n))
    except BaseException as exc:
        fail(counter)
        handle.staged.set_exception(exc)
        raise
    finally:
        give_back()
    handle.staged.set_result(None)


def _background_coordinator(channel: Optional[_Channel], coordinator_rank: int, no_dist: bool, checkpoint_id: Any,
                            number: int, planner: SavePlanner) -> Coordinator:
    coord = Coordinator(channel.background if channel is not None else None, coordinator_rank, no_dist=no_dist)
    coord.begin("async save", checkpoint_id, number=number)
    tell_rank(planner, coord.rank)
    return coord


@atexit.register
def _close_writers() -> None:
    """At exit, the writer processes finish the saves handed to them (as the background thread's would), then stop."""
    for writer in _writers():
        writer.close(timeout_s=knobs.collective_timeout_s())


def _in_a_process(checkpointer_type: Any) -> bool:
    """Whether ``async_checkpointer_type`` asks for a writer process (DCP's PROCESS; THREAD, or none, is a thread)."""
    return str(getattr(checkpointer_type, "value", checkpointer_type)).lower() == "process"


def _hand_to_writer(channel: Optional[_Channel], handle: AsyncSaveHandle, save: tuple, number: int, coordinator_rank: int,
                    checkpoint_id: Any, give_back: Callable[[], None], on_commit: Optional[Callable[[Metadata], None]]) -> bool:
    """Give the staged save to this rank's writer process; its outcome goes on ``handle``, after ``give_back()``
    (the writer is done with the shared memory by then). False if it could not be handed (the handle says why)."""

    def done(md: Any, error: Optional[BaseException], transport_failed: bool) -> None:
        give_back()
        if error is None and on_commit is not None:
            try:
                on_commit(md)
            except BaseException as exc:  # noqa: BLE001 - delivered on the handle
                error = exc
        if error is not None:
            handle.committed.set_exception(error)
        else:
            handle.committed.set_result(md)

    writer = channel.writer if channel is not None else _STATE.solo_writer
    try:
        writer.submit(number, coordinator_rank, checkpoint_id, packed_job(*save), done)
    except BaseException as exc:  # noqa: BLE001 - the writer is gone: the handle says so, the next save replaces it
        give_back()
        handle.committed.set_exception(exc)
        return False
    return True


def _check_dcp_async_options(checkpointer_type: Any, stager: Any, use_collectives: bool) -> None:
    """Refuse DCP async options distckpt cannot honour, naming why (the rest map onto its own staging)."""
    kind = getattr(checkpointer_type, "value", checkpointer_type)
    if kind is not None and str(kind).lower() not in ("thread", "process"):
        raise CheckpointError(f"async_checkpointer_type={checkpointer_type!r} is not one DCP defines (THREAD or PROCESS)")
    if stager is not None and not (type(stager).__module__.startswith("torch.distributed.checkpoint")
                                   and type(stager).__name__ in ("DefaultStager", "BlockingAsyncStager")):
        raise CheckpointError(
            f"async_stager={type(stager).__name__}: distckpt stages into its own reused host buffers and would not "
            "call it; drop async_stager= (DCP's DefaultStager and BlockingAsyncStager are accepted and mapped)")
    if not use_collectives:
        raise CheckpointError("use_collectives=False (every rank writing without a global plan) is not supported: "
                              "distckpt commits a checkpoint only once every rank's data is written; to save from one "
                              "process, pass no_dist=True")


def _wait_for_room(max_in_flight: int, wait_for_previous: bool) -> Optional[BaseException]:
    """Wait until fewer than ``max_in_flight`` saves are in flight; or, without ``wait_for_previous``, the error
    this call fails with (raised on every rank by the agreement: other ranks may have room)."""
    while True:
        with _STATE.lock:
            _STATE.in_flight = [h for h in _STATE.in_flight if not h.done()]
            if len(_STATE.in_flight) < max_in_flight:
                return None
            oldest = _STATE.in_flight[0]
        if not wait_for_previous:
            return CheckpointError(
                f"an async save of {str(oldest.checkpoint_id)!r} is still in flight; wait for handle.result() "
                "or pass wait_for_previous=True or a larger max_in_flight")
        _wait_for(oldest)


def _background(handle: AsyncSaveHandle, staged: Any, storage_writer: StorageWriter, planner: SavePlanner,
                coord: Coordinator, channel: Any, number: int, pool: BufferPool,
                on_commit: Optional[Callable[[Metadata], None]]) -> None:
    """The write and commit of a staged save, in the background thread; the outcome goes on ``handle``."""
    md: Optional[Metadata] = None
    error: Optional[BaseException] = None
    try:
        _lower_priority()
        md = run_save(staged, storage_writer, planner, coord)
        if on_commit is not None:
            on_commit(md)
    except BaseException as exc:  # noqa: BLE001 - delivered on the handle
        error = exc
    finally:
        if coord.transport_failed and channel is not None:
            channel.broken = f"async save #{number} of {str(handle.checkpoint_id)!r}: {error}"
        return_pool(pool)  # back before the handle resolves: the next save, or release_buffers, finds it
    if error is not None:
        handle.committed.set_exception(error)
    else:
        handle.committed.set_result(md)
