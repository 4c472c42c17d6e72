"""Progress of the bytes a rank writes or reads, as the DISTCKPT_PROGRESS knob asks.

The I/O engines call :meth:`Progress.advance` from their threads after each
batch; reporting costs nothing when the knob is off (the default).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Optional

from . import events, knobs

__all__ = ["Progress"]

logger = logging.getLogger("distckpt")


def _global_rank() -> int:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except (ImportError, RuntimeError, ValueError):
        return 0


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without isatty, or closed
        return False


class Progress:
    """Bytes done out of ``total`` for one phase (``what``: "save", "load", "verify", ...) on this rank.

    With ``bar``, only the coordinator draws one (many ranks sharing a terminal
    would garble it), and only on a terminal: a bar's frames, each ending in a
    carriage return, fill a log file, so off a terminal the coordinator writes
    lines to stderr instead (as ``log`` words them, whatever logging is
    configured: a bar was asked for, so something shows). With ``log``, every
    rank logs through the ``distckpt`` logger. ``mode`` overrides the knob.
    """

    def __init__(self, what: str, total: int, is_coordinator: bool = True, mode: Optional[str] = None):
        mode = mode or knobs.progress_mode()
        self.to_stderr = False
        if mode == "bar" and not _stderr_is_terminal():
            mode, self.to_stderr = ("log" if is_coordinator else "off"), True
        self.rank = _global_rank() if mode != "off" else 0
        self.what, self.total, self.done = what, total, 0
        events.add_bytes(total)  # the bytes of the phase this runs in, for whatever observes it (events.py)
        self.mode = mode if (mode != "bar" or is_coordinator) else "off"
        self.lock = threading.Lock()
        self.start = self.last_log = time.monotonic()
        self.log_every_s = knobs.progress_log_every_s() if self.mode == "log" else 0.0
        self.bar = None
        if self.mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"distckpt {what} (rank {self.rank})", leave=False)

    def advance(self, n: int) -> None:
        if self.mode == "off":
            return
        with self.lock:
            self.done += n
            if self.bar is not None:
                self.bar.update(n)
            elif time.monotonic() - self.last_log >= self.log_every_s:
                self.last_log = time.monotonic()
                self._log("so far")

    def close(self) -> None:
        if self.mode == "off":
            return
        with self.lock:
            if self.bar is not None:
                self.bar.close()
                self.bar = None
            self._log("done")

    def _log(self, when: str) -> None:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        pct = 100.0 * self.done / self.total if self.total else 100.0
        line = (f"rank {self.rank}: {self.what} {when}: {_amount(self.done)} of {_amount(self.total)} ({pct:.0f}%) in "
                f"{elapsed:.1f} s, {_amount(self.done / elapsed)}/s")
        if self.to_stderr:
            print(f"distckpt: {line}", file=sys.stderr, flush=True)
        else:
            logger.info("%s", line)


def _amount(n: float) -> str:
    """Bytes in the decimal unit that shows them best (a progress line of a small checkpoint reads kB, not 0.000 GB)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"
