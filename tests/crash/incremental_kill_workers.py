"""Rank bodies of test_incremental_kills.py: an incremental run whose third save, and the retention after it, is
SIGKILLed at one boundary."""

import os

import torch

import distckpt
from distckpt import faults


def state(step: int) -> dict:
    """Tensor i changes every i+1 steps: step 3 references chunks of step 1 (t2: unchanged since 0) and of step 2
    (t1: unchanged since 2), and writes the rest."""
    return {f"t{i}": torch.arange(1000, dtype=torch.float32) + float(step // (i + 1)) for i in range(4)} | {"step": step}


def _manager(root: str) -> distckpt.CheckpointManager:
    return distckpt.CheckpointManager(root, keep_last=1, incremental=True, no_dist=True)


def record_points(rank: int, world_size: int, root: str) -> list:
    mgr = _manager(root)
    mgr.save(1, state(1))
    mgr.save(2, state(2))
    seen: list = []
    with faults.inject(faults.Fault("call", callback=lambda kind, what: seen.append((kind, os.path.basename(what))))):
        mgr.save(3, state(3))
    return seen


def killed_save(rank: int, world_size: int, root: str, kill_index: int) -> dict:
    mgr = _manager(root)
    mgr.save(1, state(1))
    mgr.save(2, state(2))
    with faults.inject(faults.Fault("kill", index=kill_index)):
        mgr.save(3, state(3))
    return {"raised": None}
