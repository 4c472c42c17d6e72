"""Rank functions that write checkpoints with torch.distributed.checkpoint itself (the peer), for the tests of
distckpt loading them. Only tests import DCP."""

from __future__ import annotations

import warnings

import torch

import distckpt

FULL = torch.arange(12 * 6, dtype=torch.float32).reshape(12, 6)


class Opaque:
    """A value DCP pickles whole: loading it needs allow_pickle."""

    def __init__(self, n):
        self.n = n


def dcp_save(rank, world_size, path, opaque=False, zstd=False):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    sd = {"model": {"w": distribute_tensor(FULL.clone(), mesh, [Shard(0)]), "b": torch.arange(5.0)},
          "step": 11, "meta": {"name": "run", "lrs": [0.1, 0.2]}}
    if opaque:
        sd["obj"] = Opaque(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        writer = dcp.FileSystemWriter(path, _extensions=[ZStandard()]) if zstd else None
        dcp.save(sd, checkpoint_id=path, storage_writer=writer)
    return True


def distckpt_load(rank, world_size, path):
    """Load the DCP checkpoint with distckpt into a DTensor sharded by columns at this world size."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    w = distribute_tensor(torch.zeros(12, 6), mesh, [Shard(1)])
    sd = {"model": {"w": w, "b": torch.zeros(5)}, "step": 0, "meta": {"name": "", "lrs": []}}
    distckpt.load(sd, checkpoint_id=path)
    return (torch.equal(w.full_tensor(), FULL) and torch.equal(sd["model"]["b"], torch.arange(5.0))
            and sd["step"] == 11 and sd["meta"] == {"name": "run", "lrs": [0.1, 0.2]})
