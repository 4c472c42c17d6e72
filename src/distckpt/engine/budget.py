"""A byte budget for transient buffers (host copies on save, read buffers on load)."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator


class ByteBudget:
    """Blocks ``acquire`` until ``n`` bytes fit under ``limit``.

    A request larger than the whole budget is let through alone, so a single
    huge tensor still saves, just without company. ``high_water`` records the
    most bytes ever held at once.
    """

    def __init__(self, limit: int):
        self.limit = max(1, limit)
        self.held = 0
        self.high_water = 0
        self._cv = threading.Condition()

    def acquire(self, n: int) -> None:
        with self._cv:
            while self.held > 0 and self.held + n > self.limit:
                self._cv.wait()
            self.held += n
            self.high_water = max(self.high_water, self.held)

    def release(self, n: int) -> None:
        with self._cv:
            self.held -= n
            self._cv.notify_all()

    @contextmanager
    def hold(self, n: int) -> Iterator[None]:
        self.acquire(n)
        try:
            yield
        finally:
            self.release(n)
