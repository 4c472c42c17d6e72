"""`distckpt convert --to hf` and `--from hf`: a checkpoint published as a Hugging Face directory and back, through the
command line, bit-exact, reading one tensor at a time (the peak memory of a conversion is a few tensors, not the
model), and refusing what a Hugging Face checkpoint cannot hold."""

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

import distckpt
from distckpt.cli import main


def _state(n: int = 6, rows: int = 64) -> dict:
    g = torch.Generator().manual_seed(3)
    return {f"layers.{i}.w": torch.randn(rows, 32, generator=g) for i in range(n)} | {"emb": torch.randn(10, 4, generator=g).bfloat16()}


def test_to_hf_and_back_through_the_command_line(tmp_path):
    state = _state()
    ckpt, hf, back = str(tmp_path / "ckpt"), str(tmp_path / "hf"), str(tmp_path / "back")
    distckpt.save({"model": state, "step": 7}, checkpoint_id=ckpt, no_dist=True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "toy"}))
    runner = CliRunner()
    refused = runner.invoke(main, ["convert", "--to", "hf", ckpt, hf])
    assert refused.exit_code != 0 and "'step'" in refused.output and "--prefix" in refused.output
    assert not os.path.exists(hf)
    result = runner.invoke(main, ["convert", "--to", "hf", ckpt, hf, "--prefix", "model.", "--max-shard-size", "20KB",
                                  "--config", str(tmp_path / "config.json")])
    assert result.exit_code == 0, result.output
    names = sorted(os.listdir(hf))
    assert "config.json" in names and "model.safetensors.index.json" in names and len(names) >= 5
    from safetensors.torch import load_file

    stored = {}
    for n in names:
        if n.endswith(".safetensors"):
            stored.update(load_file(os.path.join(hf, n)))
    assert stored.keys() == state.keys() and all(torch.equal(stored[k], state[k]) for k in state)
    result = runner.invoke(main, ["convert", "--from", "hf", hf, back])
    assert result.exit_code == 0, result.output
    loaded = {k: torch.empty_like(v) for k, v in state.items()}
    distckpt.load(loaded, checkpoint_id=back, no_dist=True)
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    again = runner.invoke(main, ["convert", "--from", "hf", hf, back])
    assert again.exit_code != 0 and "already exists" in again.output
    missing = runner.invoke(main, ["convert", "--from", "hf", str(tmp_path / "nothing"), str(tmp_path / "x")])
    assert missing.exit_code != 0 and "not a Hugging Face checkpoint" in missing.output


_MEASURE = """
import sys, threading, time, torch
import distckpt.convert as c
def anon():  # the process's own memory: file pages of the page cache it reads through do not count
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) * 1024
torch.empty(1)
before = peak = anon()
done = False
def sample():
    global peak
    while not done:
        peak = max(peak, anon())
        time.sleep(0.002)
t = threading.Thread(target=sample)
t.start()
getattr(c, sys.argv[1])(sys.argv[2], sys.argv[3])
done = True
t.join()
print(peak - before)
"""


def test_conversions_hold_a_few_tensors_not_the_model(tmp_path):
    tensors = 32
    state = _state(tensors, rows=65536)  # 32 tensors of 8 MiB: 256 MiB
    total = sum(v.nbytes for v in state.values())
    ckpt, hf, back = str(tmp_path / "ckpt"), str(tmp_path / "hf"), str(tmp_path / "back")
    distckpt.save(state, checkpoint_id=ckpt, no_dist=True)
    del state
    # a fixed mmap threshold: glibc then gives each freed 8 MiB tensor back at once instead of keeping it for reuse,
    # so the peak counts what the conversion holds, not what the allocator caches
    env = {**os.environ, "DISTCKPT_IO_THREADS": "2", "DISTCKPT_PROGRESS": "off", "MALLOC_MMAP_THRESHOLD_": "1048576"}
    for fn, src, dst in (("to_hf", ckpt, hf), ("from_hf", hf, back)):
        out = subprocess.run([sys.executable, "-c", _MEASURE, fn, src, dst], capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr
        grown = int(out.stdout.split()[-1])
        # a few 8 MiB tensors in flight and the writer's buffers (direct I/O's bounce buffers), never the 256 MiB
        assert grown < total / 2, (fn, grown, total)
    loaded = {k: torch.empty_like(v) for k, v in _state(tensors, rows=65536).items()}
    distckpt.load(loaded, checkpoint_id=back, no_dist=True)
    assert all(torch.equal(loaded[k], v) for k, v in _state(tensors, rows=65536).items())


def test_a_value_in_a_published_state_is_named(tmp_path):
    with pytest.raises(distckpt.CheckpointError, match="no key starting with 'enc.'"):
        ckpt = str(tmp_path / "ckpt")
        distckpt.save({"w": torch.ones(2)}, checkpoint_id=ckpt, no_dist=True)
        distckpt.convert.to_hf(ckpt, str(tmp_path / "hf"), prefix="enc.")
