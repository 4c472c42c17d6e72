"""Index arithmetic of lazy reads: a basic index (ints, slices, ``...``, ``None``) of a stored tensor as one
arithmetic progression per dimension, the part of it each stored chunk holds, and the runs of rows to read.

Pure Python on integers, as resharding.py: no torch, no I/O. ``distckpt.open``'s tensors (opening.py) and the
engine's lazy reads (engine/lazy_reads.py) are built on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ..errors import CheckpointIndexError

__all__ = ["Axis", "Selection", "select", "chunk_part", "row_runs", "row_blocks"]


@dataclass(frozen=True)
class Axis:
    """The indices ``start + k * step`` for k in [0, count) of one stored dimension; ``keep`` False where an int
    picked one index (the dimension is dropped from the result)."""

    start: int
    step: int
    count: int
    keep: bool = True

    def covers(self, size: int) -> bool:
        """Whether every index of a dimension of ``size`` is selected, in order."""
        return self.start == 0 and self.step == 1 and self.count == size


@dataclass(frozen=True)
class Selection:
    """A basic index resolved against a shape: one :class:`Axis` per stored dimension, and ``view``, the index
    that turns the block read (one dimension of ``count`` per axis) into what torch's indexing returns
    (0 for an int, ``None`` for a new axis, ``slice(None)`` for the rest)."""

    axes: tuple[Axis, ...]
    view: tuple

    @property
    def block_shape(self) -> tuple[int, ...]:
        return tuple(a.count for a in self.axes)

    def covers(self, shape: Sequence[int]) -> bool:
        return all(a.covers(n) for a, n in zip(self.axes, shape))


def _is_int(x: Any) -> bool:
    """Whether torch's indexing takes ``x`` as one int: a Python or NumPy integer, or a 0-d integer tensor (a
    tensor of one element with dimensions is an advanced index, and a bool or uint8 tensor a mask, to torch)."""
    if isinstance(x, bool):
        return False
    if getattr(x, "ndim", 0) != 0 or str(getattr(x, "dtype", "")) in ("torch.bool", "torch.uint8", "bool"):
        return False
    try:
        return isinstance(x.__index__(), int)
    except (AttributeError, TypeError):
        return False


def select(index: Any, shape: Sequence[int], where: str) -> Selection:
    """``index`` (what follows ``tensor[...]``) resolved against ``shape``, with torch's rules for basic
    indexing: negative ints count from the end and must be in range, slices are clamped, steps must be positive.

    Raises CheckpointIndexError (an IndexError) for an int out of range, a zero or negative step, too many
    indices, a second ``...``, or an index of another kind (a tensor, a list, a bool): read the tensor whole
    and index the result for those.
    """
    items = index if isinstance(index, tuple) else (index,)
    if sum(1 for x in items if x is Ellipsis) > 1:
        raise CheckpointIndexError(f"{where}: an index can only have a single ellipsis ('...'), got {index!r}")
    used = sum(1 for x in items if x is not None and x is not Ellipsis)
    if used > len(shape):
        raise CheckpointIndexError(f"{where}: too many indices for a tensor of {len(shape)} dimension(s) "
                                   f"(shape {list(shape)}): {index!r}")
    rest = [slice(None)] * (len(shape) - used)
    if not any(x is Ellipsis for x in items):
        items = items + (Ellipsis,)
    expanded: list = []
    for x in items:
        expanded.extend(rest if x is Ellipsis else [x])
    axes: list[Axis] = []
    view: list = []
    for x in expanded:
        if x is None:
            view.append(None)
            continue
        dim = len(axes)
        size = shape[dim]
        if _is_int(x):
            i = x.__index__()
            if not -size <= i < size:
                raise CheckpointIndexError(f"{where}: index {i} is out of bounds for dimension {dim} with size {size}")
            axes.append(Axis(i % size, 1, 1, keep=False))
            view.append(0)
        elif isinstance(x, slice):
            axes.append(_axis_of_slice(x, size, dim, where))
            view.append(slice(None))
        else:
            raise CheckpointIndexError(
                f"{where}: a lazy tensor takes ints, slices, '...' and None as indices, not {type(x).__name__} "
                f"({x!r:.60}); read it whole (.read()) and index the tensor for advanced indexing")
    return Selection(tuple(axes), tuple(view))


def _axis_of_slice(s: slice, size: int, dim: int, where: str) -> Axis:
    for part in (s.start, s.stop, s.step):
        if part is not None and not _is_int(part):
            raise CheckpointIndexError(f"{where}: slice {s!r} of dimension {dim}: its bounds and step must be ints")
    if s.step is not None and s.step.__index__() <= 0:
        raise CheckpointIndexError(f"{where}: slice {s!r} of dimension {dim}: the step must be greater than zero "
                                   "(as for torch tensors); flip the result instead (.flip(dim))")
    start, stop, step = s.indices(size)
    count = len(range(start, stop, step))
    return Axis(start, step if count > 1 else 1, count)  # a step past the end picks at most one index: torch's
    # strides are 64-bit, so a larger step must not reach them


def chunk_part(axes: Sequence[Axis], offsets: Sequence[int], sizes: Sequence[int]) -> Optional[list[tuple[int, int, int]]]:
    """The part of a selection a chunk (``offsets``, ``sizes``) holds: per dimension (k_lo, k_hi, first), the
    selected positions [k_lo, k_hi) of that axis lying in the chunk and the chunk-local index of the first;
    None where the chunk holds nothing of it."""
    part = []
    for a, lo, n in zip(axes, offsets, sizes):
        if a.count == 0 or n == 0:
            return None
        k_lo = max(0, -(-(lo - a.start) // a.step))
        k_hi = min(a.count, -(-(lo + n - a.start) // a.step))
        if k_lo >= k_hi:
            return None
        part.append((k_lo, k_hi, a.start + k_lo * a.step - lo))
    return part


def row_runs(first: int, n: int, step: int, row_bytes: int, gap_bytes: int) -> list[tuple[int, int]]:
    """The ranges [a, b) of a chunk's rows to read for the ``n`` rows ``first + i * step``: one range where
    the rows between are cheaper to read than another request (gaps of at most ``gap_bytes``), else each row."""
    if n <= 0:
        return []
    if step == 1 or (step - 1) * row_bytes <= gap_bytes:
        return [(first, first + (n - 1) * step + 1)]
    return [(r, r + 1) for r in range(first, first + n * step, step)]


def row_blocks(rows: int, cuts: Sequence[int], max_rows: int) -> list[tuple[int, int]]:
    """Cut rows [0, rows) into blocks of at most ``max_rows`` (at least 1), at the ``cuts`` (row boundaries of
    stored chunks) where one lies within reach, so that a chunk lies whole in a block wherever it fits."""
    max_rows = max(1, max_rows)
    marks = sorted({c for c in cuts if 0 < c < rows} | {rows})
    blocks, at, i = [], 0, 0
    while at < rows:
        limit = at + max_rows
        while i < len(marks) and marks[i] <= at:
            i += 1
        j, end = i, None
        while j < len(marks) and marks[j] <= limit:
            end = marks[j]
            j += 1
        end = end if end is not None else min(rows, limit)
        blocks.append((at, end))
        at = end
    return blocks
