"""Running a check in a forked child, as a data loader's worker is forked from a training process."""

from __future__ import annotations

import multiprocessing
from typing import Any, Callable

import pytest


def _child(fn: Callable, args: tuple, q) -> None:
    try:
        q.put(fn(*args))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        q.put(repr(exc))


def run_in_fork(fn: Callable, *args: Any, timeout_s: float = 60.0, hang: str = "the forked child hung") -> Any:
    """``fn(*args)`` in a forked child: its return value (or its error, as a string). Fails the test if it hangs."""
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=_child, args=(fn, args, q))
    child.start()
    child.join(timeout_s)
    if child.is_alive():
        child.kill()
        pytest.fail(hang)
    return q.get(timeout=5)
