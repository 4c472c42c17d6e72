"""Rank bodies of the crash-consistency tests."""

from __future__ import annotations

import os
import time

import distckpt
from distckpt import faults
from distckpt.testing.crash_model import state


def _prepare(root: str) -> distckpt.CheckpointManager:
    mgr = distckpt.CheckpointManager(root, keep_last=2)
    if mgr.latest_step() is None:
        mgr.save(1, state(1))
    return mgr


def io_fault_save(rank, world_size, root, fault_rank, action, kind):
    mgr = _prepare(root)
    fault = faults.Fault(action, kinds=(kind,), rank=fault_rank)
    try:
        with faults.inject(fault):
            mgr.save(2, state(2))
    except distckpt.CheckpointError as exc:
        return {"raised": type(exc).__name__, "text": str(exc)[:800]}
    return {"raised": None}


def concurrent_commit(rank, world_size, root, gate_dir):
    """Two independent single-process saves of the same checkpoint, released together at commit."""
    import torch.distributed as dist

    dist.destroy_process_group()  # two separate jobs, not one group

    def gate(kind, what):
        if kind == "rename" and what.endswith("step-0000000002"):
            open(os.path.join(gate_dir, f"ready{rank}"), "w").close()
            deadline = time.monotonic() + 30
            while len(os.listdir(gate_dir)) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)

    mgr = distckpt.CheckpointManager(root, cleanup=False)
    try:
        with faults.inject(faults.Fault("call", callback=gate)):
            mgr.save(2, state(10 + rank))
    except distckpt.CheckpointError as exc:
        return {"won": False, "text": str(exc)}
    return {"won": True}
