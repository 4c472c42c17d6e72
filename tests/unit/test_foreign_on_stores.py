"""Other programs' checkpoints on any registered store, found by the registry as on disk: a Hugging Face directory,
a DCP directory and a torch.save file uploaded to ``memory://`` load by ``checkpoint_id`` alone, through
``distckpt.open`` and the CLI too, and each layout reader takes a URL of any scheme. (On S3:
tests/storage/test_foreign_s3.py.)"""

from __future__ import annotations

import json
import os
import uuid
import warnings

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

import distckpt
from distckpt import backends
from distckpt.cli import main as cli


def upload(local_dir: str, url: str) -> None:
    """Every regular file of ``local_dir`` as an object under ``url``, as a user's copy tool would put it."""
    store = backends.store_for(url)
    for name in sorted(os.listdir(local_dir)):
        with open(os.path.join(local_dir, name), "rb") as f:
            store.put_atomic(name, f.read(), sync=False)


def hf_directory(path) -> dict:
    path.mkdir()
    x, z = torch.randn(16, 8), torch.arange(10)
    save_file({"x": x}, str(path / "model-00001-of-00002.safetensors"))
    save_file({"z": z}, str(path / "model-00002-of-00002.safetensors"))
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x": "model-00001-of-00002.safetensors", "z": "model-00002-of-00002.safetensors"}}))
    return {"x": x, "z": z}


def dcp_directory(path) -> dict:
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.randn(8, 4), "step": 7}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    return state


def _url() -> str:
    return f"memory://foreign-{uuid.uuid4().hex}"


def test_a_hugging_face_directory_in_memory_loads_by_checkpoint_id_and_opens(tmp_path):
    want, url = hf_directory(tmp_path / "hf"), _url()
    upload(str(tmp_path / "hf"), url)
    out = {"x": torch.zeros(16, 8), "z": torch.zeros(10, dtype=torch.int64)}
    distckpt.load(out, checkpoint_id=url, no_dist=True)
    assert torch.equal(out["x"], want["x"]) and torch.equal(out["z"], want["z"])
    assert isinstance(backends.reader_for(url), distckpt.HuggingFaceReader)
    with distckpt.open(url) as ck:
        assert torch.equal(ck["z"][:], want["z"])
    out2 = {"x": torch.zeros(16, 8), "z": torch.zeros(10, dtype=torch.int64)}
    distckpt.load(out2, storage_reader=distckpt.HuggingFaceReader(url), no_dist=True)  # the reader given a URL
    assert torch.equal(out2["x"], want["x"])


def test_a_dcp_directory_in_memory_loads_by_checkpoint_id_and_the_cli_reads_it(tmp_path):
    want, url = dcp_directory(tmp_path / "d"), _url()
    upload(str(tmp_path / "d"), url)
    out = {"w": torch.zeros(8, 4), "step": 0}
    distckpt.load(out, checkpoint_id=url, no_dist=True)
    assert torch.equal(out["w"], want["w"]) and out["step"] == 7
    result = CliRunner().invoke(cli, ["inspect", url])
    assert result.exit_code == 0 and "w" in result.output, result.output


def test_a_torch_save_object_in_memory_loads_by_checkpoint_id(tmp_path):
    state = {"a": torch.randn(5, 3), "b": torch.arange(4)}
    torch.save(state, str(tmp_path / "model.pt"))
    url = _url()
    upload(str(tmp_path), url)
    out = {"a": torch.zeros(5, 3), "b": torch.zeros(4, dtype=torch.int64)}
    distckpt.load(out, checkpoint_id=f"{url}/model.pt", no_dist=True)
    assert torch.equal(out["a"], state["a"]) and torch.equal(out["b"], state["b"])


def test_distckpts_own_checkpoint_and_nothing_keep_their_own_reader():
    url = _url()
    distckpt.save({"w": torch.ones(3)}, checkpoint_id=url, no_dist=True)
    assert type(backends.reader_for(url)).__name__ == "MemoryReader"
    with pytest.raises(distckpt.CheckpointNotFoundError):
        distckpt.load({"w": torch.zeros(3)}, checkpoint_id=_url(), no_dist=True)
