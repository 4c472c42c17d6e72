"""The start-up sweep of a rank's tier obeys the lease rules of CheckpointManager: a staging area whose process is
dead goes with its lease; one whose process lives (a lingering predecessor, still writing) stays, as do a link
planted under a staging area's name and what it points at, and a file someone put there."""

import json
import os
import subprocess

import torch

from distckpt.backends.filesystem import LEASE_MARK, TMP_MARK, hidden_name
from distckpt.testing import run_ranks


def _lease(pid):
    from distckpt.backends.leases import _start_time, holder

    return json.dumps({**holder(), "pid": pid, "start": _start_time(pid)})


def _plant_and_start(rank, world_size, root):
    import distckpt

    os.environ["DISTCKPT_NODE_ID"] = f"node{rank}"
    local = os.path.join(root, f"node{rank}")
    durable = os.path.join(root, "durable")
    mgr = distckpt.TieredCheckpointManager(durable, local=local, persist_every=0)
    mgr.save(1, {"w": torch.full((4,), float(rank))})
    mgr.wait()
    mgr.close()
    own = mgr.own_dir
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "60"])
    planted = {}
    for step, pid in ((3, dead.pid), (4, live.pid)):
        staging = os.path.join(own, hidden_name(f"step-{step}", TMP_MARK, "a1b2"))
        os.makedirs(staging)
        with open(os.path.join(staging, "data-0.bin"), "wb") as f:
            f.write(b"half")
        with open(os.path.join(own, hidden_name(f"step-{step}", LEASE_MARK, "a1b2")), "w") as f:
            f.write(_lease(pid))
        planted[step] = os.path.basename(staging)
    outside = os.path.join(root, f"outside{rank}")
    os.makedirs(outside)
    with open(os.path.join(outside, "keep.bin"), "wb") as f:
        f.write(b"x")
    link = os.path.join(own, hidden_name("step-5", TMP_MARK, "e5f6"))
    os.symlink(outside, link)
    with open(os.path.join(own, "notes.txt"), "w") as f:
        f.write("{}")
    try:
        mgr = distckpt.TieredCheckpointManager(durable, local=local, persist_every=0)
        left = sorted(os.listdir(own))
        mgr.save(2, {"w": torch.full((4,), float(rank))})
        mgr.wait()
        steps = mgr.own_steps()
        mgr.close()
    finally:
        live.kill()
        live.wait()
    return {"left": left, "planted": planted, "link": os.path.basename(link), "outside": os.listdir(outside),
            "steps": steps}


def test_the_start_up_sweep_removes_dead_saves_only_and_never_follows_a_link(tmp_path):
    for result in run_ranks(_plant_and_start, 2, str(tmp_path), timeout_s=120):
        live_staging = result["planted"][4]
        live_lease = hidden_name("step-4", LEASE_MARK, "a1b2")
        assert result["left"] == sorted([result["link"], "notes.txt", "step-1", live_staging, live_lease]), result
        assert result["outside"] == ["keep.bin"], result
        assert result["steps"] == [1, 2], result
