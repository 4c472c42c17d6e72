"""Kill ranks at every boundary of a save: the last good checkpoint always survives, and the
interrupted one is either committed and exact or invisible."""

import os
import random

import pytest
import torch

import distckpt
from distckpt.testing import RankFailure, run_ranks

from . import workers

ENV = {"DISTCKPT_FSYNC": "1", "DISTCKPT_TIMEOUT_S": "30"}


def _assert_consistent(root, results, killed_rank=None):
    mgr = distckpt.CheckpointManager(root, keep_last=2, cleanup=False)
    for rank, res in enumerate(results):
        if rank == killed_rank or isinstance(res, RankFailure):
            continue
        # a survivor either saw the save through, or raised a CheckpointError
        assert res["raised"] in (None, "RankFailuresError", "CheckpointError", "StorageIOError"), res
    out = workers.blank()
    assert mgr.load(out, step=1) == 1
    want = workers.state(1)
    assert all(torch.equal(out[k], want[k]) for k in want if k != "meta") and out["meta"] == want["meta"]
    distckpt.verify(mgr.path(1))
    if 2 in mgr.all_steps():
        out = workers.blank()
        mgr.load(out, step=2)
        want = workers.state(2)
        assert all(torch.equal(out[k], want[k]) for k in want if k != "meta")
        distckpt.verify(mgr.path(2))
        return "committed"
    assert mgr.latest_step() == 1
    with pytest.raises(distckpt.CheckpointNotFoundError):
        distckpt.verify(mgr.path(2))
    # a restarted manager removes what the crash left behind
    distckpt.CheckpointManager(root, keep_last=2)
    assert not [n for n in os.listdir(root) if "distckpt-tmp" in n]
    return "invisible"


def _points(tmp_path, world_size):
    root = str(tmp_path / "record")
    return run_ranks(workers.record_points, world_size, root, env=ENV)


def _sweep(tmp_path, world_size, ranks=None, stride=1):
    points = _points(tmp_path, world_size)
    outcomes = {}
    for rank in ranks if ranks is not None else range(world_size):
        kinds = {k for k, _ in points[rank]}
        assert {"write", "collective"} <= kinds
        for index in range(0, len(points[rank]), stride):
            root = str(tmp_path / f"k{rank}-{index}")
            results = run_ranks(workers.killed_save, world_size, root, rank, index, env=ENV, allow_failures=True, timeout_s=120)
            assert isinstance(results[rank], RankFailure) and results[rank].exitcode == -9, results[rank]
            outcomes[(rank, index, points[rank][index])] = _assert_consistent(root, results, killed_rank=rank)
    return points, outcomes


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
        run_ranks(workers.record_points, world_size, root, env=ENV)
        import shutil

        shutil.rmtree(os.path.join(root, "step-0000000002"))
        results = run_ranks(workers.timed_kill_save, world_size, root, kill_rank, delay, env=ENV, allow_failures=True, timeout_s=120)
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
        run_ranks(workers.record_points, world_size, root, env=ENV)
        import shutil

        shutil.rmtree(os.path.join(root, "step-0000000002"))
        kill_rank, delay = rng.randrange(world_size), rng.uniform(0.0, 2.0)
        results = run_ranks(workers.timed_kill_save, world_size, root, kill_rank, delay, env=ENV, allow_failures=True, timeout_s=120)
        _assert_consistent(root, results, killed_rank=kill_rank)


@pytest.mark.parametrize("action", ["enospc", "eio"])
@pytest.mark.parametrize("kind", ["write", "fsync", "rename"])
def test_io_faults_surface_as_checkpoint_errors_and_keep_the_previous_checkpoint(tmp_path, action, kind):
    root = str(tmp_path / "io")
    run_ranks(workers.record_points, 2, root, env=ENV)  # steps 1 and 2 committed
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
    out = workers.blank()
    distckpt.CheckpointManager(root).load(out, step=2)
    want = workers.state(10 + winner)
    assert all(torch.equal(out[k], want[k]) for k in want if k != "meta")
