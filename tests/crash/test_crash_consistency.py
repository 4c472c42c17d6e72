"""Kill ranks at every boundary of a save: the last good checkpoint always survives, and the
interrupted one is either committed and exact or invisible."""

import os
import random

import pytest
import torch

import distckpt
from distckpt.testing import crash_model, run_ranks

from . import workers

ENV = crash_model.ENV


def _tmp_leftovers(root, mgr):
    return [n for n in os.listdir(root) if "distckpt-tmp" in n]


def _assert_consistent(root, results, killed_rank=None):
    return crash_model.check_consistent(root, results, killed_rank, _tmp_leftovers)


def _sweep(tmp_path, world_size, ranks=None, stride=1):
    return crash_model.sweep(lambda name: str(tmp_path / name), world_size, ranks, stride, _tmp_leftovers)


@pytest.mark.slow  # guard that stays: test_random_kill_times (a rank killed at chosen times, three ranks)
def test_kill_one_rank_at_every_other_boundary_two_ranks(tmp_path):
    """Every second boundary of each rank (the first and, by the parity of the count, often the last); every
    boundary under --run-slow (the next test)."""
    points, outcomes = _sweep(tmp_path, 2, stride=2)
    assert {k for k, _ in points[0]} >= {"write", "fsync", "rename", "collective"}
    assert "invisible" in outcomes.values()
    assert len(outcomes) == sum((len(p) + 1) // 2 for p in points)


@pytest.mark.slow
def test_kill_one_rank_at_every_boundary_two_ranks(tmp_path):
    points, outcomes = _sweep(tmp_path, 2)
    assert {k for k, _ in points[0]} >= {"write", "fsync", "rename", "collective"}
    assert "invisible" in outcomes.values()
    # killing the coordinator after its final rename leaves a committed checkpoint
    assert len(outcomes) == len(points[0]) + len(points[1])


@pytest.mark.parametrize("world_size", [3])
def test_random_kill_times(tmp_path, world_size):
    rng = random.Random(1234)
    for trial in range(3):
        root = str(tmp_path / f"t{trial}")
        kill_rank, delay = rng.randrange(world_size), rng.uniform(0.0, 1.5)
        # step 1 first, so that the timer races only with the save of step 2
        run_ranks(crash_model.record_points, world_size, root, env=ENV)
        import shutil

        shutil.rmtree(os.path.join(root, "step-0000000002"))
        results = run_ranks(crash_model.timed_kill_save, world_size, root, kill_rank, delay, env=ENV, allow_failures=True, timeout_s=120)
        _assert_consistent(root, results, killed_rank=kill_rank)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [3, 4])
def test_kill_at_every_boundary_larger_groups(tmp_path, world_size):
    _sweep(tmp_path, world_size)


@pytest.mark.slow
def test_many_random_kill_times(tmp_path):
    rng = random.Random(99)
    for trial in range(20):
        world_size = rng.choice([2, 3, 4])
        root = str(tmp_path / f"t{trial}")
        run_ranks(crash_model.record_points, world_size, root, env=ENV)
        import shutil

        shutil.rmtree(os.path.join(root, "step-0000000002"))
        kill_rank, delay = rng.randrange(world_size), rng.uniform(0.0, 2.0)
        results = run_ranks(crash_model.timed_kill_save, world_size, root, kill_rank, delay, env=ENV, allow_failures=True, timeout_s=120)
        _assert_consistent(root, results, killed_rank=kill_rank)


@pytest.mark.parametrize("action", ["enospc", "eio"])
@pytest.mark.parametrize("kind", ["write", "fsync", "rename"])
def test_io_faults_surface_as_checkpoint_errors_and_keep_the_previous_checkpoint(tmp_path, action, kind):
    root = str(tmp_path / "io")
    run_ranks(crash_model.record_points, 2, root, env=ENV)  # steps 1 and 2 committed
    import shutil

    shutil.rmtree(os.path.join(root, "step-0000000002"))
    before = {n: open(os.path.join(root, "step-0000000001", n), "rb").read() for n in os.listdir(os.path.join(root, "step-0000000001"))}
    fault_rank = 0 if kind == "rename" else 1  # only the coordinator renames
    results = run_ranks(workers.io_fault_save, 2, root, fault_rank, action, kind, env=ENV)
    for res in results:
        assert res["raised"] is not None, res
        assert ("No space left" if action == "enospc" else "Input/output error") in res["text"]
    after = {n: open(os.path.join(root, "step-0000000001", n), "rb").read() for n in os.listdir(os.path.join(root, "step-0000000001"))}
    assert before == after
    _assert_consistent(root, results)


def test_concurrent_commit_exactly_one_wins(tmp_path):
    root = str(tmp_path / "race")
    gate = tmp_path / "gate"
    gate.mkdir()
    results = run_ranks(workers.concurrent_commit, 2, root, str(gate))
    assert sorted(r["won"] for r in results) == [False, True], results
    loser = next(r for r in results if not r["won"])
    assert "committed by another save" in loser["text"]
    winner = [i for i, r in enumerate(results) if r["won"]][0]
    out = crash_model.blank()
    distckpt.CheckpointManager(root).load(out, step=2)
    want = crash_model.state(10 + winner)
    assert all(torch.equal(out[k], want[k]) for k in want if k != "meta")
