"""Rank functions for the CUDA tests: ranks share the one device over a gloo group."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import distckpt

ROWS, COLS = 64, 48


def full_matrix() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * 0.5


def _sharded(world_size: int, rank: int, dim: int, fill: bool) -> DTensor:
    # choose the device before the mesh does: it would pick LOCAL_RANK's, which one GPU lacks
    torch.cuda.set_device(rank % torch.cuda.device_count())
    mesh = init_device_mesh("cuda", (world_size,))
    whole = full_matrix()
    local = whole.chunk(world_size, dim=dim)[rank].contiguous()
    local = local.cuda() if fill else torch.full_like(local, -1.0, device="cuda")
    return DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=whole.shape, stride=whole.stride())


def save_sharded(rank: int, world_size: int, path: str, use_async: bool) -> bool:
    sd = {"w": _sharded(world_size, rank, 0, True),
          "b": torch.arange(10, dtype=torch.bfloat16, device="cuda"),
          "step": 7}
    if use_async:
        handle = distckpt.async_save(sd, checkpoint_id=path)
        sd["w"].to_local().fill_(123.0)  # after staging: must not reach the checkpoint
        handle.result(timeout=120)
    else:
        distckpt.save(sd, checkpoint_id=path)
    return True


def load_resharded(rank: int, world_size: int, path: str) -> dict:
    sd = {"w": _sharded(world_size, rank, 1, False),
          "b": torch.zeros(10, dtype=torch.bfloat16, device="cuda"),
          "step": 0}
    distckpt.load(sd, checkpoint_id=path)
    local = sd["w"].to_local()
    want = full_matrix().chunk(world_size, dim=1)[rank]
    return {"device": local.device.type, "equal": torch.equal(local.cpu(), want),
            "b": torch.equal(sd["b"].cpu(), torch.arange(10, dtype=torch.bfloat16)), "step": sd["step"]}


def replicated_state(device: str) -> dict:
    """The same on every rank (what shared reads serve): a few MB of plain tensors and a value."""
    g = torch.Generator().manual_seed(3)
    sd = {f"layer{i}.w": torch.randn(512, 257, generator=g).to(device) for i in range(4)}
    sd["emb"] = torch.randint(0, 1000, (4096, 16), generator=g).to(device)
    sd["step"] = 5
    return sd


def save_replicated(rank: int, world_size: int, path: str) -> bool:
    torch.cuda.set_device(rank % torch.cuda.device_count())
    distckpt.save(replicated_state("cuda"), checkpoint_id=path)
    return True


def load_replicated_shared(rank: int, world_size: int, path: str) -> dict:
    """Each rank a node of its own, so the ranks share their reads: each stored byte is read from the files once
    in the group and sent to the others over the group's backend (NCCL: on the device)."""
    import os

    from distckpt.testing.read_counts import FileReads

    os.environ["DISTCKPT_NODE_ID"] = f"node{rank}"
    os.environ["DISTCKPT_SHARED_READS"] = "1"
    torch.cuda.set_device(rank % torch.cuda.device_count())
    want = replicated_state("cpu")
    sd = {k: torch.zeros_like(v, device="cuda") if isinstance(v, torch.Tensor) else 0 for k, v in want.items()}
    reads = FileReads()
    distckpt.load(sd, checkpoint_id=path)
    equal = all(torch.equal(sd[k].cpu(), v) if isinstance(v, torch.Tensor) else sd[k] == v for k, v in want.items())
    return {"equal": equal, "device": sd["emb"].device.type, "read": reads.total,
            "bytes": sum(v.numel() * v.element_size() for v in want.values() if isinstance(v, torch.Tensor))}
