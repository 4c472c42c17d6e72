"""Rank bodies of tests/distributed/test_prefetch.py."""

from __future__ import annotations

import os

from distckpt import CheckpointManager
from distckpt.testing.read_counts import FileReads

from .shared_read_workers import _equal, _replicated, _sharded, _zeros_like


def save_mixed(rank, world_size, root):
    CheckpointManager(root).save(5, {**_replicated(), **_sharded(world_size, True)})
    return True


def load_after_prefetch(rank, world_size, root, who, with_state):
    """Prefetch (on the ranks in ``who``) and load the mixed state; whether it is exact, the data bytes this rank
    read from storage during the load, and what its prefetch held."""
    mgr = CheckpointManager(root)
    sd = {**_zeros_like(_replicated()), **_sharded(world_size, False)}
    held = 0
    if rank in who:
        held = mgr.prefetch(state_dict=sd if with_state else None, max_bytes=1 << 30).wait(60)
    metadata = os.path.getsize(os.path.join(mgr.path(5), "metadata.json"))
    reads = FileReads()
    mgr.load(sd)
    want = {**_replicated(), **_sharded(world_size, True)}
    return {"exact": all(_equal(sd[k], v) for k, v in want.items()), "read": reads.total - metadata, "held": held}
