"""Checks of the JSON fields every decoder of plans and metadata shares."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..errors import CorruptCheckpointError

MAX_DIMS = 64
MAX_INT = (1 << 63) - 1  # offsets, sizes and lengths fit in a signed 64-bit integer


def ints(value: Any, where: str, *, allow_none: bool = False) -> Optional[torch.Size]:
    """``value`` as a torch.Size: a list of at most MAX_DIMS integers in [0, MAX_INT] (or None, if allowed)."""
    if value is None and allow_none:
        return None
    if type(value) is list and len(value) <= MAX_DIMS:
        for x in value:
            if type(x) is not int or x < 0 or x > MAX_INT:
                break
        else:
            return torch.Size(value)
    raise CorruptCheckpointError(f"{where}: expected a list of at most {MAX_DIMS} non-negative integers, got {value!r:.200}")
