"""Conversion to and from torch.distributed.checkpoint, through the API and the command line."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner

import distckpt
from distckpt.cli import main
from distckpt.convert import from_dcp, to_dcp


def _state():
    g = torch.Generator().manual_seed(3)
    return {
        "model": {"layers.0.w": torch.randn(6, 5, generator=g), "emb": torch.randn(4, 3, generator=g).to(torch.bfloat16)},
        "optim": {"step": 12, "lr": 0.5, "name": "adamw", "ids": torch.arange(7)},
    }


def _blank(sd):
    if isinstance(sd, dict):
        return {k: _blank(v) for k, v in sd.items()}
    return torch.zeros_like(sd) if isinstance(sd, torch.Tensor) else None


def _equal(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def test_dcp_to_distckpt_and_back_is_exact(tmp_path):
    want = _state()
    dcp.save(want, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    with pytest.raises(distckpt.CheckpointError, match="trust_pickle=True"):
        from_dcp(tmp_path / "dcp", tmp_path / "ours")
    assert from_dcp(tmp_path / "dcp", tmp_path / "ours", trust_pickle=True) == 6
    distckpt.verify(tmp_path / "ours")
    got = _blank(want)
    distckpt.load(got, checkpoint_id=tmp_path / "ours")
    assert _equal(want, got)
    assert to_dcp(tmp_path / "ours", tmp_path / "dcp2") == 6
    again = _blank(want)
    dcp.load(again, checkpoint_id=str(tmp_path / "dcp2"), no_dist=True)
    assert _equal(want, again)


def test_convert_command(tmp_path):
    want = _state()
    distckpt.save(want, checkpoint_id=tmp_path / "ours")
    runner = CliRunner()
    res = runner.invoke(main, ["convert", "--to-dcp", str(tmp_path / "ours"), str(tmp_path / "dcp")])
    assert res.exit_code == 0 and "6 keys" in res.output, res.output
    got = _blank(want)
    dcp.load(got, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert _equal(want, got)
    res = runner.invoke(main, ["convert", "--from-dcp", str(tmp_path / "dcp"), str(tmp_path / "back")])
    assert res.exit_code == 1 and "--trust-pickle" in res.output
    res = runner.invoke(main, ["convert", "--from-dcp", "--trust-pickle", str(tmp_path / "dcp"), str(tmp_path / "back")])
    assert res.exit_code == 0, res.output
    res = runner.invoke(main, ["convert", "--from-dcp", "--trust-pickle", str(tmp_path / "dcp"), str(tmp_path / "back")])
    assert res.exit_code == 1 and "already exists" in res.output  # never replaces a committed checkpoint
    res = runner.invoke(main, ["convert", str(tmp_path / "dcp"), str(tmp_path / "x")])
    assert res.exit_code == 2
    res = runner.invoke(main, ["convert", "--from-dcp", "--trust-pickle", str(tmp_path / "nothing"), str(tmp_path / "y")])
    assert res.exit_code == 1 and "no DCP checkpoint" in res.output
