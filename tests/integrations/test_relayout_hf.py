"""Re-layout at 2 ranks (gloo, CPU): DTensor models with fused and stacked keys load from an unfused checkpoint bit
for bit and save it back; a fused-qkv Llama under FSDP2 loads a ``save_pretrained`` directory with
RelayoutLoadPlanner, computes the Hugging Face model's logits exactly, and publishes the standard layout again."""

import json
import os

import pytest
import torch

import distckpt
from distckpt.testing import run_ranks

from . import hf_workers
from . import relayout_workers as w


@pytest.mark.parametrize("shard_dim", [0, 1])
def test_dtensor_model_loads_an_unfused_checkpoint_and_saves_it_back(tmp_path, shard_dim):
    ckpt = w.checkpoint_state()
    distckpt.save(ckpt, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    expected = w.model_state(ckpt)
    results = run_ranks(w.dtensor_load_and_save, 2, str(tmp_path / "ckpt"), str(tmp_path / "back"), shard_dim, timeout_s=300)
    for loaded in results:
        assert loaded.keys() == expected.keys()
        for k, v in expected.items():
            assert torch.equal(loaded[k], v) if isinstance(v, torch.Tensor) else loaded[k] == v, k
    md = distckpt.read_metadata(str(tmp_path / "back")).state_dict_metadata
    assert md.keys() == ckpt.keys()
    # the keys the halves straddle were written by both ranks, each its part
    straddled = "model.layers.0.attn.k.weight" if shard_dim == 0 else "model.fc.b"
    assert len(md[straddled].chunks) == 2
    assert len(md["model.emb"].chunks) == 1  # a replica, written once
    back = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in ckpt.items()}
    distckpt.load(back, checkpoint_id=str(tmp_path / "back"), no_dist=True)
    for k, v in ckpt.items():
        assert torch.equal(back[k], v) if isinstance(v, torch.Tensor) else back[k] == v, k


def _check_standard_layout(path: str, reference) -> None:
    """The checkpoint at ``path`` holds exactly the Hugging Face model's keys and weights."""
    ref = reference.state_dict()
    assert distckpt.read_metadata(path).state_dict_metadata.keys() == ref.keys()
    other = hf_workers.build("llama", 9).state_dict()
    distckpt.load(other, checkpoint_id=path, no_dist=True)
    for k, v in ref.items():
        assert torch.equal(other[k], v), k


def test_fused_qkv_llama_loads_a_hugging_face_directory_in_fsdp2_and_publishes_the_standard_layout(tmp_path):
    pytest.importorskip("transformers")
    path = str(tmp_path / "hf")
    expected = hf_workers.reference("llama", path, "60KB")
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) >= 3  # several shards
    assert any(".q_proj." in k for k in index["weight_map"])
    results = run_ranks(w.fused_fsdp_load, 2, path, str(tmp_path / "out"), timeout_s=300)
    stored = sum(os.path.getsize(os.path.join(path, f)) for f in set(index["weight_map"].values()))
    for logits, read, local in results:
        torch.testing.assert_close(logits, expected, rtol=0, atol=0)
        # each rank reads its rows of q, k and v (plus headers, and chunks it verifies whole), never the whole model
        assert read < local + stored // 10, (read, local, stored)
        assert read < 0.75 * stored
    _check_standard_layout(str(tmp_path / "out"), hf_workers.build("llama", 0))


def test_published_from_the_fused_model_with_the_hugging_face_writer_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("distckpt.backends.hf_writer", reason="HuggingFaceWriter is not in this checkout yet")
    path = str(tmp_path / "hf")
    expected = hf_workers.reference("llama", path, "60KB")
    run_ranks(w.fused_fsdp_load, 2, path, str(tmp_path / "out"), str(tmp_path / "published"), timeout_s=300)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "published")).eval()
    assert not any(".qkv_proj." in k for k in model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(model(hf_workers.BATCH).logits, expected, rtol=0, atol=0)
