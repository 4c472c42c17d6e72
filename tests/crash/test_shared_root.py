"""Several processes on one run root: a save in flight survives managers opened beside it, commits
check their files, retention races are harmless, and no committed step is ever lost or unloadable."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

import distckpt
from distckpt.backends.filesystem import FsStore

from ..leftovers import leave_crashed_save
from . import shared_root_workers as workers


def _spawn(fn, *args):
    proc = mp.get_context("spawn").Process(target=fn, args=args, daemon=True)
    proc.start()
    return proc


def _wait_for(path: str, proc, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        assert proc.is_alive() and time.monotonic() < deadline, "the trainer did not reach its save"
        time.sleep(0.02)


def _all_steps_load(root: str) -> list[int]:
    mgr = distckpt.CheckpointManager(root, read_only=True)
    steps = mgr.all_steps()
    for step in steps:
        out = workers.blank()
        assert mgr.load(out, step=step) == step and out["step"] == step
        assert distckpt.verify(mgr.path(step)).ok
    return steps


def manager_opened_during_a_save(root: str, tmp_path) -> None:
    marker, resume, result = (str(tmp_path / n) for n in ("paused", "resume", "result"))
    trainer = _spawn(workers.paused_save, root, marker, resume, result)
    try:
        _wait_for(marker, trainer)
        other = distckpt.CheckpointManager(root, keep_last=1)  # an evaluation job, with the default cleanup
        assert other.all_steps() == [1]
        assert other.remove_stale_temporaries() == []  # the save in flight is alive: nothing of it is removed
    finally:
        open(resume, "w").close()
        trainer.join(60)
    with open(result) as f:
        assert f.read() == "ok"
    assert _all_steps_load(root) == [2]


def test_a_manager_opened_during_a_save_leaves_the_save_alone(tmp_path):
    manager_opened_during_a_save(str(tmp_path / "run"), tmp_path)


def test_leftovers_of_a_dead_save_are_removed_and_a_live_one_is_not(tmp_path):
    root = str(tmp_path / "run")
    mgr = distckpt.CheckpointManager(root)
    mgr.save(1, workers.state(1))
    dead = leave_crashed_save(FsStore(os.path.join(root, "step-0000000002")), "deadbeef")
    live_store = FsStore(os.path.join(root, "step-0000000003"))
    from distckpt.backends.leases import Lease

    lease = Lease(live_store, "cafe")  # held by this process, which runs
    live = live_store.staging("cafe")
    live.prepare()
    try:
        removed = distckpt.CheckpointManager(root, cleanup=False).remove_stale_temporaries()
        assert removed == [dead.root] and os.path.isdir(live.root)
    finally:
        live_store.discard(live)  # what the save does when it fails, before it gives its lease back
        lease.release()
    # a staging directory with no lease is removed only once nothing in it changed for the stale period
    orphan = FsStore(os.path.join(root, "step-0000000004")).staging("0rphan")
    orphan.prepare()
    assert distckpt.CheckpointManager(root, cleanup=False).remove_stale_temporaries() == []
    assert os.path.isdir(orphan.root)
    old = time.time() - 3600
    os.utime(orphan.root, (old, old))
    assert distckpt.CheckpointManager(root, cleanup=False).remove_stale_temporaries() == [orphan.root]


def test_a_commit_whose_data_files_vanished_commits_nothing(tmp_path, monkeypatch):
    path = str(tmp_path / "ck")
    original = FsStore.sizes

    def files_removed_meanwhile(self):
        for name in os.listdir(self.root):
            if name.startswith("data-"):
                os.unlink(os.path.join(self.root, name))  # what a careless cleaner did
        return original(self)

    monkeypatch.setattr(FsStore, "sizes", files_removed_meanwhile)
    with pytest.raises(distckpt.CorruptCheckpointError, match="missing just before commit"):
        distckpt.save(workers.state(1), checkpoint_id=path)
    monkeypatch.undo()
    assert not os.path.exists(path)
    with pytest.raises(distckpt.CheckpointNotFoundError):
        distckpt.read_metadata(path)


def side_by_side(tmp_path, seconds: float, evaluators: int) -> list[int]:
    """Two trainers saving alternate steps (keep_last=1) and ``evaluators`` processes opening managers
    (each cleaning up at start) and loading, for ``seconds``; every process must finish without a
    problem, and every step left must load. Returns those steps."""
    root = str(tmp_path / "run")
    until = time.time() + seconds
    results = [str(tmp_path / f"r{i}") for i in range(2 + evaluators)]
    procs = [_spawn(workers.save_loop, root, 1, 2, until, results[0]), _spawn(workers.save_loop, root, 2, 2, until, results[1])]
    procs += [_spawn(workers.open_managers, root, until, r) for r in results[2:]]
    for p in procs:
        p.join(seconds + 220)
        assert p.exitcode == 0
    for r in results:
        with open(r) as f:
            head, _, problems = f.read().partition("\n")
        assert int(head.split()[1]) > 0 and not problems.strip(), problems
    return _all_steps_load(root)


def test_two_trainers_saving_alternate_steps_never_fail_a_committed_save(tmp_path):
    assert side_by_side(tmp_path, 8, 1)  # keep_last=1 on both, racing: the newest survives, and all listed load


@pytest.mark.slow
def test_soak_trainers_cleaners_and_evaluators_on_one_root(tmp_path):
    """A few minutes of two trainers and two processes opening managers (each cleaning up) and loading."""
    assert side_by_side(tmp_path, 180, 2)


def test_no_step_pattern_matches_a_save_in_progress_and_older_leftovers_are_still_cleaned(tmp_path):
    import re

    root = str(tmp_path / "run")
    mgr = distckpt.CheckpointManager(root)
    mgr.save(2, workers.state(2))
    crashed = leave_crashed_save(FsStore(os.path.join(root, "step-6")), "deadbeef")  # torchtitan's spelling
    hidden = [n for n in os.listdir(root) if n.startswith(".")]
    assert len(hidden) == 2 and crashed.root in [os.path.join(root, n) for n in hidden]  # its staging area and lease
    assert not [n for n in hidden if re.search(r"step-(\d+)", n)]  # torchtitan's pattern for its steps
    older = os.path.join(root, ".step-0000000004.distckpt-tmp-0123abcd")  # the name earlier versions used
    os.mkdir(older)
    aged = time.time() - 3600
    os.utime(older, (aged, aged))
    removed = distckpt.CheckpointManager(root, cleanup=False).remove_stale_temporaries()
    assert sorted(removed) == sorted([crashed.root, older]) and mgr.all_steps() == [2]
    assert not [n for n in os.listdir(root) if n.startswith(".")]  # the dead save's lease went with it


def test_a_run_of_plainly_named_steps_is_listed_loaded_kept_and_cleaned_by_its_real_names(tmp_path):
    from click.testing import CliRunner

    from distckpt.cli import main as cli

    root = tmp_path / "titan"
    for step in (2, 4):  # as torchtitan names its folders
        distckpt.save(workers.state(step), checkpoint_id=str(root / f"step-{step}"))
    mgr = distckpt.CheckpointManager(str(root), keep_last=2)
    assert mgr.step_names == "plain" and mgr.all_steps() == [2, 4] and mgr.path(4) == str(root / "step-4")
    out = workers.state(0)
    assert mgr.load(out) == 4 and out["step"] == 4
    mgr.save(6, workers.state(6))
    assert sorted(os.listdir(root)) == ["step-4", "step-6"]  # retention by the real names
    res = CliRunner().invoke(cli, ["steps", str(root), "--json", "--clean"])
    assert res.exit_code == 0 and [s["step"] for s in __import__("json").loads(res.output)["steps"]] == [4, 6]
    assert distckpt.CheckpointManager(str(root), step_names="padded").all_steps() == []  # never another spelling's
