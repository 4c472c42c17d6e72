"""Workers of test_stalls.py: one rank of a load stops (SIGSTOP of its own process) at one phase; the others
must raise within the bound, naming it."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import torch

import distckpt
from distckpt import faults

# phase -> (where the victim stops, which occurrence, what the others' errors must name)
PHASES = {
    "arrival": ("before load", 0, "arrival"),
    "metadata": ("read_metadata", 0, "load planning"),
    "plan vote": ("collective:load planning", 0, "load planning"),
    "shared-read planning": ("collective:load planning", 1, "load planning"),
    "shared-read exchange": ("collective:shared read", 0, "load read"),
    "reading": ("read_data", 0, "load read"),
    "end": ("collective:load read", 0, "load read"),
}


def _state(rank: int, world_size: int) -> dict:
    # "w" is the same on every rank (saved once, read by all: shared reads); "x" is each rank's own
    return {"w": torch.arange(64, dtype=torch.float32), "x": torch.full((4, 8), float(rank))}


def _stop(root: str, rank: int) -> None:
    with open(os.path.join(root, f"stopped.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGSTOP)
    os._exit(0)  # resumed by a peer once every other rank has raised: the group is broken, nothing to finish


class _StoppingReader(distckpt.FileSystemReader):
    def __init__(self, path: str, stop_in: str, root: str, rank: int):
        super().__init__(path)
        self._stop_in, self._root, self._rank = stop_in, root, rank

    def read_metadata(self, *args, **kwargs):
        if self._stop_in == "read_metadata":
            _stop(self._root, self._rank)
        return super().read_metadata(*args, **kwargs)

    def read_data(self, plan, planner):
        if self._stop_in == "read_data":
            _stop(self._root, self._rank)
        return super().read_data(plan, planner)


def stall_at(rank: int, world_size: int, root: str, phase: str, victim: int):
    """Save, then load with ``victim`` stopping at ``phase``: the others return (error type, message, seconds)."""
    path = os.path.join(root, "ckpt")
    distckpt.save(_state(rank, world_size), checkpoint_id=path)
    where, nth, _ = PHASES[phase]
    seen = [0]

    def at_collective(kind: str, what: str) -> None:
        if what.endswith(": " + where.split(":", 1)[1]) or (what == where.split(":", 1)[1]):
            seen[0] += 1
            if seen[0] == nth + 1:
                _stop(root, rank)

    target = _state(rank, world_size)
    reader = _StoppingReader(path, where if rank == victim else "", root, rank)
    fault = faults.Fault("call", kinds=("collective",), rank=victim, callback=at_collective)
    begun = time.monotonic()
    outcome = ("returned", "", time.monotonic() - begun, False)
    with faults.inject(fault) if where.startswith("collective:") else contextlib.nullcontext():
        try:
            if rank == victim and where == "before load":
                _stop(root, rank)
            distckpt.load(target, storage_reader=reader)
        except Exception as exc:  # noqa: BLE001 - what the test inspects
            outcome = (type(exc).__name__, str(exc), time.monotonic() - begun,
                       isinstance(exc, distckpt.CheckpointError))
    with open(os.path.join(root, f"done.{rank}"), "w"):
        pass
    if rank == min(r for r in range(world_size) if r != victim):
        _resume_when_all_done(root, world_size, victim)
    return outcome


def _resume_when_all_done(root: str, world_size: int, victim: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(root, f"done.{r}")) for r in range(world_size) if r != victim):
            break
        time.sleep(0.2)
    stopped = os.path.join(root, f"stopped.{victim}")
    if os.path.exists(stopped):
        os.kill(int(open(stopped).read()), signal.SIGCONT)
