"""Other programs' checkpoints read from an S3-compatible server (moto's, on loopback) through the same layouts
and engine as from disk: a Hugging Face directory and a DCP directory uploaded as they are."""

from __future__ import annotations

import json
import os
import uuid
import warnings

import torch
from safetensors.torch import save_file

import distckpt


def _upload(client, bucket, local, prefix):
    for name in os.listdir(local):
        client.upload_file(os.path.join(local, name), bucket, f"{prefix}/{name}")


def test_a_hugging_face_directory_on_s3_loads(client, bucket, endpoint, tmp_path):
    local = tmp_path / "hf"
    local.mkdir()
    x, z = torch.randn(64, 8), torch.arange(10)
    save_file({"x": x}, str(local / "model-00001-of-00002.safetensors"))
    save_file({"z": z}, str(local / "model-00002-of-00002.safetensors"))
    (local / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x": "model-00001-of-00002.safetensors", "z": "model-00002-of-00002.safetensors"}}))
    prefix = f"hf-{uuid.uuid4().hex}"
    _upload(client, bucket, str(local), prefix)
    out = {"x": torch.zeros(64, 8), "z": torch.zeros(10, dtype=torch.int64)}
    reader = distckpt.HuggingFaceReader(f"s3://{bucket}/{prefix}", client=client)
    distckpt.load(out, storage_reader=reader, no_dist=True)
    assert torch.equal(out["x"], x) and torch.equal(out["z"], z)


def test_a_dcp_directory_on_s3_loads(client, bucket, endpoint, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard

    state = {"w": torch.randn(32, 4), "step": 7}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "d"), _extensions=[ZStandard()]), no_dist=True)
    prefix = f"dcp-{uuid.uuid4().hex}"
    _upload(client, bucket, str(tmp_path / "d"), prefix)
    out = {"w": torch.zeros(32, 4), "step": 0}
    distckpt.load(out, storage_reader=distckpt.DCPReader(f"s3://{bucket}/{prefix}", client=client), no_dist=True)
    assert torch.equal(out["w"], state["w"]) and out["step"] == 7


def test_hf_dcp_and_torch_save_on_s3_are_found_by_checkpoint_id_alone(client, bucket, endpoint, tmp_path):
    from ..unit.test_foreign_on_stores import dcp_directory, hf_directory

    hf, run = hf_directory(tmp_path / "hf"), uuid.uuid4().hex
    _upload(client, bucket, str(tmp_path / "hf"), f"{run}/hf")
    out = {"x": torch.zeros(16, 8), "z": torch.zeros(10, dtype=torch.int64)}
    distckpt.load(out, checkpoint_id=f"s3://{bucket}/{run}/hf", no_dist=True)
    assert torch.equal(out["x"], hf["x"]) and torch.equal(out["z"], hf["z"])
    with distckpt.open(f"s3://{bucket}/{run}/hf") as ck:
        assert torch.equal(ck["x"][:], hf["x"])
    state = dcp_directory(tmp_path / "d")
    _upload(client, bucket, str(tmp_path / "d"), f"{run}/dcp")
    got = {"w": torch.zeros(8, 4), "step": 0}
    distckpt.load(got, checkpoint_id=f"s3://{bucket}/{run}/dcp", no_dist=True)
    assert torch.equal(got["w"], state["w"]) and got["step"] == 7
    saved = {"a": torch.randn(5, 3)}
    torch.save(saved, str(tmp_path / "model.pt"))
    client.upload_file(str(tmp_path / "model.pt"), bucket, f"{run}/model.pt")
    back = {"a": torch.zeros(5, 3)}
    distckpt.load(back, checkpoint_id=f"s3://{bucket}/{run}/model.pt", no_dist=True)
    assert torch.equal(back["a"], saved["a"])
