"""A load reports, on each rank, the keys it left out: missing from the checkpoint, or not asked for."""

import pytest
import torch

import distckpt
from distckpt.errors import MissingKeyError


def _save(path):
    sd = {"model": {"a": torch.arange(6.0), "b": torch.ones(2, 3)}, "step": 4, "extra": torch.zeros(3)}
    distckpt.save(sd, checkpoint_id=path)


def test_a_full_load_reports_nothing_left_out(tmp_path):
    _save(tmp_path / "ck")
    sd = {"model": {"a": torch.zeros(6), "b": torch.zeros(2, 3)}, "step": 0, "extra": torch.ones(3)}
    result = distckpt.load(sd, checkpoint_id=tmp_path / "ck")
    assert result == distckpt.LoadResult([], []) and sd["step"] == 4 and torch.equal(sd["model"]["a"], torch.arange(6.0))


def test_a_partial_load_reports_missing_and_unexpected_keys(tmp_path):
    _save(tmp_path / "ck")
    sd = {"model": {"a": torch.zeros(6), "new_head": torch.zeros(4)}, "fresh": 1}
    result = distckpt.load(sd, checkpoint_id=tmp_path / "ck", planner=distckpt.DefaultLoadPlanner(allow_partial_load=True))
    assert sorted(result.missing_keys) == ["fresh", "model.new_head"]
    assert sorted(result.unexpected_keys) == ["extra", "model.b", "step"]
    missing, unexpected = result  # unpacks as torch.nn.Module.load_state_dict's result does
    assert torch.equal(sd["model"]["a"], torch.arange(6.0)) and torch.equal(sd["model"]["new_head"], torch.zeros(4))


def test_a_strict_load_still_raises_on_missing_keys(tmp_path):
    _save(tmp_path / "ck")
    with pytest.raises(MissingKeyError, match="new_head"):
        distckpt.load({"model": {"new_head": torch.zeros(4)}}, checkpoint_id=tmp_path / "ck")


def test_tied_weights_are_not_missing(tmp_path):
    w = torch.arange(4.0)
    distckpt.save({"emb": w.clone()}, checkpoint_id=tmp_path / "ck")
    shared = torch.zeros(4)
    result = distckpt.load({"emb": shared, "head": shared}, checkpoint_id=tmp_path / "ck")
    assert result.missing_keys == [] and torch.equal(shared, w)
