"""Conversions at the edges of what tensors and JSON can be: empty tensors of huge dimensions, and JSON nested
far deeper than Python's parser recurses, each converted or refused with a typed error that names the key."""

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import distckpt
from distckpt import CheckpointManager, CorruptCheckpointError
from distckpt.backends.leases import holder_is_dead
from distckpt.cli import main
from distckpt.convert import VALUES_KEY, _placeholders, from_safetensors, to_safetensors, to_torch_save
from distckpt.format.json_text import parse_json
from distckpt.metadata import TensorProperties, TensorStorageMetadata

DEEP = 200_000


def _empty(shape):
    return torch.empty_strided(shape, (1,) * len(shape))  # torch.empty overflows computing the strides of some


@pytest.mark.parametrize("shape", [(0, 3), (0, 2**62), (2**40, 0, 2**40), (0, 2**63 - 1)])
def test_an_empty_tensor_of_any_dims_torch_can_make_converts_to_safetensors_and_back(tmp_path, shape):
    distckpt.save({"e": _empty(shape), "w": torch.arange(4.0), "step": 3}, checkpoint_id=tmp_path / "ck")
    assert to_safetensors(tmp_path / "ck", tmp_path / "m.safetensors") == 3
    assert tuple(load_file(tmp_path / "m.safetensors")["e"].shape) == shape
    assert from_safetensors(tmp_path / "m.safetensors", tmp_path / "back") == 3
    out = {"e": _empty(shape), "w": torch.zeros(4), "step": 0}
    distckpt.load(out, checkpoint_id=tmp_path / "back")
    assert tuple(out["e"].shape) == shape and torch.equal(out["w"], torch.arange(4.0)) and out["step"] == 3


def test_an_empty_tensor_whose_strides_overflow_is_refused_by_safetensors_and_kept_by_torch_save(tmp_path):
    shape = (0, 2**62, 2**62)
    distckpt.save({"e": _empty(shape), "w": torch.arange(4.0)}, checkpoint_id=tmp_path / "ck")
    with pytest.raises(distckpt.CheckpointError, match=r"key 'e'.*\[0, 4611686018427387904, 4611686018427387904\].*torch-save"):
        to_safetensors(tmp_path / "ck", tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()
    res = CliRunner().invoke(main, ["convert", "--to", "safetensors", str(tmp_path / "ck"), str(tmp_path / "m.safetensors")])
    assert res.exit_code != 0 and "error: " in res.output and "key 'e'" in res.output and res.exception is not None
    assert isinstance(res.exception, SystemExit)  # no RuntimeError escapes
    assert to_torch_save(tmp_path / "ck", tmp_path / "m.pt") == 2
    assert tuple(torch.load(tmp_path / "m.pt")["e"].shape) == shape


def test_a_shape_torch_cannot_count_is_a_typed_error_naming_the_key():
    entry = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([2**62, 2**62, 0]), [])
    with pytest.raises(CorruptCheckpointError, match=r"checkpoint x, key 'e': shape \[4611686018427387904, 4611686018427387904, 0\]"):
        _placeholders({"e": entry}, TensorStorageMetadata, "checkpoint x", 0)


def test_values_json_nested_deeper_than_the_parser_goes_is_a_typed_error(tmp_path):
    src = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(2)}, src, metadata={"format": "pt", VALUES_KEY: "[" * DEEP + "]" * DEEP})
    with pytest.raises(CorruptCheckpointError, match=rf"m.safetensors: metadata '{VALUES_KEY}'.*nests.*too deeply"):
        from_safetensors(src, tmp_path / "out")
    res = CliRunner().invoke(main, ["convert", "--from", "safetensors", str(src), str(tmp_path / "out")])
    assert isinstance(res.exception, SystemExit) and "too deeply" in res.output
    save_file({"w": torch.ones(2)}, tmp_path / "bad.safetensors", metadata={VALUES_KEY: "{not json"})
    with pytest.raises(CorruptCheckpointError, match=f"metadata '{VALUES_KEY}': not valid JSON"):
        from_safetensors(tmp_path / "bad.safetensors", tmp_path / "out2")


def test_parse_json_turns_every_failure_into_one_typed_error():
    assert parse_json(b'{"a": [1]}', "f") == {"a": [1]}
    for raw in (b"[" * DEEP, "{\"a\":" * DEEP, b"\xff", b"{"):
        with pytest.raises(CorruptCheckpointError, match="^f: "):
            parse_json(raw, "f")


def test_a_deeply_nested_run_id_file_or_lease_record_is_handled(tmp_path):
    manager = CheckpointManager(str(tmp_path / "run"))
    manager.run_id()
    (tmp_path / "run" / "run-id.json").write_bytes(b"[" * 4096)
    with pytest.raises(CorruptCheckpointError, match="run-id.json.*remove it"):
        manager.run_id()
    assert holder_is_dead(b"[" * DEEP, 0.0) is False  # unreadable: not proven dead, and no RecursionError
