"""Rank functions for test_hf_publish_hostile.py: publishes from ranks that disagree."""

from __future__ import annotations

import time

import torch

import distckpt
from distckpt import faults


def placements_disagree(rank: int, world_size: int, path: str):
    """Ranks 0 and 1 hold "w" as Shard(0), rank 2 claims a Replicate() copy of other data, under a planner that does
    not drop replicas: what each rank raised (None if the save went through)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    if rank == 2:
        w = DTensor.from_local(torch.full((4,), 9.0), mesh, [Replicate()], run_check=False, shape=(4,), stride=(1,))
    else:
        w = DTensor.from_local(torch.full((2,), float(rank + 1)), mesh, [Shard(0)], run_check=False, shape=(4,), stride=(1,))

    def late(kind: str, what: str) -> None:  # rank 2 writes last: its bytes are the ones left in the file
        if rank == 2 and kind == "write":
            time.sleep(0.5)

    start = time.monotonic()
    try:
        with faults.inject(faults.Fault("call", None, callback=late)):
            distckpt.save({"w": w}, storage_writer=distckpt.HuggingFaceWriter(path),
                          planner=distckpt.DefaultSavePlanner(dedup_replicated_tensors=False))
    except distckpt.CheckpointError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return None
