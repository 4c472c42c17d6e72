"""Staging memory that is still being filled while a save writes from it.

A writer process (:mod:`distckpt.writer_process`) is handed its save as soon as the ranks agree to it, and plans
and writes while its training process is still copying the state into the shared staging buffers: the training
process counts the buffers it has filled, in order, in a small shared counter, and the write engine waits, before
it reads the bytes of a tensor, until the buffer that holds them is counted. The write of the first tensors thus
overlaps the copy of the last ones, and a save's total time approaches the longer of the two instead of their sum.

The counter is published after the copy it counts has returned, and read before the bytes it guards; the GIL's
lock is taken and released between the two on each side, which orders them on every architecture torch runs on.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import os
import threading
import time
from typing import Iterator, Optional

import torch

from ..errors import CheckpointError

__all__ = ["Filling", "new_counter", "filling", "current"]

_FILLED, _FAILED = 0, 1


def new_counter() -> torch.Tensor:
    """The shared counter of one save's staging: [buffers filled, failed], in memory a writer process maps."""
    return torch.zeros(2, dtype=torch.int64).share_memory_()


def count(counter: torch.Tensor, filled: int) -> None:
    """The training process's side: the first ``filled`` buffers hold their bytes."""
    counter[_FILLED] = filled


def fail(counter: torch.Tensor) -> None:
    """The training process's side: the copy failed; what waits for it raises."""
    counter[_FAILED] = 1


class Filling:
    """The writer's side: waits for the buffer behind a tensor to be filled (the buffers in the order of filling)."""

    def __init__(self, counter: torch.Tensor, buffers: list[torch.Tensor], timeout_s: float):
        spans = sorted((b.data_ptr(), b.data_ptr() + b.nbytes, i + 1) for i, b in enumerate(buffers) if b.nbytes)
        self._starts = [start for start, _, _ in spans]
        self._spans = spans
        self._total = len(buffers)
        self._counter = counter
        self._timeout_s = timeout_s
        self._seen = 0
        self._lock = threading.Lock()
        self._parent = os.getppid()

    def wait(self, tensor: torch.Tensor) -> None:
        """Return once the bytes of ``tensor`` are filled, if they are in a staging buffer; raise CheckpointError if
        the copy failed, the training process is gone, or nothing was filled for the collective timeout."""
        if self._seen >= self._total or not tensor.nbytes:
            return
        try:
            ptr = tensor.data_ptr()
        except RuntimeError:  # a wrapper with no storage of its own (a DTensor): wait for the whole state
            ptr = None
        if ptr is None:
            need = self._total
        else:
            j = bisect.bisect_right(self._starts, ptr) - 1
            if j < 0 or ptr >= self._spans[j][1]:
                return  # not staged memory: nothing to wait for
            need = self._spans[j][2]
        pause, last, since = 5e-5, self._seen, time.monotonic()
        while True:
            filled, failed = (int(v) for v in self._counter.tolist())
            if failed:
                raise CheckpointError("the training process could not copy the state into staging memory; "
                                      "its async_save raised the cause, and nothing of this save is committed")
            with self._lock:
                self._seen = max(self._seen, filled)
            if filled >= need:
                return
            now = time.monotonic()
            if filled != last:
                last, since = filled, now
            elif os.getppid() != self._parent:
                raise CheckpointError("the training process exited while it copied the state into staging memory; "
                                      "nothing of this save is committed")
            elif now - since > self._timeout_s:
                raise CheckpointError(f"the training process filled no staging buffer for {self._timeout_s:.0f}s "
                                      f"({filled} of {self._total} filled); nothing of this save is committed "
                                      "(DISTCKPT_TIMEOUT_S bounds the wait)")
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)


_CURRENT: contextvars.ContextVar[Optional[Filling]] = contextvars.ContextVar("distckpt_filling", default=None)


@contextlib.contextmanager
def filling(what: Optional[Filling]) -> Iterator[None]:
    """Saves run in this context write from staging that ``what`` says is filled (None: all of it is)."""
    token = _CURRENT.set(what)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> Optional[Filling]:
    """The filling the write engine waits on, taken in the thread that starts a rank's write."""
    return _CURRENT.get()
