"""Rank bodies of the crash-consistency tests."""

from __future__ import annotations

import os
import signal
import threading
import time

import torch

import distckpt
from distckpt import faults


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {f"w{i}": torch.randn(256 * (i + 1), generator=g) for i in range(5)} | {"meta": {"step": step}}


def blank() -> dict:
    return {f"w{i}": torch.zeros(256 * (i + 1)) for i in range(5)} | {"meta": {"step": -1}}


def _prepare(root: str) -> distckpt.CheckpointManager:
    mgr = distckpt.CheckpointManager(root, keep_last=2)
    if mgr.latest_step() is None:
        mgr.save(1, state(1))
    return mgr


def record_points(rank, world_size, root):
    """Run a clean save of step 2 and return the boundaries this rank passed."""
    mgr = _prepare(root)
    seen = []
    with faults.inject(faults.Fault("call", callback=lambda kind, what: seen.append((kind, os.path.basename(what))))):
        mgr.save(2, state(2))
    return seen


def killed_save(rank, world_size, root, kill_rank, kill_index):
    """Save step 2 with rank ``kill_rank`` SIGKILLed at its ``kill_index``-th boundary."""
    mgr = _prepare(root)
    fault = faults.Fault("kill", index=kill_index, rank=kill_rank)
    try:
        with faults.inject(fault):
            mgr.save(2, state(2))
    except distckpt.CheckpointError as exc:
        return {"raised": type(exc).__name__, "text": str(exc)[:500]}
    return {"raised": None}


def timed_kill_save(rank, world_size, root, kill_rank, delay_s):
    mgr = _prepare(root)
    if rank == kill_rank:
        threading.Timer(delay_s, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    try:
        mgr.save(2, state(2))
        time.sleep(delay_s + 0.5 if rank == kill_rank else 0)  # let the timer fire even after success
    except distckpt.CheckpointError as exc:
        return {"raised": type(exc).__name__, "text": str(exc)[:500]}
    return {"raised": None}


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
