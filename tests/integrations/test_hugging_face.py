"""Hugging Face checkpoints, with transformers as the real client: a directory ``save_pretrained`` wrote in several
shards loads into FSDP2 models at 2 and 3 ranks with one distckpt.load (and through DCP's HuggingFaceStorageReader),
each rank reading only its rows, and the sharded model computes what the single-process one does."""

import importlib.util
import json
import os

import pytest
import torch

import distckpt
from distckpt.testing import run_ranks

from . import hf_workers as w

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,  # imported by the tests that use it
                                reason="transformers is not installed")


@pytest.mark.parametrize("kind,world", [("llama", 2), ("gpt2", 3)])
def test_a_sharded_save_pretrained_directory_loads_into_fsdp2(tmp_path, kind, world):
    path = str(tmp_path / "hf")
    expected = w.reference(kind, path, "60KB")
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) >= 3  # several shards
    results = run_ranks(w.fsdp_load, world, kind, path, timeout_s=300)
    stored = sum(os.path.getsize(os.path.join(path, f)) for f in set(index["weight_map"].values()))
    for logits, read, local in results:
        torch.testing.assert_close(logits, expected, rtol=0, atol=0)
        # each rank reads its rows (plus the headers and index), never the whole model
        assert read < local + stored // 10, (read, local, stored)
        assert read < 0.75 * stored


def test_one_line_load_of_a_single_file_and_the_dcp_reader_passed_in(tmp_path):
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "hf")
    w.reference("llama", path, "10GB")
    assert os.path.isfile(os.path.join(path, "model.safetensors"))
    model = w.build("llama", 5)
    state = model.state_dict()
    distckpt.load(state, checkpoint_id=path, no_dist=True)
    with torch.no_grad():
        assert torch.equal(model(w.BATCH).logits, w.build("llama", 0)(w.BATCH).logits)
    other = w.build("llama", 6)
    distckpt.load(other.state_dict(), storage_reader=dcp.HuggingFaceStorageReader(path), no_dist=True)
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), model.state_dict().values()))
    assert distckpt.read_metadata(f"hf://{path}").state_dict_metadata.keys() == state.keys()


def test_tied_weights_load_and_keys_are_checked_both_ways(tmp_path):
    path = str(tmp_path / "hf")
    w.reference("gpt2", path, "60KB")
    keys = set(json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"])
    assert "lm_head.weight" not in keys  # stored once, under the embedding's name
    model = w.build("gpt2", 3)
    distckpt.load(model.state_dict(), checkpoint_id=path, no_dist=True)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    assert torch.equal(model.lm_head.weight, w.build("gpt2", 0).transformer.wte.weight)
    state = model.state_dict()
    state["extra.weight"] = torch.zeros(2)
    with pytest.raises(distckpt.MissingKeyError, match="extra.weight"):
        distckpt.load(state, checkpoint_id=path, no_dist=True)
    state = model.state_dict()
    del state["transformer.ln_f.bias"]
    with pytest.raises(distckpt.UnexpectedKeyError, match="transformer.ln_f.bias"):
        distckpt.load(state, checkpoint_id=path, no_dist=True)
    distckpt.load(state, checkpoint_id=path, no_dist=True, planner=distckpt.DefaultLoadPlanner(allow_unexpected_keys=True))


def test_dtype_casts_only_when_allowed(tmp_path):
    path = str(tmp_path / "hf")
    model = w.build("llama", 0).to(torch.bfloat16)
    model.save_pretrained(path)
    state = w.build("llama", 1).state_dict()  # float32
    with pytest.raises(distckpt.DTypeMismatchError, match="allow_dtype_conversion"):
        distckpt.load(state, checkpoint_id=path, no_dist=True)
    distckpt.load(state, checkpoint_id=path, no_dist=True, planner=distckpt.DefaultLoadPlanner(allow_dtype_conversion=True))
    ref = model.state_dict()
    assert all(torch.equal(state[k], ref[k].float()) for k in state)
