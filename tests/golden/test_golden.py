"""Checkpoints written by released format versions load forever after."""

import json
import os

import pytest
import torch

import distckpt
from distckpt.testing import run_ranks

from .expected import compressed_state, plain_state, sharded_full

HERE = os.path.dirname(os.path.abspath(__file__))
VERSIONS = sorted(d for d in os.listdir(HERE) if d.startswith("v") and os.path.isdir(os.path.join(HERE, d)))


def _golden(version, name):
    """The golden checkpoint ``name`` of ``version``; a version's directory may hold only some of them (4.0's
    compressed one came before its plain ones)."""
    path = os.path.join(HERE, version, name)
    if not os.path.exists(path):
        pytest.skip(f"no {name} golden checkpoint of {version}")
    return path


def _blank(obj):
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return {k: _blank(v) for k, v in obj.items()}
    return None


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and (a.numel() == 0 or torch.equal(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


def test_there_is_a_golden_checkpoint_of_the_current_versions():
    from distckpt.format import BASE_FORMAT_VERSION_STR, CODEC_FORMAT_VERSION_STR, FORMAT_VERSION_STR

    assert {f"v{v}" for v in (FORMAT_VERSION_STR, CODEC_FORMAT_VERSION_STR, BASE_FORMAT_VERSION_STR)} <= set(VERSIONS)


@pytest.mark.parametrize("version", VERSIONS)
def test_each_golden_document_is_of_its_directorys_version(version):
    for name in ("plain", "sharded-2ranks", "compressed"):
        if not os.path.exists(os.path.join(HERE, version, name)):
            continue
        with open(os.path.join(HERE, version, name, "metadata.json"), "rb") as f:
            assert json.loads(f.read())["format_version"] == version[1:]


@pytest.mark.parametrize("version", VERSIONS)
def test_plain_golden_loads_exactly(version):
    path = _golden(version, "plain")
    distckpt.verify(path)
    want = plain_state()
    out = _blank(want)
    distckpt.load(out, checkpoint_id=path)
    assert _equal(want, out)


@pytest.mark.parametrize("version", VERSIONS)
def test_sharded_golden_loads_at_one_rank(version):
    path = _golden(version, "sharded-2ranks")
    distckpt.verify(path)
    want = sharded_full()
    out = {k: torch.zeros_like(v) for k, v in want.items()}
    out["step"] = 0
    distckpt.load(out, checkpoint_id=path)
    assert out.pop("step") == 7 and _equal(want, out)


def _load_sharded_at(rank, world_size, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    want = sharded_full()
    out = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(1)]) for k, v in want.items()}
    distckpt.load(out, checkpoint_id=path, planner=distckpt.DefaultLoadPlanner(allow_partial_load=True))
    return all(torch.equal(out[k].full_tensor(), want[k]) for k in want)


@pytest.mark.parametrize("version", VERSIONS)
def test_sharded_golden_loads_at_three_ranks(version):
    assert run_ranks(_load_sharded_at, 3, _golden(version, "sharded-2ranks")) == [True] * 3


@pytest.mark.parametrize("version", VERSIONS)
def test_golden_metadata_matches_the_json_schema(version, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    from distckpt.format import FORMAT_VERSION

    docs = os.path.join(HERE, "..", "..", "docs")
    major = int(version[1:].split(".")[0])
    name = "metadata.schema.json" if major == FORMAT_VERSION[0] else f"metadata-{major}.schema.json"
    schema = json.load(open(os.path.join(docs, name)))
    paths = [os.path.join(HERE, version, name) for name in ("plain", "sharded-2ranks", "compressed")
             if os.path.exists(os.path.join(HERE, version, name))]
    if major == FORMAT_VERSION[0]:
        fresh = str(tmp_path / "fresh")  # a save of today that needs the newest version: compressed chunks
        distckpt.save(compressed_state(), storage_writer=distckpt.FileSystemWriter(fresh, compression="zstd"))
        paths.append(fresh)
    for path in paths:
        doc = json.load(open(os.path.join(path, "metadata.json")))
        jsonschema.validate(doc, schema)


def test_compressed_golden_loads_exactly():
    """Format 4.0's byte-grouped zstd chunks, each record with the decoded bytes' CRC-32C (docs/format.md, 3.5)."""
    path = os.path.join(HERE, "v4.0", "compressed")
    assert distckpt.verify(path).ok
    doc = json.load(open(os.path.join(path, "metadata.json")))
    records = [c[5] for entry in doc["state_dict_metadata"].values() if entry.get("type") == "tensor"
               for c in entry["chunks"] if len(c) == 6]
    assert len(records) >= 5 and all(r["codec"] == ["bytegroup.zstd/1"] and "crc32c" in r for r in records)
    want = compressed_state()
    out = _blank(want)
    distckpt.load(out, checkpoint_id=path)
    assert _equal(want, out)
    with distckpt.open(path) as ckpt:
        assert torch.equal(ckpt["z_bf16"][3:7, 100:], want["z_bf16"][3:7, 100:])


def test_golden_run_of_incremental_saves_loads_its_step_from_retired_files():
    """v4.0/run: step 3 references data files of steps 1 and 2, which retention retired (keep_last=1)."""
    from .expected import run_state

    jsonschema = pytest.importorskip("jsonschema")
    run = _golden("v4.0", "run")
    mgr = distckpt.CheckpointManager(run, read_only=True)
    assert mgr.all_steps() == [3]
    path = mgr.path(3)
    assert sorted(n.split("/")[0] for n in distckpt.read_metadata(path).storage_data.files if "/" in n) == [
        "step-0000000001", "step-0000000002"]
    assert distckpt.verify(path).ok
    want = run_state(3)
    out = _blank(want)
    distckpt.load(out, checkpoint_id=path)
    assert _equal(want, out)
    schema = json.load(open(os.path.join(HERE, "..", "..", "docs", "metadata.schema.json")))
    with open(os.path.join(path, "metadata.json")) as f:
        jsonschema.validate(json.load(f), schema)
