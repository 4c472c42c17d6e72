"""A job restarted at another world size finds no step of its layout in memory and restores from the durable
tier, resharded, saying so: saved by 2 ranks (standing for 2 nodes), restored by 3."""

import os

import torch

from distckpt.testing import run_ranks


def _job(rank, world_size, root, save):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import distckpt

    os.environ["DISTCKPT_NODE_ID"] = f"node{rank}"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mgr = distckpt.TieredCheckpointManager(os.path.join(root, "durable"), local=os.path.join(root, f"node{rank}"),
                                           replicas=1 if world_size > 1 else 0, persist_every=1)
    state = {"model": model, "optim": optim, "progress": {"step": 0}}
    report = None
    if save:
        for step in (1, 2):
            model(torch.randn(4, 12, generator=torch.Generator().manual_seed(step))).square().mean().backward()
            optim.step()
            optim.zero_grad()
            state["progress"]["step"] = step
            mgr.save(step, state)
        mgr.wait()
    else:
        distckpt.init_optimizer_state(optim)
        r = mgr.restore(state)
        report = (r.step, r.tier, state["progress"]["step"])
    full = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    mgr.close()
    return full, report


def test_restore_at_another_world_size_comes_from_the_durable_tier(tmp_path):
    saved = run_ranks(_job, 2, str(tmp_path), True, timeout_s=180)
    restored = run_ranks(_job, 3, str(tmp_path), False, timeout_s=180)
    for full, report in restored:
        assert report == (2, "durable", 2)
        assert all(torch.equal(full[k], saved[0][0][k]) for k in full)
