"""Incremental runs (issue 49) on hostile ground: compaction cut short, other managers on the same root, and
retention racing what other processes commit. Each test failed on the code before its fix."""

import os
import subprocess
import sys

import pytest
import torch

import distckpt
from distckpt import CheckpointManager

from ..storage.s3_server import new_bucket, s3_server


def _state(step):
    return {"frozen": torch.arange(4096, dtype=torch.float32), "head": torch.full((64,), float(step)), "step": step}


def _blank():
    return {"frozen": torch.zeros(4096), "head": torch.zeros(64), "step": -1}


def _loads(mgr, step):
    out = _blank()
    mgr.load(out, step=step)
    want = _state(step)
    assert torch.equal(out["frozen"], want["frozen"]) and torch.equal(out["head"], want["head"]) and out["step"] == step
    assert distckpt.verify(mgr.path(step)).ok


_COMPACT = "import sys, distckpt.compaction as c; c.compact(sys.argv[1])"


def test_a_compaction_killed_part_way_can_be_run_again(tmp_path):
    """SIGKILL while compaction copies a referenced file in leaves a partial file of that name in the committed step:
    compacting again must not fail on it forever (the file was created exclusively under a fixed name)."""
    root = str(tmp_path / "run")
    mgr = CheckpointManager(root, incremental=True, no_dist=True)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    env = {**os.environ, "DISTCKPT_FAULT": "kill:1"}  # boundary 0 is the copy's first write, 1 its second
    killed = subprocess.run([sys.executable, "-c", _COMPACT, mgr.path(2)], env=env, capture_output=True)
    assert killed.returncode == -9, killed.stderr
    _loads(mgr, 2)  # the cut-short compaction changed nothing the step reads
    report = mgr.compact(2)
    assert report.files == 1
    mgr.delete(1)
    _loads(mgr, 2)
    assert not [n for n in os.listdir(root) if n.startswith(".")]  # step 2 references nothing: nothing kept for it


def test_cleanup_by_a_manager_spelling_steps_the_other_way_keeps_what_the_run_references(tmp_path):
    """A manager whose steps are spelled ``step-0000000002`` must not prune the retired files that the ``step-2`` steps
    of the same root reference: those are not its steps, and "the others are never counted or deleted"."""
    root = str(tmp_path / "run")
    trainer = CheckpointManager(root, keep_last=1, incremental=True, no_dist=True, step_names="plain")
    trainer.save(1, _state(1))
    trainer.save(2, _state(2))  # step 1 retired: step 2 references its frozen chunk
    other = CheckpointManager(root, keep_last=1, incremental=True, no_dist=True, step_names="padded")  # cleans up
    other.save(7, _state(7))
    other.save(8, _state(8))  # retention and its sweep
    assert trainer.all_steps() == [2] and other.all_steps() == [8]
    _loads(trainer, 2)
    _loads(other, 8)


def _moving(step):
    """``a`` never changes, ``b`` changes once (step 1 to 2): step 3 references a file of step 1 and one of step 2."""
    return {"a": torch.arange(4096, dtype=torch.float32), "b": torch.full((512,), float(min(step, 2))),
            "head": torch.full((64,), float(step))}


def test_cleanup_racing_a_commit_and_its_retention_keeps_what_the_new_step_references(tmp_path):
    """An evaluation job's cleanup (``distckpt steps --clean``, or a manager opened without read_only) reads the kept
    steps' tables, then prunes the retired directories it lists. If the trainer commits step 3 and retires step 2 in
    between, step 2's retired directory was not there for the mark but is there for the sweep, and the file step 3
    references in it was deleted. The interleaving is scheduled by running the trainer's save right after the
    evaluator's mark (the only way to stop a process between two reads)."""
    root = str(tmp_path / "run")
    trainer = CheckpointManager(root, keep_last=1, incremental=True, no_dist=True)
    trainer.save(1, _moving(1))
    trainer.save(2, _moving(2))  # step 1 retired, its file kept for "a"
    evaluator = CheckpointManager(root, no_dist=True, cleanup=False)
    mark = evaluator._files.kept_files

    def mark_then_trainer_saves(names):
        kept = mark(names)
        if not trainer.all_steps() == [3]:
            trainer.save(3, _moving(3))  # references step 2's file for "b"; retention retires step 2
        return kept

    evaluator._files.kept_files = mark_then_trainer_saves
    evaluator.remove_stale_temporaries()
    assert trainer.all_steps() == [3]
    out = {k: torch.zeros_like(v) for k, v in _moving(3).items()}
    trainer.load(out, step=3)
    assert all(torch.equal(out[k], v) for k, v in _moving(3).items())
    assert distckpt.verify(trainer.path(3)).ok


_OVERWRITE_KILLED = """
import os, signal, sys, torch, distckpt
from distckpt import faults
root, path = sys.argv[1], sys.argv[2]
def after_swap(kind, what):  # the parent's fsync that follows the exchange of the new checkpoint with the old
    if kind == "fsync" and what == root:
        os.kill(os.getpid(), signal.SIGKILL)
with faults.inject(faults.Fault("call", callback=after_swap)):
    distckpt.save({"x": torch.ones(3)}, checkpoint_id=path, overwrite=True, no_dist=True)
"""


def test_an_overwrite_killed_between_its_swap_and_its_retire_keeps_what_later_steps_reference(tmp_path):
    """Overwriting step 1, which step 2 references, swaps the new checkpoint in and then retires the old one. Killed in
    between, the old checkpoint sits in the dead save's staging directory, and cleanup deleted it whole."""
    root = str(tmp_path / "run")
    mgr = CheckpointManager(root, incremental=True, no_dist=True)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    env = {**os.environ, "DISTCKPT_FSYNC": "1"}
    killed = subprocess.run([sys.executable, "-c", _OVERWRITE_KILLED, root, mgr.path(1)], env=env, capture_output=True)
    assert killed.returncode == -9, killed.stderr
    assert distckpt.read_metadata(mgr.path(1)).state_dict_metadata.keys() == {"x"}  # the overwrite committed
    restarted = CheckpointManager(root, incremental=True, no_dist=True)  # cleans up: the killed save is dead
    _loads(restarted, 2)
    assert not [n for n in os.listdir(root) if n.startswith(".distckpt-tmp-")]


def test_an_overwrite_failing_after_its_swap_keeps_what_later_steps_reference(tmp_path, monkeypatch):
    """An I/O error after the exchange (the parent's fsync) fails the save, whose discard then removed its staging
    directory: by then that held the checkpoint it replaced, which step 2 references."""
    from distckpt import faults

    root = str(tmp_path / "run")
    mgr = CheckpointManager(root, incremental=True, no_dist=True)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    monkeypatch.setenv("DISTCKPT_FSYNC", "1")

    def after_swap(kind, what):
        if kind == "fsync" and what == root:
            raise OSError(5, "Input/output error (injected)")

    try:
        with faults.inject(faults.Fault("call", callback=after_swap)):
            distckpt.save({"x": torch.ones(3)}, checkpoint_id=mgr.path(1), overwrite=True, no_dist=True)
    except distckpt.CheckpointError:
        pass
    _loads(mgr, 2)


@pytest.fixture(scope="module")
def s3_bucket():
    import boto3

    with s3_server() as url:
        yield new_bucket(boto3.client("s3", endpoint_url=url, region_name="us-east-1"))


_S3_OVERWRITE_KILLED = """
import os, signal, sys, torch, distckpt
from distckpt import faults
def after_put(kind, what):  # the staging metadata's deletion, after the PUT that commits the new save
    if kind == "unlink" and "/saves/" in what and what.endswith("/metadata.json"):
        os.kill(os.getpid(), signal.SIGKILL)
with faults.inject(faults.Fault("call", callback=after_put)):
    distckpt.save({"x": torch.ones(3)}, checkpoint_id=sys.argv[1], overwrite=True)
"""


@pytest.mark.slow  # guards that stay: the disk twin below it, and storage/test_s3.py's manager machine (kills on S3)
def test_an_s3_overwrite_killed_after_its_commit_keeps_what_later_steps_reference(s3_bucket, monkeypatch):
    """On S3 an overwrite PUTs the new metadata and only then marks the replaced save retired. Killed in between, the
    replaced save's objects were an uncommitted save's without a lease: cleanup deleted them once they were older
    than DISTCKPT_LEASE_STALE_S, which a step saved earlier in a run always is."""
    import time

    root = f"s3://{s3_bucket}/over-killed"
    mgr = CheckpointManager(root, incremental=True)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    killed = subprocess.run([sys.executable, "-c", _S3_OVERWRITE_KILLED, mgr.path(1)], capture_output=True)
    assert killed.returncode == -9, killed.stderr
    assert distckpt.read_metadata(mgr.path(1)).state_dict_metadata.keys() == {"x"}  # the overwrite committed
    monkeypatch.setenv("DISTCKPT_LEASE_STALE_S", "1")
    time.sleep(2.5)  # step 1's objects are older than a lease's life now, as they are in any long run
    restarted = CheckpointManager(root, incremental=True)  # cleans up
    _loads(restarted, 2)
