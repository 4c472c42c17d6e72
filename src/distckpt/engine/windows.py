"""Cache-sized windows over runs of bytes that lie back to back in a file.

A checksum over bytes the CPU has just touched runs from cache, about twice
as fast here as over bytes in main memory. So the I/O engine moves data in
windows of a few MiB and checksums each window right after the kernel copied
it: on load the read leaves the destination bytes in cache, on save the write
leaves the source bytes there.
"""

from __future__ import annotations

from typing import Iterator

# large enough that a window's system call and checksum call cost little per byte, small enough that the
# window is still in the CPU's cache when it is checksummed right after the copy (docs/performance.md)
WINDOW_BYTES = 2 << 20


def windows(views: list[memoryview], size: int = WINDOW_BYTES) -> Iterator[list[tuple[int, memoryview]]]:
    """``views`` in consecutive windows of ``size`` bytes (the last may be shorter).

    Each window is a list of (index into ``views``, piece of that view); a view
    larger than a window is split across windows, and an empty view still
    appears once, so that every view is seen.
    """
    size = max(1, size)
    out: list[tuple[int, memoryview]] = []
    room = size
    for j, view in enumerate(views):
        n = len(view)
        if 0 < n < room:  # the common case of many small items: the whole view, no slice
            out.append((j, view))
            room -= n
            continue
        start = 0
        while True:
            piece = view[start:start + room]
            out.append((j, piece))
            start += len(piece)
            room -= len(piece)
            if room <= 0:
                yield out
                out, room = [], size
            if start >= len(view):
                break
    if out:
        yield out
