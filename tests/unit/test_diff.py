"""distckpt diff and distckpt cat: two checkpoints compared by checksum first, then by bytes streamed within the
memory budget (checkpoints of different world sizes too); a value or a tensor's summary printed."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

import distckpt
from distckpt.cli import main
from distckpt.diffing import diff
from distckpt.metadata import MetadataIndex

from . import open_workers


def _value_bytes(path):
    """The stored bytes of a checkpoint's values: what a diff that decides every tensor by checksum reads."""
    md = distckpt.read_metadata(path)
    return sum(md.storage_data.items[MetadataIndex(k)].length for k, e in md.state_dict_metadata.items()
               if not isinstance(e, distckpt.TensorStorageMetadata))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Two steps of a tiny training run, saved by a CheckpointManager."""
    root = str(tmp_path_factory.mktemp("diff") / "run")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    mgr = distckpt.CheckpointManager(root)
    x = torch.randn(32, 8)
    for step in (1, 2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        mgr.save(step, {"model": model, "optim": opt, "progress": {"step": step, "run": "tiny"}})
    return mgr.path(1), mgr.path(2)


def test_two_steps_of_a_run_differ_by_checksum_without_reading_a_tensor(run):
    a, b = run
    report = diff(a, b)
    assert not report.identical and not report.added and not report.removed and not report.changed
    tensors = [e for e in report.differ if e["key"] != "progress.step"]
    assert {e["key"] for e in tensors} >= {"model.0.weight", "model.2.bias"}
    assert all(e["decided_by"] == "checksum" for e in tensors)
    assert {"key": "progress.step", "decided_by": "value"} in report.differ
    assert {"key": "progress.run", "decided_by": "value"} in report.same
    assert report.bytes_read == {"a": _value_bytes(a), "b": _value_bytes(b)}  # values only: no tensor byte read


def test_a_step_against_itself_is_the_same_by_checksum_and_by_bytes_with_exact(run, monkeypatch):
    a, _ = run
    report = diff(a, a)
    assert report.identical and all(e["decided_by"] in ("checksum", "value") for e in report.same)
    assert report.bytes_read["a"] == _value_bytes(a)
    monkeypatch.setenv("DISTCKPT_MEMORY_BUDGET_BYTES", "512")  # chunks compared a few rows at a time
    exact = diff(a, a, exact=True)
    assert exact.identical and {e["decided_by"] for e in exact.same} == {"bytes", "value"}
    total = sum(f.size for f in distckpt.read_metadata(a).storage_data.files.values())
    assert _value_bytes(a) < exact.bytes_read["a"] < total  # every chunk's bytes, no header


@pytest.fixture(scope="module")
def world_sizes(tmp_path_factory):
    """The same logical state saved at 2 ranks (sharded by rows and by columns) and at 1 process."""
    two, one = open_workers.sharded_checkpoint(tmp_path_factory), str(tmp_path_factory.mktemp("worlds") / "one")
    distckpt.save(open_workers.full_state(), checkpoint_id=one)
    return two, one


def test_checkpoints_at_different_world_sizes_compare_by_bytes(world_sizes, tmp_path, monkeypatch):
    two, one = world_sizes
    report = diff(two, one)
    assert report.identical, report.to_dict()
    how = {e["key"]: e["decided_by"] for e in report.same}
    assert how == {"model.rows": "bytes", "model.cols": "bytes", "model.bias": "checksum", "step": "value"}
    changed = open_workers.full_state()
    changed["model"]["cols"][3, 7] += 1
    changed["model"]["rows"] = changed["model"]["rows"].to(torch.float64)
    other = str(tmp_path / "changed")
    distckpt.save(changed, checkpoint_id=other)
    monkeypatch.setenv("DISTCKPT_MEMORY_BUDGET_BYTES", "256")  # pieces of 64 bytes: blocks of a row or two
    report = diff(two, other)
    assert report.differ == [{"key": "model.cols", "decided_by": "bytes", "elements": 1}]
    assert report.changed == [{"key": "model.rows", "a": {"kind": "tensor", "dtype": "float32", "shape": [30, 8]},
                               "b": {"kind": "tensor", "dtype": "float64", "shape": [30, 8]}}]


def test_diff_command_exit_codes_and_json(run, world_sizes, tmp_path):
    a, b = run
    runner = CliRunner()
    res = runner.invoke(main, ["diff", a, a])
    assert res.exit_code == 0 and "by checksum only" in res.output and "the same" in res.output
    res = runner.invoke(main, ["diff", a, b, "--json"])
    assert res.exit_code == 1, res.output
    doc = json.loads(res.output)
    assert doc["identical"] is False and doc["bytes_read"] == {"a": _value_bytes(a), "b": _value_bytes(b)}
    res = runner.invoke(main, ["diff", a, b])
    assert res.exit_code == 1 and "! model.0.weight differs (by checksum)" in res.output
    res = runner.invoke(main, ["diff", *world_sizes, "--exact"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(main, ["diff", a, str(tmp_path / "nope")])
    assert res.exit_code == 3
    damaged = str(tmp_path / "damaged")
    distckpt.save(open_workers.full_state(), checkpoint_id=damaged)
    name = next(n for n in os.listdir(damaged) if n.endswith(".safetensors"))
    with open(os.path.join(damaged, name), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(damaged, name)) - 1)
    res = runner.invoke(main, ["diff", world_sizes[0], damaged])
    assert res.exit_code == 5 and "truncated" in res.output


def _console(*args):
    script = os.path.join(os.path.dirname(sys.executable), "distckpt")
    command = [script] if os.path.exists(script) else [sys.executable, "-m", "distckpt.cli"]
    return subprocess.run(command + list(args), capture_output=True, text=True, timeout=120)


def test_cat_prints_a_value_and_a_tensor_summary_through_the_console_script(world_sizes):
    two, _ = world_sizes
    res = _console("cat", two, "step")
    assert res.returncode == 0 and res.stdout.strip() == "3", res.stderr
    res = _console("cat", two, "model.cols", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    full = open_workers.COLS.double()
    assert doc["dtype"] == "bfloat16" and doc["shape"] == [12, 10] and doc["chunks"] == 2
    assert doc["head"] == open_workers.COLS.reshape(-1)[:8].float().tolist()
    assert doc["min"] == full.min().item() and doc["max"] == full.max().item() and doc["nan"] == 0
    assert math.isclose(doc["mean"], full.mean().item()) and math.isclose(doc["norm"], full.norm().item())
    res = CliRunner().invoke(main, ["cat", two, "model.col"])
    assert res.exit_code == 4 and "did you mean 'model.cols'" in res.output
    res = CliRunner().invoke(main, ["cat", two, "model.bias"])
    assert res.exit_code == 0 and "int64" in res.output and "head  [0, 1, 2, 3, 4, 5, 6]" in res.output
