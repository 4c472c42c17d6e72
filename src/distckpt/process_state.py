"""What a forked child must not inherit: the one ``os.register_at_fork`` hook of distckpt.

A child made by ``fork`` has only the thread that forked; the parent's other
threads (lease renewal, write and flush pools, async saves) are gone, a lock
one of them held stays held forever, and the saves and leases in flight are
the parent's, not the child's. Each module that keeps such state registers a
reset with :func:`on_fork_child` when it is imported, and this module's one
hook runs them in the child, in the order they were registered. That is
import order, so a module's reset runs after the resets of every module it
imports (imports point one way): a reset may rely on the state below it being
fresh already.
"""

from __future__ import annotations

import os
from typing import Callable

__all__ = ["on_fork_child", "fork_resets"]

_RESETS: list[Callable[[], None]] = []


def on_fork_child(reset: Callable[[], None]) -> Callable[[], None]:
    """Run ``reset`` in every child this process forks from now on, after the resets registered before it.

    Returns ``reset``, so that it can decorate the function it registers."""
    _RESETS.append(reset)
    return reset


def fork_resets() -> list[str]:
    """The registered resets, by qualified name, in the order a forked child runs them."""
    return [f"{fn.__module__}.{fn.__qualname__}" for fn in _RESETS]


def _after_fork_in_child() -> None:
    """Every reset, in order; one that raises does not keep the others from running (the first error is
    raised at the end, and Python reports it: a hook at fork has no caller to raise to)."""
    first = None
    for reset in list(_RESETS):
        try:
            reset()
        except BaseException as exc:  # noqa: BLE001 - the rest must still run
            first = first or exc
    if first is not None:
        raise first


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
