"""The crash model, for any storage backend: ranks killed at every boundary of a save.

A save passes named boundaries (``faults.point``: writes, fsyncs, renames or
commits, collectives). The model records the boundaries of a clean save of
step 2 after a committed step 1, then, for each boundary of each rank, runs the
save again with that rank SIGKILLed there, and checks what must hold whatever
the store: step 1 loads bit-exact and verifies; step 2 is either committed and
exact, or invisible (not found); the surviving ranks raised a CheckpointError
or finished; and a manager opened afterwards leaves no uncommitted save
behind. Use it from a test of a backend whose checkpoints a
``CheckpointManager`` can hold (``root_of(name)`` gives a fresh location)::

    from distckpt.testing import crash_model

    def test_my_store_survives_kills(tmp_path):
        points, outcomes = crash_model.sweep(lambda name: f"mystore://bucket/{tmp_path.name}/{name}", 2)
        assert "invisible" in outcomes.values()

The rank bodies live in this module so that spawned ranks can import them.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable, Optional

import torch

from .. import faults
from ..errors import CheckpointError, CheckpointNotFoundError
from ..manager import CheckpointManager
from ..verification import verify
from .multiprocess import RankFailure, run_ranks

__all__ = ["ENV", "state", "blank", "record_points", "killed_save", "timed_kill_save", "check_consistent", "sweep"]

ENV = {"DISTCKPT_FSYNC": "1", "DISTCKPT_TIMEOUT_S": "30"}
SURVIVOR_ERRORS = (None, "RankFailuresError", "CheckpointError", "StorageIOError", "ProcessGroupBrokenError",
                   "StalledRanksError")


def state(step: int) -> dict:
    """The state saved as ``step``: five tensors of different sizes and a value."""
    g = torch.Generator().manual_seed(step)
    return {f"w{i}": torch.randn(256 * (i + 1), generator=g) for i in range(5)} | {"meta": {"step": step}}


def blank() -> dict:
    """A state dict to load any step of :func:`state` into."""
    return {f"w{i}": torch.zeros(256 * (i + 1)) for i in range(5)} | {"meta": {"step": -1}}


def _prepare(root: str) -> CheckpointManager:
    mgr = CheckpointManager(root, keep_last=2)
    if mgr.latest_step() is None:
        mgr.save(1, state(1))
    return mgr


def record_points(rank: int, world_size: int, root: str) -> list:
    """Rank body: commit step 1 if needed, run a clean save of step 2, return the boundaries this rank passed."""
    mgr = _prepare(root)
    seen: list = []
    with faults.inject(faults.Fault("call", callback=lambda kind, what: seen.append((kind, os.path.basename(what))))):
        mgr.save(2, state(2))
    return seen


def killed_save(rank: int, world_size: int, root: str, kill_rank: int, kill_index: int) -> dict:
    """Rank body: save step 2 with rank ``kill_rank`` SIGKILLed at its ``kill_index``-th boundary."""
    mgr = _prepare(root)
    try:
        with faults.inject(faults.Fault("kill", index=kill_index, rank=kill_rank)):
            mgr.save(2, state(2))
    except CheckpointError as exc:
        return {"raised": type(exc).__name__, "text": str(exc)[:500]}
    return {"raised": None}


def timed_kill_save(rank: int, world_size: int, root: str, kill_rank: int, delay_s: float) -> dict:
    """Rank body: save step 2 while rank ``kill_rank`` is SIGKILLed after ``delay_s`` seconds, wherever it is."""
    mgr = _prepare(root)
    if rank == kill_rank:
        threading.Timer(delay_s, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    try:
        mgr.save(2, state(2))
        time.sleep(delay_s + 0.5 if rank == kill_rank else 0)  # let the timer fire even after success
    except CheckpointError as exc:
        return {"raised": type(exc).__name__, "text": str(exc)[:500]}
    return {"raised": None}


def _exact(mgr: CheckpointManager, step: int) -> None:
    out = blank()
    assert mgr.load(out, step=step) == step
    want = state(step)
    assert all(torch.equal(out[k], want[k]) for k in want if k != "meta") and out["meta"] == want["meta"], step
    assert verify(mgr.path(step)).ok


def check_consistent(root: str, results: list, killed_rank: Optional[int] = None,
                     leftovers: Optional[Callable[[str, CheckpointManager], list]] = None) -> str:
    """Check a run after a save of step 2 that ranks died in; return "committed" or "invisible".

    ``leftovers(root, manager)`` lists what the crash left behind after a manager was opened again
    (default: the uncommitted saves the store reports for step 2); it must be empty.
    """
    for rank, res in enumerate(results):
        if rank != killed_rank and not isinstance(res, RankFailure):
            assert res["raised"] in SURVIVOR_ERRORS, res
    mgr = CheckpointManager(root, keep_last=2, cleanup=False)
    _exact(mgr, 1)
    if 2 in mgr.all_steps():
        _exact(mgr, 2)
        outcome = "committed"
    else:
        assert mgr.latest_step() == 1
        try:
            verify(mgr.path(2))
            raise AssertionError("step 2 is not listed, but verifies")
        except CheckpointNotFoundError:
            outcome = "invisible"
    restarted = CheckpointManager(root, keep_last=2)  # cleans up after the crash
    found = leftovers(root, restarted) if leftovers is not None else restarted.incomplete_saves(2)
    assert found == [], found
    return outcome


def sweep(root_of: Callable[[str], str], world_size: int, ranks: Optional[list] = None, stride: int = 1,
          leftovers: Optional[Callable[[str, CheckpointManager], list]] = None) -> tuple[list, dict]:
    """Kill each rank (of ``ranks``) at every ``stride``-th boundary of a save; check each outcome.

    Returns the boundaries each rank passes in a clean save, and the outcome per (rank, index, boundary).
    """
    points = run_ranks(record_points, world_size, root_of("record"), env=ENV)
    outcomes = {}
    for rank in ranks if ranks is not None else range(world_size):
        for index in range(0, len(points[rank]), stride):
            root = root_of(f"k{rank}-{index}")
            results = run_ranks(killed_save, world_size, root, rank, index, env=ENV, allow_failures=True, timeout_s=120)
            assert isinstance(results[rank], RankFailure) and results[rank].exitcode == -9, results[rank]
            outcomes[(rank, index, points[rank][index])] = check_consistent(root, results, rank, leftovers)
    return points, outcomes
