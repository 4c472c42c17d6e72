"""SIGKILL at every boundary of an incremental save and of the retention after it (which retires the step the new one
references): every step left committed loads bit-exact and verifies, a restarted manager leaves only referenced files,
and the next saves build on what survived."""

import os

import pytest
import torch

import distckpt
from distckpt.testing import run_ranks
from distckpt.testing.multiprocess import RankFailure

from . import incremental_kill_workers as workers
from .test_incremental_machine import referenced_by_committed

ENV = {"DISTCKPT_FSYNC": "1", "DISTCKPT_TIMEOUT_S": "30"}


def _exact(mgr, step):
    want = workers.state(step)
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in want.items()}
    mgr.load(out, step=step)
    assert all(torch.equal(out[k], v) if isinstance(v, torch.Tensor) else out[k] == v for k, v in want.items()), step
    assert distckpt.verify(mgr.path(step)).ok


def _unreferenced(root, mgr):
    wanted = referenced_by_committed(root, [mgr._name(s) for s in mgr.all_steps()])
    out = []
    for n in os.listdir(root):
        if not n.startswith("."):
            continue
        if "-retired-" not in n:
            out.append(n)
            continue
        base = bytes.fromhex(n.split("-retired-", 1)[1].split("-", 1)[0]).decode()
        out += [f"{n}/{f}" for f in os.listdir(os.path.join(root, n)) if (base, n.rsplit("-", 1)[1], f) not in wanted]
    return out


def _sweep(tmp_path, stride):
    points = run_ranks(workers.record_points, 1, str(tmp_path / "record"), env=ENV)[0]
    kinds = {k for k, _ in points}
    assert {"write", "fsync", "rename", "unlink"} <= kinds, kinds  # the save's and the retention's boundaries
    outcomes = {}
    for index in range(0, len(points), stride):
        root = str(tmp_path / f"k{index}")
        result = run_ranks(workers.killed_save, 1, root, index, env=ENV, allow_failures=True, timeout_s=120)[0]
        assert isinstance(result, RankFailure) and result.exitcode == -9, result
        mgr = distckpt.CheckpointManager(root, keep_last=1, incremental=True, no_dist=True, cleanup=False)
        steps = mgr.all_steps()
        assert steps and set(steps) <= {1, 2, 3} and (2 in steps or 3 in steps), steps
        for step in steps:
            _exact(mgr, step)
        restarted = distckpt.CheckpointManager(root, keep_last=1, incremental=True, no_dist=True)
        assert _unreferenced(root, restarted) == [], (index, points[index])
        restarted.save(4, workers.state(4))
        restarted.save(5, workers.state(5))
        _exact(restarted, 5)
        assert _unreferenced(root, restarted) == []
        outcomes[(index, points[index])] = "committed" if 3 in steps else "invisible"
    return points, outcomes


def test_sigkill_at_every_other_boundary_of_an_incremental_save_and_its_retention(tmp_path):
    points, outcomes = _sweep(tmp_path, 2)
    assert {"committed", "invisible"} <= set(outcomes.values()), outcomes


@pytest.mark.slow
def test_sigkill_at_every_boundary_of_an_incremental_save_and_its_retention(tmp_path):
    points, outcomes = _sweep(tmp_path, 1)
    assert len(outcomes) == len(points)
