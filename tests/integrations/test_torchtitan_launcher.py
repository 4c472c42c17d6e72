"""torchtitan's own launcher selects distckpt with one flag: ``torchrun -m torchtitan.train ... --override.imports
distckpt.integrations.torchtitan.use_distckpt``. Two ranks of torchtitan's stock Trainer (FSDP2 over gloo, on CPU)
train a tiny llama3 on a tokenizer and dataset written here, checkpoint every 2 steps through distckpt, and a second
launch resumes from step 4 with the losses, and the step-6 checkpoint, of the uninterrupted run.

torchtitan 0.3.0 does not run on a CPU-only machine as released: ``torchtitan_cpu/sitecustomize.py`` (on the trainer
processes' path only) says which three of its lines stop it and what stands in for each, and ``torchtitan_cpu/
tiny_titan.py`` replaces flex attention (no backward on CPU) through torchtitan's own override mechanism. Nothing of
the checkpoint path is shimmed."""

import importlib.util
import json
import os
import random
import re
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,  # imported by the tests that use it
                                reason="torchtitan is not installed (pip install 'distckpt[torchtitan]')")
TORCHTITAN = "0.3.0"  # the CPU shims name this release's source lines
if version("torchtitan") != TORCHTITAN:
    pytest.skip(f"written against torchtitan {TORCHTITAN}'s source (installed: {version('torchtitan')})", allow_module_level=True)

import distckpt  # noqa: E402

HERE = Path(__file__).parent
SRC = HERE.parents[1] / "src"
SELECT = "distckpt.integrations.torchtitan.use_distckpt"
_STEP = re.compile(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)\s+grad_norm:\s+([0-9.]+)")


def _assets(root: Path) -> None:
    """A word-level tokenizer of 203 tokens (the model's vocabulary is 2048) and 200 documents of 64 words."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>"] + [f"w{i}" for i in range(200)]
    tokenizer = Tokenizer(WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    (root / "tokenizer").mkdir()
    tokenizer.save(str(root / "tokenizer" / "tokenizer.json"))
    (root / "tokenizer" / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}))
    (root / "c4_test").mkdir()
    r = random.Random(0)
    docs = (json.dumps({"text": " ".join(f"w{r.randrange(200)}" for _ in range(64))}) for _ in range(200))
    (root / "c4_test" / "data.json").write_text("\n".join(docs) + "\n")


def _launch(root: Path, *flags: str) -> tuple[str, dict[int, tuple[str, str]]]:
    """One run of torchtitan's launcher, 2 ranks; its output and each step's (loss, grad_norm) as logged."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "torchtitan.train",
           "--module", "tiny_titan", "--config", "tiny", "--override.imports", f"tiny_titan.cpu_attention,{SELECT}",
           "--dump_folder", "run", "--checkpoint.enable", "--checkpoint.interval", "2", "--debug.seed", "0",
           "--metrics.disable_color_printing", *flags]
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(HERE / "torchtitan_cpu"), str(SRC), os.environ.get("PYTHONPATH", "")]),
           "TORCHDYNAMO_DISABLE": "1",  # torchtitan compiles create_block_mask: ~20 s of inductor per launch on CPU
           "HF_DATASETS_CACHE": str(root / "hf_cache"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=180)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    return out, {int(s): (loss, norm) for s, loss, norm in _STEP.findall(out)}


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, read whole in this process."""
    items = distckpt.read_metadata(str(path)).state_dict_metadata
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in items.items() if isinstance(m, distckpt.TensorStorageMetadata)}
    distckpt.load(sd, checkpoint_id=str(path), no_dist=True)
    return sd


@pytest.mark.slow  # guard that stays: tests/integrations/test_torchtitan.py (its CheckpointManager through distckpt)
def test_torchtitan_train_selects_distckpt_and_resumes_bit_identically(tmp_path):
    _assets(tmp_path)
    first, losses = _launch(tmp_path)
    assert f"[Override] {SELECT}: checkpoint CheckpointManager.Config -> CheckpointManager.Config" in first
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    ckpt = tmp_path / "run" / "checkpoint"
    assert sorted(os.listdir(ckpt)) == ["step-2", "step-4", "step-6"]
    for step in os.listdir(ckpt):  # distckpt's checkpoints, none of DCP's files
        names = os.listdir(ckpt / step)
        assert "metadata.json" in names and not any(n.endswith(".distcp") or n == ".metadata" for n in names), names
    shutil.copytree(ckpt / "step-6", tmp_path / "uninterrupted-step-6")

    resumed, again = _launch(tmp_path, "--checkpoint.load_step", "4")  # torchtitan's roll-back flag
    assert "Training starts at step 5" in resumed
    assert sorted(again) == [5, 6] and all(again[s] == losses[s] for s in again)
    reference, replaced = _tensors(tmp_path / "uninterrupted-step-6"), _tensors(ckpt / "step-6")  # step 6 saved again
    assert reference.keys() == replaced.keys() and len(reference) > 50  # weights, moments, steps
    for key, tensor in reference.items():
        assert torch.equal(tensor, replaced[key]), key
