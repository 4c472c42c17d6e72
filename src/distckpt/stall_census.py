"""Which ranks a wait that failed was waiting for: a census in the group's store.

A collective that times out tells a rank only that it waited; gloo does not say for whom. Each rank whose wait
failed records it under the operation's key in the group's key-value store; after a grace for the others to do
the same, the ranks that recorded nothing are the ones that never reached the phase: stopped, hung or dead. The
store's host (global rank 0 under init_process_group) stalled is told apart: the store then does not answer.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

import torch.distributed as dist

__all__ = ["absent_ranks", "named"]


def _store_of(group: Any) -> Any:
    """The key-value store ``group`` was built on (torch's private lookups: None where they are gone)."""
    try:
        if group is None or group == dist.group.WORLD:
            return dist.distributed_c10d._get_default_store()
        return dist.distributed_c10d._get_process_group_store(group)
    except Exception:  # noqa: BLE001 - the ranks then go unnamed, not the error
        return None


def absent_ranks(group: Any, identity: str, rank: int, world_size: int, timeout_s: float) -> Optional[list[int]]:
    """The ranks of ``group`` that have not reported failing in operation ``identity``, once this rank has, after
    waiting a grace for the other live ranks to report (a tenth of the timeout, 0.5-3 s: the ranks waiting in one
    collective time out close together; 0 for ``timeout_s`` 0). None where the store does not answer: its host
    (global rank 0 under init_process_group) is stalled or gone too."""
    store = _store_of(group)
    if store is None:
        return None
    grace = min(3.0, max(0.5, timeout_s / 10)) if timeout_s > 0 else 0.0
    found: list = []
    # a thread: a store whose host is stopped keeps some calls (check) waiting past any timeout set on it
    census = threading.Thread(target=_census, args=(store, f"distckpt/stalled/{identity}/", rank, world_size, grace,
                                                    found), daemon=True)
    census.start()
    census.join(2 * grace + 1)
    return found[0] if found else None


def _census(store: Any, key: str, rank: int, world_size: int, grace: float, found: list) -> None:
    try:
        store.set(f"{key}{rank}", b"1")
        deadline = time.monotonic() + grace
        while True:
            absent = [r for r in range(world_size) if not store.check([f"{key}{r}"])]
            if not absent or time.monotonic() >= deadline:
                found.append(absent)
                return
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - the store's own failure: the ranks go unnamed
        return


def named(absent: Optional[list[int]]) -> str:
    """``absent`` (from :func:`absent_ranks`) in words, for an error."""
    if absent is None:
        return ("ranks it cannot name (the group's store did not answer: its host, global rank 0 under "
                "init_process_group, is stalled or gone)")
    if not absent:
        return "the other ranks (every rank reported failing too: they were in different collectives)"
    return f"rank{'s' if len(absent) > 1 else ''} {', '.join(map(str, absent))}, which did not reach this phase"
