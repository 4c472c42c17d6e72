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
    few_items = [(fn, arg) for fn, arg, n in tasks if n < _MANY_ITEMS]  # byte-bound: threads overlap them
    many_items = [(fn, arg) for fn, arg, n in tasks if n >= _MANY_ITEMS]  # GIL-bound: run here
    if threads <= 1 or len(few_items) <= 1:
        for fn, arg in few_items + many_items:
            fn(arg)
        return
    with ThreadPoolExecutor(min(threads, len(few_items)), thread_name_prefix=name) as pool:
        futures = [pool.submit(fn, arg) for fn, arg in few_items]
        try:
            for fn, arg in many_items:
                fn(arg)
        finally:
            for f in futures:
                f.result()
