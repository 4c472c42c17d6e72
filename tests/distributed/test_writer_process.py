"""async_save with PROCESS: a writer process per rank, started once and reused, fed through shared memory; its
death or a full disk in it fails the save on every rank with a typed error, commits nothing, and the next save
starts new writers and works."""

from __future__ import annotations

import pytest
import torch

import distckpt
from distckpt.testing import run_ranks

from . import writer_process_workers as workers

TIMEOUTS = {"DISTCKPT_TIMEOUT_S": "20"}


def test_two_ranks_save_dtensors_from_their_writer_processes(tmp_path):
    for rank, out in enumerate(run_ranks(workers.saves_from_writer_processes, 2, str(tmp_path), timeout_s=300)):
        assert out == {"one": True, "two": True, "writers": 1, "reused": True, "child": True, "pid": True}, (rank, out)


def test_one_process_saves_from_a_writer_process(tmp_path):
    sd = {"w": torch.randn(64, 8), "step": 4, "nested": {"name": "x"}}
    handle = distckpt.async_save(sd, checkpoint_id=str(tmp_path / "solo"), no_dist=True, async_checkpointer_type="process")
    sd["w"].zero_()  # staged already: the save holds the values of the call
    want = handle.result(timeout=120)
    out = {"w": torch.zeros(64, 8), "step": 0, "nested": {"name": ""}}
    distckpt.load(out, checkpoint_id=str(tmp_path / "solo"), no_dist=True)
    assert out["step"] == 4 and out["nested"] == {"name": "x"} and not torch.equal(out["w"], sd["w"])
    assert distckpt.verify(str(tmp_path / "solo")).ok and want.storage_meta.save_id


def test_a_state_that_cannot_travel_to_the_writer_is_a_typed_error_naming_thread(tmp_path):
    sd = {"w": torch.ones(3), "fn": lambda: 0}  # a value that does not pickle
    with pytest.raises(distckpt.CheckpointError, match="THREAD"):
        distckpt.async_save(sd, checkpoint_id=str(tmp_path / "x"), no_dist=True, async_checkpointer_type="process")


@pytest.mark.parametrize("spec", [
    "kill:write:1",  # rank 1's writer dies mid-write; rank 0's lives and must not wait past the timeout
    pytest.param("enospc:write:0", marks=pytest.mark.slow),  # a full disk in rank 0's writer
    pytest.param("kill:collective:0", marks=pytest.mark.slow),  # before anything is written
    pytest.param("kill:rename:0", marks=pytest.mark.slow),  # in the commit
])
def test_a_fault_in_one_writer_fails_the_save_everywhere_and_the_next_save_works(tmp_path, spec):
    out = run_ranks(workers.a_fault_in_one_writer, 2, str(tmp_path), spec, timeout_s=300, env=TIMEOUTS)
    for rank, got in enumerate(out):
        assert got["error"] is not None and not got["error"].startswith("untyped"), (rank, got)
        assert not got["committed"] and got["after"], (rank, got)
        assert got["waited"] < 60, (rank, got)
    if spec.startswith("kill"):
        assert out[int(spec.rsplit(":", 1)[1])]["error"] == "WriterProcessError", out


def test_release_buffers_frees_the_staging_the_writer_mapped(tmp_path):
    import os
    import time

    from distckpt.async_saving import _STATE

    sd = {"w": torch.randn(8 << 20 >> 2)}  # 8 MiB
    distckpt.async_save(sd, checkpoint_id=str(tmp_path / "a"), no_dist=True, async_checkpointer_type="process").result(timeout=120)
    writer = _STATE.solo_writer.process.pid

    def shm_mb() -> float:
        with open(f"/proc/{writer}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssShmem:")) / 1024

    assert shm_mb() >= 7, shm_mb()  # the writer maps the staged state
    assert distckpt.release_buffers() >= 8 << 20
    deadline = time.monotonic() + 10
    while shm_mb() >= 7 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert shm_mb() < 7 and os.path.exists(f"/proc/{writer}"), shm_mb()  # let go of, and the writer still there


@pytest.mark.slow  # guard that stays: test_the_writer_imports_what_the_training_process_can (its script has no guard)
def test_a_training_script_without_a_main_guard_runs_once(tmp_path):
    """The writer is a fresh interpreter running distckpt's module, not a spawn that imports the script again."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(
        "import torch, distckpt\n"
        f"open({str(tmp_path / 'runs')!r}, 'a').write('ran\\n')\n"
        f"h = distckpt.async_save({{'w': torch.ones(4)}}, checkpoint_id={str(tmp_path / 'c')!r}, no_dist=True,\n"
        "                         async_checkpointer_type='process')\n"
        "h.result(timeout=120)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "runs").read_text() == "ran\n" and distckpt.verify(str(tmp_path / "c")).ok


@pytest.mark.slow  # guards that stay: test_one_process_saves_from_a_writer_process, distributed/test_in_step.py (queues)
def test_saves_queued_behind_a_busy_writer_each_resolve_with_their_own_state_and_the_call_never_waits(tmp_path):
    """One process (every save numbered 0 there), two saves in flight behind a writer busy planning the first: each
    handle resolves with its own save, each checkpoint holds its own values, and a call does not wait for the writer
    to read a job larger than the socket's buffer (8,000 tensors)."""
    import time

    states = [{f"t{i}": torch.full((2,), float(salt)) for i in range(8000)} for salt in (1, 2, 3)]
    handles, returned = [], []
    for salt, sd in zip((1, 2, 3), states):
        begun = time.monotonic()
        handles.append(distckpt.async_save(sd, checkpoint_id=str(tmp_path / f"s{salt}"), no_dist=True, max_in_flight=2,
                                           planner=workers.SlowPlanner(3.0), async_checkpointer_type="process"))
        returned.append(time.monotonic() - begun)
    for h in handles:
        h.result(timeout=120)
    for salt in (1, 2, 3):
        out = {"t0": torch.zeros(2), "t7999": torch.zeros(2)}
        distckpt.load(out, checkpoint_id=str(tmp_path / f"s{salt}"), no_dist=True,
                      planner=distckpt.DefaultLoadPlanner(allow_partial_load=True))
        assert torch.equal(out["t0"], torch.full((2,), float(salt))) and torch.equal(out["t7999"], out["t0"]), salt
    assert returned[1] < 2.5, returned  # the second: staged and handed over while the writer plans the first


def test_a_save_one_writer_cannot_rebuild_fails_on_every_rank_at_once(tmp_path):
    out = run_ranks(workers.one_writer_cannot_rebuild_its_save, 2, str(tmp_path), timeout_s=300, env=TIMEOUTS)
    for rank, got in enumerate(out):
        assert got["error"] is not None and not got["error"].startswith("untyped"), (rank, got)
        assert got["waited"] < 15 and not got["committed"] and got["after"], (rank, got)
    assert "cannot be rebuilt" in out[1]["error"] and "THREAD" in out[1]["error"], out


def test_saves_the_ranks_refuse_leave_nothing_shared_behind(tmp_path):
    for rank, got in enumerate(run_ranks(workers.saves_refused_by_the_agreement_leave_nothing_shared, 2, str(tmp_path),
                                         timeout_s=300, env=TIMEOUTS)):
        assert got["failed"] == 5 and got["grew"] <= 1, (rank, got)


def test_the_writer_imports_what_the_training_process_can(tmp_path):
    """distckpt and a user's planner, importable by the training process from a path it added itself, are importable
    by the writer too; and the script, which has no main guard, runs once (the writer is a fresh interpreter running
    distckpt's module, not a spawn that imports the script again)."""
    import subprocess
    import sys

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "my_planner.py").write_text(
        "import distckpt\nclass MyPlanner(distckpt.DefaultSavePlanner):\n    pass\n")
    src = str(__import__("pathlib").Path(distckpt.__file__).parents[1])
    script = tmp_path / "train.py"
    script.write_text(
        f"import sys\nsys.path[:0] = [{src!r}, {str(tmp_path / 'mine')!r}]\n"
        "import torch, distckpt, my_planner\n"
        f"open({str(tmp_path / 'runs')!r}, 'a').write('ran\\n')\n"
        f"h = distckpt.async_save({{'w': torch.ones(4)}}, checkpoint_id={str(tmp_path / 'c')!r}, no_dist=True,\n"
        "                         planner=my_planner.MyPlanner(), async_checkpointer_type='process')\n"
        "h.result(timeout=120)\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "runs").read_text() == "ran\n" and distckpt.verify(str(tmp_path / "c")).ok


def test_a_copy_that_fails_after_the_writers_started_fails_the_save_on_every_rank(tmp_path):
    out = run_ranks(workers.a_copy_fails_while_the_writers_write, 2, str(tmp_path), timeout_s=300, env=TIMEOUTS)
    assert out[0]["raised"] is None and "cannot be read" in out[1]["raised"], out
    for rank, got in enumerate(out):
        assert got["error"] is not None and not got["error"].startswith("untyped"), (rank, got)
        assert not got["committed"] and got["after"], (rank, got)


@pytest.mark.parametrize("how", [pytest.param("hugging-face-writer", marks=pytest.mark.slow), "transforming-planner"])
def test_a_writer_that_may_read_before_the_copy_ends_writes_the_copied_bytes(tmp_path, how):
    """Writers and planners that do not wait on the staging (a Hugging Face publish, a planner making new tensors
    from the staged ones) get the save once the copy has ended; a second save, reusing the first's staging, shows
    stale bytes where they would not."""
    from safetensors.torch import load_file

    for i in range(2):
        sd = {"a": torch.full((64,), 7.0 + i), "b": torch.full((64,), 5.0 + i).as_subclass(workers.SlowCopy)}
        path = str(tmp_path / f"ck{i}")
        if how == "hugging-face-writer":
            writer, planner = distckpt.HuggingFaceWriter(path), None
        else:
            writer, planner = None, workers.Rescaled()
        distckpt.async_save(sd, checkpoint_id=path, storage_writer=writer, planner=planner, no_dist=True,
                            async_checkpointer_type="process").result(timeout=120)
        if how == "hugging-face-writer":
            got = load_file(str(next((tmp_path / f"ck{i}").glob("*.safetensors"))))
        else:
            got = {"a": torch.empty(64), "b": torch.empty(64)}
            distckpt.load(got, checkpoint_id=path, no_dist=True)
        assert bool((got["a"] == 7.0 + i).all()) and bool((got["b"] == 5.0 + i).all()), (i, got)


@pytest.mark.slow  # guard that stays: test_a_copy_that_fails_after_the_writers_started_fails_the_save_on_every_rank
def test_a_copy_failing_on_a_rank_that_writes_none_of_it_commits_nowhere(tmp_path):
    out = run_ranks(workers.a_copy_fails_on_a_rank_whose_writer_writes_nothing_of_it, 2, str(tmp_path), timeout_s=300,
                    env=TIMEOUTS)
    assert out[0]["raised"] is None and out[1]["raised"] == "RuntimeError", out
    assert all(got["error"] is not None and not got["committed"] for got in out), out


# guard that stays: test_two_ranks_save_dtensors_from_their_writer_processes
@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_dtensors_of_one_mesh_save_from_writer_processes(tmp_path, world):
    assert run_ranks(workers.dtensors_of_one_mesh_travel_to_the_writer, world, str(tmp_path), timeout_s=300) == [True] * world
