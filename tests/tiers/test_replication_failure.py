"""A replica's sender that cannot read its step fails the replication of that step on every rank: no rank commits
a replica of it, and every rank's next call raises (2 ranks standing for 2 nodes)."""

import os

import pytest
import torch

from distckpt.testing import run_ranks


def _broken_sender(rank, world_size, root, tiers):
    import distckpt
    from distckpt import faults

    os.environ["DISTCKPT_NODE_ID"] = f"node{rank}"
    local = os.path.join(tiers, f"node{rank}")
    mgr = distckpt.TieredCheckpointManager(os.path.join(root, "durable"), local=local, persist_every=0)
    state = {"w": torch.ones(1 << 16)}
    mgr.save(1, state)
    mgr.wait()

    def truncate(kind, what):  # after the sizes were told, rank 0's copy of step 2 loses its tail
        if what == "tier replication of step 2" and rank == 0:
            own = os.path.join(mgr.own_dir, "step-2")
            data = [f for f in os.listdir(own) if f.endswith(".safetensors")][0]
            os.truncate(os.path.join(own, data), os.path.getsize(os.path.join(own, data)) // 2)

    error = None
    with faults.inject(faults.Fault("call", kinds=("collective",), callback=truncate)):
        mgr.save(2, state)
        try:
            mgr.wait()
        except distckpt.CheckpointError as exc:
            error = str(exc)
    held = {str(o): ss for o, ss in mgr.replica_steps().items()}
    mgr.close()
    return {"error": error, "held": held}


@pytest.mark.parametrize("tier", ["folder", "huge-page tmpfs"])
def test_a_failed_sender_fails_the_replication_everywhere(tmp_path, request, tier):
    # on a tmpfs of huge pages the sender maps its files instead of reading them through buffers
    tiers = request.getfixturevalue("huge_tmpfs") if tier != "folder" else str(tmp_path)
    for rank, out in enumerate(run_ranks(_broken_sender, 2, str(tmp_path), tiers, timeout_s=120)):
        assert out["error"] and "replicating step 2 failed" in out["error"] and "rank 0" in out["error"], out
        assert out["held"] == {str(1 - rank): [1]}, out  # step 1's replica stays; no replica of step 2 anywhere
