"""Running I/O tasks: big ones on a thread pool, many-item ones on the calling thread.

I/O and checksums release the GIL, so threads overlap them. Per-item Python
work (thousands of small tensors) holds the GIL, and threads would only add
switching cost; such tasks run on the calling thread while the pool works.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

_MANY_ITEMS = 16


def run_tasks(tasks: list[tuple[Callable[[Any], None], Any, int]], threads: int, name: str) -> None:
    """Run ``fn(arg)`` for each ``(fn, arg, item_count)``; re-raise the first failure."""
    heavy = [(fn, arg) for fn, arg, n in tasks if n < _MANY_ITEMS]
    light = [(fn, arg) for fn, arg, n in tasks if n >= _MANY_ITEMS]
    if threads <= 1 or len(heavy) <= 1:
        for fn, arg in heavy + light:
            fn(arg)
        return
    with ThreadPoolExecutor(min(threads, len(heavy)), thread_name_prefix=name) as pool:
        futures = [pool.submit(fn, arg) for fn, arg in heavy]
        try:
            for fn, arg in light:
                fn(arg)
        finally:
            for f in futures:
                f.result()
