"""Fault injection at every I/O and collective boundary, for crash-consistency tests.

Production code calls :func:`point` before each boundary: each write, fsync,
rename, unlink and collective. With no fault configured this is one global
lookup. A fault is configured in-process with :func:`inject`, or for spawned
processes with the environment variable ``DISTCKPT_FAULT``::

    DISTCKPT_FAULT="<action>:<index>[:<rank>]"

``action`` is ``kill`` (SIGKILL this process), ``enospc`` or ``eio`` (raise
that OSError); the fault fires at the ``index``-th boundary (0-based) this
process passes, optionally only on ``rank`` (from the RANK environment
variable or the rank set with :func:`set_rank`). ``DISTCKPT_FAULT_LOG=path``
appends every boundary passed to a file, to enumerate the points of a run.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

__all__ = ["point", "inject", "Fault", "set_rank", "from_spec", "configure"]


@dataclass
class Fault:
    action: str  # "kill", "enospc", "eio", or "call"
    index: Optional[int] = None  # fire at this boundary number; None: at every boundary matching `kinds`
    kinds: tuple[str, ...] = ()  # restrict to these boundary kinds ("write", "fsync", "rename", "unlink", "collective")
    rank: Optional[int] = None
    callback: Optional[Callable[[str, str], None]] = None
    once: bool = False  # fire at the first matching boundary only


_lock = threading.Lock()
_fault: Optional[Fault] = None
_count = 0
_log: Optional[str] = None
_rank: Optional[int] = None


def set_rank(rank: int) -> None:
    global _rank
    _rank = rank


def from_spec(spec: str) -> Fault:
    """A fault from ``<action>:<index or kind>[:<rank>]``: the ``index``-th boundary, or the first of ``kind``
    (write, fsync, rename, unlink, collective)."""
    parts = spec.split(":")
    at = parts[1] if len(parts) > 1 else ""
    rank = int(parts[2]) if len(parts) > 2 and parts[2] else None
    if at.isdigit():
        return Fault(parts[0], int(at), rank=rank)
    return Fault(parts[0], None, kinds=(at,), rank=rank, once=True)


def configure(fault: Optional[Fault]) -> None:
    """Configure ``fault`` for the rest of this process (what DISTCKPT_FAULT does at import)."""
    global _fault, _count
    with _lock:
        _fault, _count = fault, 0


def _from_env() -> None:
    global _fault, _log
    spec = os.environ.get("DISTCKPT_FAULT")
    if spec:
        parts = spec.split(":")
        _fault = Fault(parts[0], int(parts[1]), rank=int(parts[2]) if len(parts) > 2 and parts[2] else None)
    _log = os.environ.get("DISTCKPT_FAULT_LOG") or None


_from_env()


def point(kind: str, what: str = "") -> None:
    """Mark a boundary of kind ``kind`` (write, fsync, rename, unlink, collective)."""
    if _fault is None and _log is None:
        return
    _hit(kind, what)


def _hit(kind: str, what: str) -> None:
    global _count
    with _lock:
        index = _count
        _count += 1
        fault = _fault
        if _log is not None:
            with open(_log, "a") as f:
                f.write(f"{index}\t{_current_rank()}\t{kind}\t{what}\n")
    if fault is None:
        return
    if fault.rank is not None and fault.rank != _current_rank():
        return
    if fault.kinds and kind not in fault.kinds:
        return
    if fault.index is not None and fault.index != index:
        return
    if fault.once:
        configure(None)
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected at {kind} {what})")
    elif fault.action == "eio":
        raise OSError(errno.EIO, f"Input/output error (injected at {kind} {what})")
    elif fault.action == "call" and fault.callback is not None:
        fault.callback(kind, what)


def _current_rank() -> int:
    if _rank is not None:
        return _rank
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


@contextmanager
def inject(fault: Fault) -> Iterator[None]:
    """Configure ``fault`` within a block (in this process); boundary counting restarts at 0."""
    global _fault, _count
    with _lock:
        previous, _fault, _count = _fault, fault, 0
    try:
        yield
    finally:
        with _lock:
            _fault = previous
