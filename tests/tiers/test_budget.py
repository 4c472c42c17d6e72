"""The local tier stays within its bound over 50 saves (steps and bytes, own and replicas), and the process's RSS
is flat: 2 ranks standing for 2 nodes (DISTCKPT_NODE_ID), one replica each."""

import os

import torch

from distckpt.testing import run_ranks


def _saves(rank, world_size, root, budget):
    import distckpt

    os.environ["DISTCKPT_NODE_ID"] = f"node{rank}"
    local = os.path.join(root, f"node{rank}")
    mgr = distckpt.TieredCheckpointManager(os.path.join(root, "durable"), local=local, keep_local=3,
                                           memory_budget_bytes=budget, persist_every=0)
    state = {"w": torch.zeros(1 << 18), "step": 0}  # 1 MiB
    sizes, rss = [], []
    for step in range(1, 51):
        state["w"].fill_(step)
        state["step"] = step
        mgr.save(step, state)
        mgr.wait()
        used = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(local) for f in files)
        sizes.append(used)
        with open("/proc/self/statm") as f:
            rss.append(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    own, held = mgr.own_steps(), mgr.replica_steps()
    mgr.close()
    return {"sizes": sizes, "rss": rss, "own": own, "held": {str(k): v for k, v in held.items()}}


def test_fifty_saves_stay_within_the_budget_with_flat_rss(tmp_path):
    budget = 5 << 20  # room for two steps of own + replica (about 2 MiB each), not three
    for rank, result in enumerate(run_ranks(_saves, 2, str(tmp_path), budget, timeout_s=300)):
        assert max(result["sizes"]) <= budget, max(result["sizes"])
        assert result["own"] == [49, 50] and result["held"] == {str(1 - rank): [49, 50]}, result
        assert result["rss"][-1] - result["rss"][9] < (16 << 20), (result["rss"][9], result["rss"][-1])
