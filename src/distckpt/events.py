"""Structured events: one per phase of every save, load, retention and compaction, for whatever watches them.

A phase (``"plan"``, ``"write"``, ``"read"``, ``"stage"``, ``"total"``...) of an operation (``"save"``,
``"async_save"``, ``"load"``, ``"retention"``, ``"compaction"``) is timed where it runs and handed, once it ends, as
an :class:`Event` to every callback registered with :func:`observe` in that process (a TieredCheckpointManager's
``persist`` and ``restore`` too, with the tier). The bytes and files a phase
moves are counted by the same engines that report progress (:mod:`distckpt.progress` adds to the phase in which it
runs). A manager says which step a phase belongs to (:func:`context`). Nothing is recorded while no callback is
registered, and a callback that raises is logged, never raised into a save.

    events = []
    with distckpt.observe(events.append):
        distckpt.save(state, checkpoint_id="/ckpt/step-1")
    # [Event(operation='save', phase='plan', ...), Event(operation='save', phase='write', ...),
    #  Event(operation='save', phase='total', ...)]

:class:`distckpt.metrics.PrometheusMetrics` is such a callback.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Optional

__all__ = ["Event", "Observation", "observe", "observing", "phase", "context", "named", "add_bytes", "add_retry", "report", "when_done",
           "current", "relay", "detached"]

log = logging.getLogger("distckpt")


@dataclass(frozen=True)
class Event:
    """One phase of one operation on one rank, as it ended."""

    operation: str  # "save", "async_save", "load", "retention", "compaction"
    phase: str  # "plan", "write", "read", "stage", "total", ...
    seconds: float  # how long the phase took, start to end
    started_at: float = 0.0  # when it began, in seconds since the epoch (time.time())
    rank: int = 0
    step: Optional[int] = None  # the step, where a CheckpointManager ran the operation
    checkpoint_id: Optional[str] = None
    bytes: int = 0  # bytes this rank wrote or read in the phase (data files; "total" counts the whole operation's)
    files: int = 0  # files (or steps, for retention) the phase wrote, read or deleted
    blocked_seconds: Optional[float] = None  # of an async save's "total": how long the caller waited (the staging)
    retries: int = 0  # requests a store retried in the phase
    tier: Optional[str] = None  # where the bytes went or came from: "durable", "local", "peer"
    error: Optional[str] = None  # the class of the exception the phase ended with; None where it succeeded


class Observation:
    """A registered callback; :meth:`close` (or leaving the ``with`` block) unregisters it."""

    def __init__(self, callback: Callable[[Event], Any]) -> None:
        self.callback = callback

    def close(self) -> None:
        with _LOCK:
            if self in _OBSERVERS:
                _OBSERVERS.remove(self)

    def __enter__(self) -> "Observation":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_LOCK = threading.Lock()
_OBSERVERS: list[Observation] = []


def observe(callback: Callable[[Event], Any]) -> Observation:
    """Call ``callback(event)`` for every phase that ends in this process from now on (from the thread that ran it:
    a callback is quick, or hands the event on)."""
    if not callable(callback):
        raise TypeError(f"distckpt.observe takes a callable, got {type(callback).__name__}")
    observation = Observation(callback)
    with _LOCK:
        _OBSERVERS.append(observation)
    return observation


def observing() -> bool:
    """Whether any callback is registered (phases are not timed otherwise)."""
    return bool(_OBSERVERS)


def _emit(event: Event) -> None:
    with _LOCK:
        observers = list(_OBSERVERS)
    token = _OPEN.set([])  # what a callback does itself (a save of its own) counts in no phase it watches
    try:
        for observation in observers:
            try:
                observation.callback(event)
            except Exception:  # noqa: BLE001 - a watcher's failure never fails the operation it watches
                log.exception("distckpt: an event callback raised (ignored): %r", observation.callback)
    finally:
        _OPEN.reset(token)


class _Open:
    """A phase in progress: what the engines add to it."""

    def __init__(self) -> None:
        self.bytes = 0
        self.files = 0
        self.retries_before = _RETRIES[0]
        self.fields: dict = {}  # what the block learns of itself (the step a restore chose), over the call's fields
        self.lock = threading.Lock()


_RETRIES = [0]  # retried requests in this process so far, whatever thread made them (I/O runs on pools of threads)


_CONTEXT: contextvars.ContextVar[dict] = contextvars.ContextVar("distckpt_event_context", default={})
_OPEN: contextvars.ContextVar[list] = contextvars.ContextVar("distckpt_open_phases", default=[])


@contextlib.contextmanager
def context(**fields: Any) -> Iterator[None]:
    """Fields (``step``, ``checkpoint_id``, ``rank``, ``tier``) that every event of the block carries."""
    token = _CONTEXT.set({**_CONTEXT.get(), **fields})
    try:
        yield
    finally:
        _CONTEXT.reset(token)


@contextlib.contextmanager
def phase(operation: str, name: str, retries: bool = True, **fields: Any) -> Iterator[Optional[_Open]]:
    """Time the block as phase ``name`` of ``operation`` and emit its :class:`Event` when it ends (with the class of
    the exception it raised, if it did). Bytes and files the engines count inside it add to it, and to every phase
    it is nested in; requests retried in this process meanwhile too, unless ``retries`` is False (a phase that
    makes no request of its own: an async save's staging, which may overlap the background of the one before).
    Yields None, and costs nothing, while no callback is registered."""
    if not _OBSERVERS:
        yield None
        return
    record = _Open()
    token = _OPEN.set(_OPEN.get() + [record])
    started_at, start = time.time(), time.perf_counter()
    error = None
    try:
        yield record
    except BaseException as exc:
        error = type(exc).__name__
        raise
    finally:
        _OPEN.reset(token)
        seconds = time.perf_counter() - start
        merged = {**_CONTEXT.get(), **fields, **record.fields}
        retried = _RETRIES[0] - record.retries_before if retries else 0
        _emit(Event(operation=operation, phase=name, seconds=seconds, started_at=started_at, bytes=record.bytes,
                    files=record.files, retries=retried, error=error, **merged))


def named(checkpoint_id: Any) -> Optional[str]:
    """A checkpoint id as an event carries it."""
    if checkpoint_id is None:
        return None
    return os.fspath(checkpoint_id) if isinstance(checkpoint_id, os.PathLike) else str(checkpoint_id)


def add_bytes(n: int, files: int = 0) -> None:
    """Count ``n`` bytes (and ``files`` files) moved in the phases open in this context."""
    for record in _OPEN.get():
        with record.lock:
            record.bytes += n
            record.files += files


def add_retry(n: int = 1) -> None:
    """Count ``n`` retried requests: every phase open in this process meanwhile counts them."""
    with _LOCK:
        _RETRIES[0] += n


def report(operation: str, name: str, seconds: float, started_at: float, **fields: Any) -> None:
    """Emit phase ``name`` of ``operation``, timed by its caller from ``started_at`` (``time.time()``): a part of a
    restore, or an async save that failed before it was under way."""
    if _OBSERVERS:
        _emit(replace(Event(operation=operation, phase=name, seconds=seconds, started_at=started_at),
                      **{**_CONTEXT.get(), **fields}))


def detached(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` to run on another thread in a copy of this context with no phase open: its events carry this call's
    fields (step, checkpoint), and its bytes count in no phase of the caller's (an async save's background)."""
    copied = contextvars.copy_context()
    copied.run(_OPEN.set, [])
    return functools.partial(copied.run, fn)


def current() -> dict:
    """The fields this context gives every event (:func:`context`)."""
    return dict(_CONTEXT.get())


def relay(got: list, **fields: Any) -> None:
    """Emit events another process recorded (an async save's writer process: its save's phases), with ``fields``
    (this process's context when it handed the save over) over theirs."""
    if _OBSERVERS:
        for event in got:
            if isinstance(event, Event):
                _emit(replace(event, **fields))


def when_done(future: Future, operation: str, name: str, start: float, **fields: Any) -> None:
    """Emit phase ``name`` of ``operation`` when ``future`` resolves (on whichever thread resolves it), timed from
    ``start`` (``time.perf_counter()``), with this context's fields and ``fields``: an async save's whole."""
    if not _OBSERVERS:
        return
    merged = {**_CONTEXT.get(), **fields}
    started_at = time.time() - (time.perf_counter() - start)

    def done(f: Future) -> None:
        error = "CancelledError" if f.cancelled() else None if f.exception() is None else type(f.exception()).__name__
        seconds = time.perf_counter() - start
        _emit(replace(Event(operation=operation, phase=name, seconds=seconds, started_at=started_at, error=error),
                      **merged))

    future.add_done_callback(done)
