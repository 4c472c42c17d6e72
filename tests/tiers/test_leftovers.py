"""A rank's process killed mid-save leaves a staging area and a lease in its own tier; the next process of that rank
removes both, and nothing else: not a file someone put there, neither a link planted under such a name nor what it
points at."""

import os

import torch

from distckpt.backends.filesystem import LEASE_MARK, TMP_MARK, hidden_name
from distckpt.testing import run_ranks


def _plant_and_start(rank, world_size, root):
    import distckpt

    os.environ["DISTCKPT_NODE_ID"] = f"node{rank}"
    local = os.path.join(root, f"node{rank}")
    own = os.path.join(local, "own", f"rank-{rank}")
    os.makedirs(own)
    lease = os.path.join(own, hidden_name("step-3", LEASE_MARK, "a1b2"))
    staging = os.path.join(own, hidden_name("step-3", TMP_MARK, "a1b2"))
    long_lease = os.path.join(own, hidden_name("s" * 200, LEASE_MARK, "c3d4"))  # the other form of hidden names
    outside = os.path.join(root, f"outside{rank}")
    os.makedirs(outside)
    with open(os.path.join(outside, "keep.bin"), "wb") as f:
        f.write(b"x")
    link = os.path.join(own, hidden_name("step-4", TMP_MARK, "e5f6"))
    os.symlink(outside, link)
    os.makedirs(staging)
    with open(os.path.join(staging, "data-0.bin"), "wb") as f:
        f.write(b"half")
    for path in (lease, long_lease, os.path.join(own, "notes.txt")):
        with open(path, "w") as f:
            f.write("{}")
    mgr = distckpt.TieredCheckpointManager(os.path.join(root, "durable"), local=local, persist_every=0)
    left = sorted(os.listdir(own))
    mgr.save(1, {"w": torch.full((4,), float(rank))})
    mgr.wait()
    steps = mgr.own_steps()
    mgr.close()
    return {"left": left, "link": os.path.basename(link), "outside": os.listdir(outside), "steps": steps}


def test_a_killed_save_s_staging_and_lease_are_removed_and_nothing_else(tmp_path):
    for result in run_ranks(_plant_and_start, 2, str(tmp_path), timeout_s=120):
        assert result["left"] == sorted([result["link"], "notes.txt"]), result
        assert result["outside"] == ["keep.bin"], result
        assert result["steps"] == [1], result
