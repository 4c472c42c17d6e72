"""Which way data files go to a local disk: around the page cache (``O_DIRECT``) or through it.

Neither wins on every device, nor on one device every day. On the development VM's disk, direct writes
with fsync ran twice as fast as buffered ones in one session, as fast in another, and 10% slower in a
third, where the kernel's writeback kept more requests queued than one direct write at a time does
(docs/performance.md, "Multi-rank I/O"). So with ``DISTCKPT_DIRECT_IO=auto`` a process learns it for
each device: the first save there writes directly, the next through the page cache, and later saves take
whichever moved its files faster (write to durable, as an exponential average over files), with every
eighth save taking the other way again, because a device's speed drifts. Saves without fsync are not
counted: they measure the page cache, not the device.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Optional

from .. import process_state
from ..engine.blobs import BlobWriter

__all__ = ["WritePaths", "TimedWriter", "PATHS"]

LOOK_AGAIN_EVERY = 8  # saves on a device between two that take the way that measured slower
_WEIGHT = 0.5  # of the newest file in a way's average rate
_MIN_BYTES = 16 << 20  # smaller files say more about latency than about the device's rate


class WritePaths:
    """Per device: the rate each way sustained, and the way the next save takes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rate: dict[tuple[int, bool], float] = {}  # (device, direct) -> bytes per second
        self.saves: dict[int, int] = {}

    def choose(self, device: int) -> bool:
        """Whether the next save on ``device`` writes directly."""
        with self.lock:
            n = self.saves[device] = self.saves.get(device, 0) + 1
            direct, buffered = self.rate.get((device, True)), self.rate.get((device, False))
            if direct is None or buffered is None:
                return direct is None  # each way once, direct first
            faster = direct >= buffered
            return faster if n % LOOK_AGAIN_EVERY else not faster

    def record(self, device: int, direct: bool, nbytes: int, seconds: float) -> None:
        """A file of ``nbytes`` took ``seconds`` from its creation until it was durable."""
        if nbytes < _MIN_BYTES or seconds <= 0:
            return
        with self.lock:
            old = self.rate.get((device, direct))
            new = nbytes / seconds
            self.rate[(device, direct)] = new if old is None else _WEIGHT * new + (1 - _WEIGHT) * old

    def reset(self) -> None:
        self.lock = threading.Lock()  # a parent's thread may have held it at the fork
        self.rate.clear()
        self.saves.clear()


PATHS = WritePaths()

process_state.on_fork_child(PATHS.reset)


class TimedWriter(BlobWriter):
    """A writer whose bytes and time to durable are recorded in ``paths`` when it closes with sync."""

    def __init__(self, inner: BlobWriter, paths: WritePaths, device: int, direct: bool) -> None:
        self.inner, self.paths, self.device, self.direct = inner, paths, device, direct
        self.start = time.perf_counter()
        self.nbytes = 0

    def pwrite(self, data: memoryview, offset: int) -> None:
        self.inner.pwrite(data, offset)
        self.nbytes += len(data)

    def pwritev(self, buffers: list, offset: int) -> None:
        self.inner.pwritev(buffers, offset)
        self.nbytes += sum(len(b) for b in buffers)

    def close(self, sync: bool) -> None:
        self.inner.close(sync)
        if sync:
            self.paths.record(self.device, self.direct, self.nbytes, time.perf_counter() - self.start)

    def abort(self) -> None:
        self.inner.abort()


def device_of(path: str) -> Optional[int]:
    """The device number of the file system holding ``path``, or None where it cannot be asked."""
    try:
        return os.stat(path).st_dev
    except OSError:
        return None
