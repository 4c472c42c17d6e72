"""Processes that share one run root: a trainer paused mid-save, trainers saving in a loop, cleaners
and evaluators. Each runs in a process of its own (spawned), as they would in a cluster."""

from __future__ import annotations

import os
import time
import traceback

import torch

import distckpt
from distckpt import faults


def state(step: int) -> dict:
    return {"w": torch.full((4096,), float(step)), "b": torch.arange(64) + step, "step": step}


def blank() -> dict:
    return {"w": torch.zeros(4096), "b": torch.zeros(64, dtype=torch.int64), "step": -1}


def paused_save(root: str, marker: str, resume: str, result: str) -> None:
    """Commit step 1, then save step 2 and stop at its first data write until ``resume`` exists."""
    try:
        mgr = distckpt.CheckpointManager(root, keep_last=1)
        mgr.save(1, state(1))
        paused = []

        def pause(kind: str, what: str) -> None:
            if not paused and "data-" in what:
                paused.append(what)
                open(marker, "w").close()
                deadline = time.monotonic() + 60
                while not os.path.exists(resume) and time.monotonic() < deadline:
                    time.sleep(0.02)

        with faults.inject(faults.Fault("call", kinds=("write",), callback=pause)):
            mgr.save(2, state(2))
        outcome = "ok"
    except BaseException:  # noqa: BLE001 - the parent reads what happened
        outcome = traceback.format_exc()
    with open(result, "w") as f:
        f.write(outcome)


def save_loop(root: str, first: int, stride: int, until: float, result: str) -> None:
    """Save steps first, first + stride, ... with keep_last=1 until the clock passes ``until`` (at least once: a
    process that started late on a loaded machine still takes part)."""
    problems, saved, attempts = [], 0, 0
    step = first
    while attempts == 0 or time.time() < until:
        attempts += 1
        try:
            mgr = distckpt.CheckpointManager(root, keep_last=1)
            mgr.save(step, state(step))
            saved += 1
        except BaseException:  # noqa: BLE001
            problems.append(traceback.format_exc())
        step += stride
    with open(result, "w") as f:
        f.write(f"saved {saved}\n" + "\n".join(problems))


def open_managers(root: str, until: float, result: str) -> None:
    """Open managers on the root (each cleans up at start) and load the newest step, until ``until`` (at least once)."""
    problems, opened, attempts = [], 0, 0
    while attempts == 0 or time.time() < until:
        attempts += 1
        try:
            mgr = distckpt.CheckpointManager(root)
            opened += 1
            step = mgr.latest_step()
            if step is not None:
                out = blank()
                try:
                    got = mgr.load(out, step=step)
                except distckpt.CheckpointError:
                    if step not in mgr.all_steps():
                        continue  # retention deleted it while we read it: a clear error, as it should be
                    raise
                want = state(got)
                if not (torch.equal(out["w"], want["w"]) and torch.equal(out["b"], want["b"]) and out["step"] == got):
                    problems.append(f"step {got} loaded other bytes than were saved")
        except BaseException:  # noqa: BLE001
            problems.append(traceback.format_exc())
    with open(result, "w") as f:
        f.write(f"opened {opened}\n" + "\n".join(problems))
