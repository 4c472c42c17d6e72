"""The demo's phases; each runs on real processes joined by gloo."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import distckpt

from .model import TinyGPT, batch

LR = 3e-3


def build(world_size: int, sharded: bool):
    torch.manual_seed(0)
    model = TinyGPT()
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    return model, optim


def train_step(model, optim, step: int, rank: int, world_size: int) -> float:
    x, y = batch(step, rank, world_size)
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    optim.zero_grad()
    loss.backward()
    optim.step()
    total = loss.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(total)
        total /= world_size
    return float(total)


def checkpoint_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:06d}")


def latest_step(root: str) -> int | None:
    steps = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if name.startswith("step-") and os.path.exists(os.path.join(root, name, "metadata.json")):
            steps.append(int(name[5:]))
    return max(steps) if steps else None


def phase_train(rank, world_size, root, first_step, last_step, every, crash_after, resume):
    """Train steps first_step..last_step, checkpointing every ``every`` steps."""
    model, optim = build(world_size, sharded=True)
    log = {"losses": {}, "saves": [], "loads": []}
    if resume:
        step0 = latest_step(root)
        distckpt.init_optimizer_state(optim)
        t0 = time.perf_counter()
        state = {"model": model, "optim": optim, "progress": {"step": 0}}
        distckpt.load(state, checkpoint_id=checkpoint_dir(root, step0))
        log["loads"].append((step0, time.perf_counter() - t0))
        first_step = state["progress"]["step"] + 1
    for step in range(first_step, last_step + 1):
        log["losses"][step] = train_step(model, optim, step, rank, world_size)
        if every and step % every == 0:
            t0 = time.perf_counter()
            distckpt.save({"model": model, "optim": optim, "progress": {"step": step}}, checkpoint_id=checkpoint_dir(root, step))
            log["saves"].append((step, time.perf_counter() - t0))
        if crash_after is not None and step == crash_after:
            if rank == 0:
                _report(log)
            sys.stdout.flush()
            os._exit(17)  # simulated crash: no cleanup, in-memory state lost
    return log


def _report(log):
    # the parent reads losses of a crashed run from this file, since the process dies
    path = os.environ["DISTCKPT_DEMO_CRASHLOG"]
    import json

    with open(path, "w") as f:
        json.dump({"losses": log["losses"], "saves": log["saves"]}, f)


def phase_gather(rank, world_size, checkpoint, sharded):
    """Load ``checkpoint`` at this world size and return every tensor, gathered in full, on rank 0."""
    model, optim = build(world_size, sharded=sharded)
    distckpt.init_optimizer_state(optim)
    t0 = time.perf_counter()
    distckpt.load({"model": model, "optim": optim, "progress": {"step": 0}}, checkpoint_id=checkpoint)
    elapsed = time.perf_counter() - t0
    full = {}
    for k, v in model.state_dict().items():
        full["model." + k] = v.full_tensor() if hasattr(v, "full_tensor") else v
    for pid, st in optim.state_dict()["state"].items():
        for k, v in st.items():
            full[f"optim.{pid}.{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v
    return ({k: v.detach().clone() for k, v in full.items()}, elapsed) if rank == 0 else None
