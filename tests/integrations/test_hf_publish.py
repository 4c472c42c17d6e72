"""Publishing Hugging Face checkpoints from a distributed state, with transformers and safetensors as the real
clients: FSDP2 models at 2 and 3 ranks write a sharded directory that ``from_pretrained`` loads with the same
outputs, every placement of a DTensor lands bit-exact, shards split as ``save_pretrained`` splits them, and a publish
killed at any point leaves nothing ``from_pretrained`` takes for a checkpoint."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

import distckpt
from distckpt.backends.filesystem import FsStore
from distckpt.testing import run_ranks

from . import hf_workers as w

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,  # imported by the tests that use it
                                reason="transformers is not installed")


def _tensors(path: str) -> dict:
    from safetensors.torch import load_file

    names = os.listdir(path)
    if "model.safetensors" in names:
        return load_file(os.path.join(path, "model.safetensors"))
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        part = load_file(os.path.join(path, shard))
        assert {k for k, v in index["weight_map"].items() if v == shard} == set(part)
        out.update(part)
    return out


@pytest.mark.parametrize("kind,world", [("llama", 2), ("gpt2", 3)])
def test_an_fsdp2_state_publishes_a_directory_from_pretrained_loads(tmp_path, kind, world):
    import transformers

    path = str(tmp_path / "published")
    keys = run_ranks(w.fsdp_publish, world, kind, path, "60KB", timeout_s=300)[0]
    names = sorted(os.listdir(path))
    assert "config.json" in names and "model.safetensors.index.json" in names
    assert len([n for n in names if n.endswith(".safetensors")]) >= 3
    assert not [n for n in os.listdir(tmp_path) if n != "published"]  # no staging directory or lease left
    expected_model = w.build(kind, 0)
    with torch.no_grad():
        expected = expected_model(w.BATCH).logits
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(w.BATCH).logits, expected, rtol=0, atol=0)
    stored = _tensors(path)
    assert set(stored) == set(keys)
    reference = expected_model.state_dict()
    assert all(torch.equal(stored[k], reference[k]) for k in keys)


def test_every_dtensor_placement_lands_bit_exact(tmp_path):
    path = str(tmp_path / "out")
    run_ranks(w.dtensor_publish, 3, path, timeout_s=120)
    stored = _tensors(path)
    expected = w.dtensor_state()
    assert set(stored) == set(expected)
    for k, v in expected.items():
        assert stored[k].dtype == v.dtype and torch.equal(stored[k], v), k
    # and back through distckpt's own reader of the layout
    back = {k: torch.empty_like(v) for k, v in expected.items()}
    distckpt.load(back, checkpoint_id=path, no_dist=True)
    assert all(torch.equal(back[k], expected[k]) for k in expected)


def test_shards_split_as_save_pretrained_splits_them(tmp_path):
    model = w.build("llama", 0)
    model.save_pretrained(str(tmp_path / "hf"), max_shard_size="60KB")
    distckpt.save(model.state_dict(), storage_writer=distckpt.HuggingFaceWriter(str(tmp_path / "ours"), max_shard_size="60KB",
                                                                                  config=model.config), no_dist=True)
    theirs = json.load(open(tmp_path / "hf" / "model.safetensors.index.json"))
    ours = json.load(open(tmp_path / "ours" / "model.safetensors.index.json"))
    assert ours["weight_map"] == theirs["weight_map"]
    assert ours["metadata"]["total_size"] == theirs["metadata"]["total_size"]
    assert json.load(open(tmp_path / "ours" / "config.json"))["model_type"] == "llama"
    # one shard: one model.safetensors, no index, as save_pretrained
    distckpt.save(model.state_dict(), storage_writer=distckpt.HuggingFaceWriter(str(tmp_path / "one")), no_dist=True)
    assert os.listdir(tmp_path / "one") == ["model.safetensors"]


def test_an_hf_url_without_a_config_is_refused_before_a_byte_is_written(tmp_path):
    """``checkpoint_id="hf://out"`` cannot carry a config.json, and from_pretrained cannot open a directory without
    one: refused at once, naming the writer that takes a config."""
    with pytest.raises(distckpt.CheckpointError, match=r"no config\.json.*HuggingFaceWriter\(.*config=model\.config"):
        distckpt.save({"w": torch.ones(4)}, checkpoint_id=f"hf://{tmp_path / 'out'}", no_dist=True)
    assert os.listdir(tmp_path) == []


def test_what_a_hugging_face_checkpoint_cannot_hold_is_refused_before_a_byte_is_written(tmp_path):
    target = str(tmp_path / "out")
    with pytest.raises(distckpt.UnsupportedTensorError, match="'step'.*not tensors"):
        distckpt.save({"w": torch.ones(2), "step": 3}, storage_writer=distckpt.HuggingFaceWriter(target), no_dist=True)
    with pytest.raises(distckpt.UnsupportedTensorError, match="'z'.*complex"):
        distckpt.save({"z": torch.ones(2, dtype=torch.complex64)}, storage_writer=distckpt.HuggingFaceWriter(target),
                      no_dist=True)
    assert os.listdir(tmp_path) == []
    os.mkdir(target)
    open(os.path.join(target, "README.md"), "w").close()
    with pytest.raises(distckpt.CheckpointError, match="holds files.*README.md"):
        distckpt.save({"w": torch.ones(2)}, storage_writer=distckpt.HuggingFaceWriter(target), no_dist=True)
    with pytest.raises(distckpt.CheckpointError, match="max_shard_size"):
        distckpt.HuggingFaceWriter(target, max_shard_size="5 parsecs")
    with pytest.raises(distckpt.CheckpointNotFoundError, match="nothing.json does not exist; pass the path of a config.json"):
        distckpt.HuggingFaceWriter(target, config=str(tmp_path / "nothing.json"))
    with pytest.raises(distckpt.CheckpointError, match="not a JSON document"):
        distckpt.HuggingFaceWriter(target, config=str(tmp_path / "out" / "README.md"))


_PUBLISH = """
import sys, torch, distckpt
sys.path.insert(0, {tests!r})
from integrations import hf_workers as w
model = w.build("llama", 0)
distckpt.save(model.state_dict(), storage_writer=distckpt.HuggingFaceWriter({path!r}, max_shard_size="60KB",
              config=model.config), no_dist=True)
"""


def _publish(path: str, **env) -> subprocess.CompletedProcess:
    code = _PUBLISH.format(tests=os.path.dirname(os.path.dirname(__file__)), path=path)
    env = {**os.environ, "DISTCKPT_FSYNC": "1", **env}  # durability is what a crash test checks
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_a_publish_killed_anywhere_leaves_nothing_from_pretrained_takes_for_a_checkpoint(tmp_path, run_slow):
    """The first boundary and the commit's rename; four more under --run-slow (the middle of the writes among them:
    a kill there leaves what a kill at the first boundary does, a staging directory that nothing loads)."""
    import transformers

    log = tmp_path / "points.log"
    done = _publish(str(tmp_path / "full"), DISTCKPT_FAULT_LOG=str(log))
    assert done.returncode == 0, done.stderr
    points = [line.split("\t") for line in log.read_text().splitlines()]  # index, rank, kind, path
    kinds = [p[2] for p in points]
    assert kinds.count("write") > 10 and kinds.count("rename") == 1, kinds
    commit = kinds.index("rename")
    # the first boundary (a shard's creation), the ranks' writes, and the commit's rename itself
    chosen = {0, 1, commit // 3, commit // 2, commit - 1, commit} if run_slow else {0, commit}
    for index in sorted(chosen):
        path = str(tmp_path / f"killed-{index}")
        result = _publish(path, DISTCKPT_FAULT=f"kill:{index}")
        assert result.returncode == -9, (index, result.returncode, result.stderr[-2000:])
        assert not os.path.exists(path), index
        with pytest.raises(OSError):
            transformers.AutoModelForCausalLM.from_pretrained(path)
    if commit + 1 < len(points):  # killed just after the rename (syncing the parent): the publish is whole
        path = str(tmp_path / "killed-after")
        assert _publish(path, DISTCKPT_FAULT=f"kill:{commit + 1}").returncode == -9
        transformers.AutoModelForCausalLM.from_pretrained(path)
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith(".distckpt-")]
    assert leftovers  # each dead publish's staging directory or lease
    FsStore(str(tmp_path)).remove_incomplete_below()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".distckpt-")]
    assert sorted(n for n in os.listdir(tmp_path) if not n.endswith(".log")) in (["full"], ["full", "killed-after"])


def test_dcp_hugging_face_writer_passed_in_is_adopted_with_its_shard_mapping(tmp_path):
    import torch.distributed.checkpoint as dcp

    model = w.build("llama", 0)
    state = model.state_dict()
    mapping = {k: 1 + i % 3 for i, k in enumerate(state)}
    writer = dcp.HuggingFaceStorageWriter(str(tmp_path / "out"), fqn_to_index_mapping=mapping, save_distributed=True,
                                          enable_consolidation=True)
    distckpt.save(state, storage_writer=writer, no_dist=True)
    index = json.load(open(tmp_path / "out" / "model.safetensors.index.json"))
    assert index["weight_map"] == {k: f"model-{v:05d}-of-00003.safetensors" for k, v in mapping.items()}
    assert not os.path.exists(tmp_path / "out" / "sharded")
    stored = _tensors(str(tmp_path / "out"))
    assert all(torch.equal(stored[k], v) for k, v in state.items())
    with pytest.raises(distckpt.CheckpointError, match="no shard for key"):
        distckpt.save(state, storage_writer=distckpt.HuggingFaceWriter(str(tmp_path / "b"), fqn_to_index_mapping={"x": 1}),
                      no_dist=True)


@pytest.mark.parametrize("case", ["enospc on a rank's writes", "enospc creating the shards", "target not free", "bad mapping"])
def test_a_publish_failing_on_one_rank_fails_on_every_rank_at_once_and_leaves_nothing(tmp_path, case):
    path = str(tmp_path / "out")
    if case == "target not free":
        os.mkdir(path)
        open(os.path.join(path, "weights.bin"), "w").close()
    fault = {"enospc on a rank's writes": "enospc:1", "enospc creating the shards": "enospc:0"}.get(case, "")
    results = run_ranks(w.publish_failing, 2, path, fault, case == "bad mapping", timeout_s=120)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} did not raise"
        name, text, seconds, listing = result
        assert seconds < 30, (rank, seconds)  # the failure reached every rank, not a timeout
        expected = {"target not free": "weights.bin", "bad mapping": "no shard for key"}.get(case, "No space left")
        assert expected in text, (rank, name, text)
    leftovers = [n for n in os.listdir(tmp_path) if n != "out"]
    assert leftovers == []  # no staging directory, no lease
    assert os.listdir(path) == (["weights.bin"] if case == "target not free" else []) if os.path.exists(path) else True


def test_tensors_larger_than_a_shard_split_as_save_pretrained_splits_them(tmp_path):
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=2048, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False))  # embeddings and lm_head of 512 KB: over the shard size
    model.save_pretrained(str(tmp_path / "hf"), max_shard_size="200KB")
    distckpt.save(model.state_dict(), storage_writer=distckpt.HuggingFaceWriter(str(tmp_path / "ours"), max_shard_size="200KB"),
                  no_dist=True)
    theirs = json.load(open(tmp_path / "hf" / "model.safetensors.index.json"))["weight_map"]
    ours = json.load(open(tmp_path / "ours" / "model.safetensors.index.json"))["weight_map"]
    assert ours == theirs and len(set(ours.values())) >= 3


def test_a_replicated_state_balanced_across_ranks_keeps_the_state_dicts_shard_order(tmp_path):
    model = w.build("llama", 0)
    model.save_pretrained(str(tmp_path / "hf"), max_shard_size="60KB")
    run_ranks(w.replicated_publish, 2, str(tmp_path / "ours"), "60KB", timeout_s=120)
    theirs = json.load(open(tmp_path / "hf" / "model.safetensors.index.json"))["weight_map"]
    ours = json.load(open(tmp_path / "ours" / "model.safetensors.index.json"))["weight_map"]
    assert ours == theirs
    stored = _tensors(str(tmp_path / "ours"))
    assert all(torch.equal(stored[k], v) for k, v in model.state_dict().items())
