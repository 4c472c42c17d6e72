"""When replication lags behind training, ``save`` waits for the background instead of piling steps up in the
local tier: 2 ranks standing for 2 nodes, replication slowed by an injected delay at its boundary."""

import os

import torch

from distckpt.testing import run_ranks


def _fast_saves(rank, world_size, root, delay_s):
    import time

    import distckpt
    from distckpt import faults

    os.environ["DISTCKPT_NODE_ID"] = f"node{rank}"
    local = os.path.join(root, f"node{rank}")
    mgr = distckpt.TieredCheckpointManager(os.path.join(root, "durable"), local=local, keep_local=2, persist_every=0)
    state = {"w": torch.zeros(1 << 16)}
    own = mgr.own_dir

    def slow(kind, what):
        if "tier replication" in what:
            time.sleep(delay_s)

    peak = 0
    with faults.inject(faults.Fault("call", kinds=("collective",), callback=slow)):
        for step in range(1, 9):
            state["w"].fill_(step)
            mgr.save(step, state)  # no wait: training runs ahead of the background
            # steps and unfinished writes alike (not the small lease files of the writes, nor a deleted step whose
            # removal is still under way: renamed out of the way, it holds no step)
            peak = max(peak, sum(n.startswith(("step-", ".distckpt-tmp-")) and "-trash-" not in n for n in os.listdir(own)))
        mgr.wait()
    waited = [mgr.timings[s]["waited_s"] for s in range(1, 9)]
    steps = mgr.own_steps()
    mgr.close()
    return {"peak": peak, "waited": waited, "own": steps}


def test_a_lagging_background_makes_save_wait_instead_of_piling_up_steps(tmp_path):
    for out in run_ranks(_fast_saves, 2, str(tmp_path), 0.4, timeout_s=120):
        # at most keep_local steps kept by the bound, plus keep_local still in the background
        assert out["peak"] <= 4, out
        assert sum(w > 0.2 for w in out["waited"]) >= 4, out  # the saves after the first two waited
        assert out["own"] == [7, 8]
