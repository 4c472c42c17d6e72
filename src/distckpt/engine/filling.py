"""Staging memory that is still being filled while a save writes from it.

A writer process (:mod:`distckpt.writer_process`) is handed its save as soon as the ranks agree to it, and plans
and writes while its training process is still copying the state into the shared staging buffers: the training
process counts the buffers it has filled, in order, in a small shared counter, and the write engine waits, before
it reads the bytes of a tensor, until the buffer that holds them is counted. The write of the first tensors thus
overlaps the copy of the last ones, and a save's total time approaches the longer of the two instead of their sum.

The storage writer carries the filling to the engine (its ``staging_fill``; writers that declare
:data:`~distckpt.capabilities.WRITES_WHILE_STAGING`), so every thread of its write waits on it. A write whose items
are not read from the staged tensors themselves (a planner that transforms them, resolves them one by one) waits
for the whole fill first; every write waits for the whole fill before it reports, so that a copy that failed on
this rank fails the save although none of its bytes were written here.

The training process stores the counter after the copy it counts has returned (torch's copy drops the GIL and
takes it back: a mutex released and acquired between the copy's stores and the counter's); the writer reads the
counter, takes a lock, then reads the bytes. x86 keeps stores in order anyway; on weaker memory models the mutex
operations between them are the barriers.
"""

from __future__ import annotations

import bisect
import os
import threading
import time

import torch

from ..errors import CheckpointError

__all__ = ["Filling", "new_counter", "count", "fail"]

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
            self._until(self._total)
            return
        j = bisect.bisect_right(self._starts, ptr) - 1
        if j >= 0 and ptr < self._spans[j][1]:  # else not staged memory: nothing to wait for
            self._until(self._spans[j][2])

    def wait_all(self) -> None:
        """Return once every buffer is filled; raise as :meth:`wait` does (a failed copy, even once all are counted)."""
        self._until(self._total)

    def _until(self, need: int) -> None:
        if self._seen >= max(need, 1) and not int(self._counter[_FAILED]):
            return
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
