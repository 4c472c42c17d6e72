"""Hugging Face directories and torch.save files edited by an attacker: each defect gets a typed error naming the
file or key, before any destination is touched."""

import io
import json
import os
import struct
import zipfile

import pytest
import torch
from safetensors.torch import save_file

import distckpt

INDEX = "model.safetensors.index.json"
A, B = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def _hf(path, weight_map=None):
    os.makedirs(path, exist_ok=True)
    save_file({"x": torch.arange(40.0).reshape(10, 4), "y": torch.arange(6)}, os.path.join(path, A))
    save_file({"z": torch.ones(3, 3, dtype=torch.bfloat16)}, os.path.join(path, B))
    weight_map = weight_map or {"x": A, "y": A, "z": B}
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    return str(path)


def _state():
    return {"x": torch.zeros(10, 4), "y": torch.zeros(6, dtype=torch.int64), "z": torch.zeros(3, 3, dtype=torch.bfloat16)}


def _load(path, state=None):
    state = state if state is not None else _state()
    distckpt.load(state, checkpoint_id=path, no_dist=True)
    return state


def _write_shard(path, header: dict, data: bytes, name=A):
    raw = json.dumps(header).encode()
    with open(os.path.join(path, name), "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def test_an_untouched_directory_loads_and_the_cli_inspects_it(tmp_path):
    state = _load(_hf(tmp_path / "m"))
    assert torch.equal(state["x"], torch.arange(40.0).reshape(10, 4)) and torch.equal(state["y"], torch.arange(6))


@pytest.mark.parametrize("target", ["../outside.safetensors", "/etc/passwd", "sub/dir.safetensors", "notes.txt", ".hidden.safetensors"])
def test_an_index_pointing_outside_the_directory_is_refused(tmp_path, target):
    (tmp_path / "outside.safetensors").write_bytes(b"")
    path = _hf(tmp_path / "m", {"x": A, "y": A, "z": target})
    with pytest.raises(distckpt.CorruptCheckpointError, match="inside the checkpoint's directory"):
        _load(path)


def test_a_shard_that_is_a_symlink_is_not_followed(tmp_path):
    path = _hf(tmp_path / "m")
    os.rename(os.path.join(path, B), tmp_path / "real.safetensors")
    os.symlink(tmp_path / "real.safetensors", os.path.join(path, B))
    with pytest.raises(distckpt.CorruptCheckpointError, match="not a regular file"):
        _load(path)


@pytest.mark.parametrize("weight_map,match", [
    ({"x": A, "y": A, "z": A}, "index places tensor 'z' in"),         # the index says A, the header of A lacks it
    ({"x": A, "z": B}, "shard .* holds tensor 'y', which the index does not list"),
    ({"x": B, "y": A, "z": B}, "holds tensor 'x'"),
])
def test_headers_that_disagree_with_the_index_are_refused(tmp_path, weight_map, match):
    path = _hf(tmp_path / "m", weight_map)
    with pytest.raises(distckpt.CorruptCheckpointError, match=match):
        _load(path)


def test_overlapping_tensors_are_refused(tmp_path):
    path = _hf(tmp_path / "m")
    header = {"x": {"dtype": "F32", "shape": [10, 4], "data_offsets": [0, 160]},
              "y": {"dtype": "I64", "shape": [6], "data_offsets": [112, 160]}}
    _write_shard(path, header, bytes(160))
    with pytest.raises(distckpt.CorruptCheckpointError, match="overlap"):
        _load(path)


def test_a_truncated_shard_is_refused(tmp_path):
    path = _hf(tmp_path / "m")
    file = os.path.join(path, A)
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) - 8)
    with pytest.raises(distckpt.CorruptCheckpointError, match="truncated"):
        _load(path)


@pytest.mark.parametrize("header,data,match", [
    ({"x": {"dtype": "F32", "shape": [10, 4], "data_offsets": [0, 100]}}, bytes(100), "hold 100"),
    ({"x": {"dtype": "Q99", "shape": [1], "data_offsets": [0, 4]}}, bytes(4), "dtype"),
    ({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4), "shape"),
    ({"x": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 4]}}, bytes(4), "bytes"),
    ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, bytes(4), "data_offsets"),
    ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "extra": 1}}, bytes(4), "exactly"),
    ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8), "gap"),
    ({"__metadata__": {"a": 1}}, b"", "__metadata__"),
])
def test_headers_are_held_to_safetensors_rules(tmp_path, header, data, match):
    path = str(tmp_path / "m")
    os.makedirs(path)
    _write_shard(path, header, data, "model.safetensors")
    with pytest.raises(distckpt.CorruptCheckpointError, match=match):
        _load(path, {"x": torch.zeros(10, 4)})


def test_a_header_with_a_key_twice_or_nested_deeply_or_too_long_is_refused(tmp_path):
    path = str(tmp_path / "m")
    os.makedirs(path)
    raw = b'{"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + bytes(4))
    with pytest.raises(distckpt.CorruptCheckpointError, match="twice"):
        _load(path, {"x": torch.zeros(1)})
    raw = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(distckpt.CorruptCheckpointError, match="deeply|JSON"):
        _load(path, {"x": torch.zeros(1)})
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", 2**63) + b"{}")
    with pytest.raises(distckpt.CorruptCheckpointError, match="header claims"):
        _load(path, {"x": torch.zeros(1)})


def test_an_index_that_is_not_an_index_is_refused(tmp_path):
    path = _hf(tmp_path / "m")
    for text in ["[]", "{}", '{"weight_map": {"x": 5}}', "not json", '{"weight_map": ' * 50_000]:
        (tmp_path / "m" / INDEX).write_text(text)
        with pytest.raises(distckpt.CorruptCheckpointError):
            _load(path)


# ---- torch.save files


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_a_torch_save_file_loads_sharded_views_and_tied_tensors(tmp_path):
    w = torch.randn(4, 6)
    file = tmp_path / "m.pt"
    file.write_bytes(_saved({"w": w, "wt": w.t(), "tied": w, "n": 3}))
    out = {"w": torch.zeros(4, 6), "wt": torch.zeros(6, 4), "tied": torch.zeros(4, 6)}
    distckpt.load(out, checkpoint_id=str(file), no_dist=True)
    assert torch.equal(out["w"], w) and torch.equal(out["wt"], w.t()) and torch.equal(out["tied"], w)


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_a_torch_save_file_is_never_unpickled_freely(tmp_path):
    file = tmp_path / "m.pt"
    file.write_bytes(_saved({"w": torch.zeros(2), "evil": _Payload()}))
    with pytest.raises(distckpt.CheckpointError, match="system"):
        distckpt.load({"w": torch.zeros(2)}, checkpoint_id=str(file), no_dist=True)


def test_a_torch_save_file_with_compressed_records_or_a_forged_storage_size_is_refused(tmp_path):
    raw = _saved({"w": torch.arange(16.0)})
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(raw)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    file = tmp_path / "m.pt"
    file.write_bytes(out.getvalue())
    with pytest.raises(distckpt.CorruptCheckpointError, match="compressed"):
        distckpt.load({"w": torch.zeros(16)}, checkpoint_id=str(file), no_dist=True)
    with zipfile.ZipFile(io.BytesIO(raw)) as src:
        names = src.namelist()
        pkl = [n for n in names if n.endswith("data.pkl")][0]
        data = src.read(pkl)
        records = {n: src.read(n) for n in names}
    records[pkl] = data.replace(b"K\x10t", b"K\xfft", 1)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:  # unaligned: without torch's alignment record
        for n in names:
            if not n.endswith(".storage_alignment"):
                dst.writestr(n, records[n])
    file.write_bytes(out.getvalue())
    with pytest.raises(distckpt.CorruptCheckpointError, match="holds 64 bytes, but the pickle claims 1020|reads bytes"):
        distckpt.load({"w": torch.zeros(16)}, checkpoint_id=str(file), no_dist=True)


def test_the_cli_inspects_a_hugging_face_directory(tmp_path):
    from click.testing import CliRunner

    from distckpt.cli import main as cli

    path = _hf(tmp_path / "m")
    out = CliRunner().invoke(cli, ["inspect", path])
    assert out.exit_code == 0 and "Hugging Face safetensors checkpoint" in out.output and "x" in out.output
    out = CliRunner().invoke(cli, ["inspect", "--json", path])
    assert json.loads(out.output)["written_by"] == "Hugging Face safetensors"
    (tmp_path / "m" / INDEX).write_text('{"weight_map": {"x": "../x.safetensors"}}')
    out = CliRunner().invoke(cli, ["inspect", path])
    assert out.exit_code == 1 and "inside the checkpoint's directory" in out.output
