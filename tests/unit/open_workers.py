"""Rank functions of the tests of distckpt.open and distckpt diff: a checkpoint saved by 2 ranks, its tensors
sharded by rows and by columns, and the same logical state for a save at 1 process."""

from __future__ import annotations

import torch

import distckpt

_G = torch.Generator().manual_seed(48)
ROWS = torch.randn(30, 8, generator=_G)  # sharded by rows: chunks [0:15) and [15:30)
COLS = torch.randn(12, 10, generator=_G).to(torch.bfloat16)  # sharded by columns: chunks [:, 0:5) and [:, 5:10)
BIAS = torch.arange(7, dtype=torch.int64)  # a replica: one chunk


_SAVED: dict = {}


def sharded_checkpoint(tmp_path_factory) -> str:
    """A checkpoint :func:`save_sharded` wrote at 2 ranks, saved once per test process (rank starts are slow)."""
    from distckpt.testing import run_ranks

    if "path" not in _SAVED:
        path = str(tmp_path_factory.mktemp("sharded") / "two")
        _SAVED["inside"] = run_ranks(save_sharded, 2, path)[0]
        _SAVED["path"] = path
    return _SAVED["path"]


def read_inside() -> dict:
    """What rank 0 read when it opened the checkpoint alone inside the process group."""
    return _SAVED["inside"]


def full_state() -> dict:
    """The logical state both saves hold, as one process saves it."""
    return {"model": {"rows": ROWS.clone(), "cols": COLS.clone(), "bias": BIAS.clone()}, "step": 3}


def save_sharded(rank: int, world_size: int, path: str) -> dict:
    """Save the state sharded over the ranks; then rank 0 alone opens it inside the process group (a collective
    there would wait for rank 1, which never comes) and reads slices across the chunk boundaries."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    sd = {"model": {"rows": distribute_tensor(ROWS.clone(), mesh, [Shard(0)]),
                    "cols": distribute_tensor(COLS.clone(), mesh, [Shard(1)]), "bias": BIAS.clone()}, "step": 3}
    distckpt.save(sd, checkpoint_id=path)
    if rank != 0:
        return {}
    with distckpt.open(path) as ckpt:
        return {"rows": ckpt["model.rows"][10:20].clone(), "cols": ckpt["model.cols"][2:5, 3:8].clone(),
                "step": ckpt["step"], "chunks": ckpt["model.cols"].chunks}
