"""Incremental saves of a sharded state over a process group: each rank references its own unchanged shards, and
every kept step loads bit-exact at other world sizes after retention deleted the steps it references."""

import torch

import distckpt
from distckpt.testing import run_ranks

from . import incremental_workers as workers


def test_two_ranks_reference_unchanged_shards_and_steps_reshard_after_retention(tmp_path):
    root = str(tmp_path / "run")
    results = run_ranks(workers.save_run, 2, root, 5, 2)
    assert results[0]["steps"] == [4, 5]  # the coordinator applies retention after its commit
    written = results[0]["written"]
    assert all(w < 0.15 * written[0] for w in written[1:]), written  # only head, norm (every other step) and step
    path = distckpt.CheckpointManager(root, read_only=True).path(5)
    files = distckpt.read_metadata(path).storage_data.files
    assert {name.split("/")[0] for name, info in files.items() if info.save_id} == {"step-0000000001", "step-0000000004"}
    assert all(run_ranks(workers.load_step, 3, path, 5))
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in workers.full_state(4).items()}
    distckpt.load(out, checkpoint_id=distckpt.CheckpointManager(root, read_only=True).path(4), no_dist=True)
    assert all(torch.equal(out[k], v) if isinstance(v, torch.Tensor) else out[k] == v for k, v in workers.full_state(4).items())


def test_compact_is_a_phase_of_the_group_its_report_and_its_failure_reach_every_rank(tmp_path):
    done = run_ranks(workers.compact_on_every_rank, 2, str(tmp_path / "ok"), False)
    assert done[0]["files"] == done[1]["files"] == 2 and done[0]["bytes"] == done[1]["bytes"] > 0, done
    assert all(r["self_contained"] for r in done)  # each rank returned after the commit, not before the copy ended
    failed = run_ranks(workers.compact_on_every_rank, 2, str(tmp_path / "broken"), True)
    assert all(r.get("error") and "data-00001.safetensors" in r["message"] for r in failed), failed
    assert not any(r["self_contained"] for r in failed)
