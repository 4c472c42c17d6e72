"""Pausing Python's cyclic garbage collector around work that builds many short-lived objects."""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

__all__ = ["gc_paused"]


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while planning builds many small objects.

    With a large heap (a model's tensors), generational collections triggered
    by plan objects cost more than the planning itself; nothing planned here
    forms cycles that must be freed before the save or load ends.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
