"""Rank bodies of test_incremental.py: a run of incremental saves of DTensor shards, and loads of its steps."""

import os

import torch

import distckpt


def sharded_state(step: int, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = full_state(step)
    return {"frozen": distribute_tensor(full["frozen"], mesh, [Shard(0)]),
            "embed": distribute_tensor(full["embed"], mesh, [Shard(1)]),
            "head": distribute_tensor(full["head"], mesh, [Shard(0)]),
            "norm": distribute_tensor(full["norm"], mesh, [Replicate()]),
            "step": step}


def full_state(step: int) -> dict:
    g = torch.Generator().manual_seed(7)
    return {"frozen": torch.randn(256, 512, generator=g), "embed": torch.randn(128, 256, generator=g),
            "head": torch.full((16, 8), float(step)), "norm": torch.full((8,), float(step // 2)), "step": step}


def save_run(rank, world_size, root, steps, keep_last):
    mgr = distckpt.CheckpointManager(root, keep_last=keep_last, incremental=True)
    written = []
    for step in range(1, steps + 1):
        mgr.save(step, sharded_state(step, world_size))
        written.append(sum(e.stat().st_size for e in os.scandir(mgr.path(step)) if e.name.endswith(".safetensors")))
    return {"steps": mgr.all_steps(), "written": written}


def load_step(rank, world_size, path, step):
    """Load ``path`` resharded to this world size; whether every shard equals step ``step``'s."""
    want = sharded_state(step, world_size)
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in want.items()}
    distckpt.load(out, checkpoint_id=path)
    return all(torch.equal(out[k].to_local(), v.to_local()) if isinstance(v, torch.Tensor) else out[k] == v
               for k, v in want.items())


def compact_on_every_rank(rank, world_size, root, break_it):
    """Two incremental steps, then ``compact(2)`` on every rank; with ``break_it`` the coordinator's copy fails (the
    file step 2 references is gone). Returns what each rank's call returned or raised."""
    import time

    mgr = distckpt.CheckpointManager(root, incremental=True)
    mgr.save(1, sharded_state(1, world_size))
    mgr.save(2, sharded_state(2, world_size))
    if break_it and rank == 0:
        os.remove(os.path.join(mgr.path(1), "data-00001.safetensors"))
    begun = time.monotonic()
    try:
        report = mgr.compact(2)
        outcome = {"files": report.files, "bytes": report.bytes_copied}
    except distckpt.CheckpointError as exc:
        outcome = {"error": type(exc).__name__, "message": str(exc)}
    outcome["seconds"] = time.monotonic() - begun
    outcome["self_contained"] = not any(info.save_id for info in distckpt.read_metadata(mgr.path(2)).storage_data.files.values())
    return outcome
