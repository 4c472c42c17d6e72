"""Conversion to and from DCP, safetensors files and torch.save files, through the API and the command line."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner

import distckpt
from distckpt.cli import main
from distckpt.convert import from_dcp, from_safetensors, from_torch_save, to_dcp, to_safetensors, to_torch_save
from distckpt.testing.states import assert_same, blank_like, seeded

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP, run in one process


def _state():
    model = seeded({"layers.0.w": (6, 5), "emb": (4, 3)}, seed=3)
    model["emb"] = model["emb"].to(torch.bfloat16)
    return {"model": model, "optim": {"step": 12, "lr": 0.5, "name": "adamw", "ids": torch.arange(7)}}


def test_dcp_to_distckpt_and_back_is_exact(tmp_path):
    want = _state()
    dcp.save(want, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert from_dcp(tmp_path / "dcp", tmp_path / "ours") == 6  # read safely: no trust needed
    distckpt.verify(tmp_path / "ours")
    got = blank_like(want)
    distckpt.load(got, checkpoint_id=tmp_path / "ours")
    assert_same(got, want)
    assert to_dcp(tmp_path / "ours", tmp_path / "dcp2") == 6
    again = blank_like(want)
    dcp.load(again, checkpoint_id=str(tmp_path / "dcp2"), no_dist=True)
    assert_same(again, want)


def test_convert_command(tmp_path):
    want = _state()
    distckpt.save(want, checkpoint_id=tmp_path / "ours")
    runner = CliRunner()
    res = runner.invoke(main, ["convert", "--to-dcp", str(tmp_path / "ours"), str(tmp_path / "dcp")])
    assert res.exit_code == 0 and "6 keys" in res.output, res.output
    got = blank_like(want)
    dcp.load(got, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert_same(got, want)
    res = runner.invoke(main, ["convert", "--from-dcp", str(tmp_path / "dcp"), str(tmp_path / "back")])
    assert res.exit_code == 0, res.output
    res = runner.invoke(main, ["convert", "--from-dcp", "--trust-pickle", str(tmp_path / "dcp"), str(tmp_path / "back")])
    assert res.exit_code == 4 and "already exists" in res.output  # never replaces a committed checkpoint
    res = runner.invoke(main, ["convert", str(tmp_path / "dcp"), str(tmp_path / "x")])
    assert res.exit_code == 2
    res = runner.invoke(main, ["convert", "--from-dcp", "--trust-pickle", str(tmp_path / "nothing"), str(tmp_path / "y")])
    assert res.exit_code == 3 and "no DCP checkpoint" in res.output


def _flat(sd, prefix=""):
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_safetensors_round_trip_consolidates_shards_and_keeps_values(tmp_path):
    from safetensors.torch import load_file

    want = _state()
    want["optim"]["blob"] = b"\x00\xff"
    want["optim"]["pair"] = (1, float("inf"))
    distckpt.save(want, checkpoint_id=tmp_path / "ours")
    assert to_safetensors(tmp_path / "ours", tmp_path / "m.safetensors") == 8
    tensors = load_file(str(tmp_path / "m.safetensors"))  # an ordinary safetensors file
    flat = _flat(want)
    assert tensors.keys() == {k for k, v in flat.items() if isinstance(v, torch.Tensor)}
    for k, t in tensors.items():
        assert_same(flat[k], t, k)
    with pytest.raises(distckpt.CheckpointError, match="already exists"):
        to_safetensors(tmp_path / "ours", tmp_path / "m.safetensors")
    assert from_safetensors(tmp_path / "m.safetensors", tmp_path / "back") == 8
    got = blank_like(want)
    distckpt.load(got, checkpoint_id=tmp_path / "back")
    assert_same(got, want)


def test_a_plain_safetensors_file_converts(tmp_path):
    from safetensors.torch import save_file

    save_file({"a.w": torch.ones(3, 2), "b": torch.arange(4, dtype=torch.int16)}, str(tmp_path / "hf.safetensors"))
    assert from_safetensors(tmp_path / "hf.safetensors", tmp_path / "ck") == 2
    got = {"a": {"w": torch.zeros(3, 2)}, "b": torch.zeros(4, dtype=torch.int16)}
    distckpt.load(got, checkpoint_id=tmp_path / "ck")
    assert torch.equal(got["a"]["w"], torch.ones(3, 2)) and torch.equal(got["b"], torch.arange(4, dtype=torch.int16))
    (tmp_path / "junk.safetensors").write_bytes(b"\x08" + bytes(20))
    with pytest.raises(distckpt.CorruptCheckpointError, match="junk.safetensors"):
        from_safetensors(tmp_path / "junk.safetensors", tmp_path / "j")


def test_torch_save_round_trip_and_unsafe_files_are_refused(tmp_path):
    want = _state()
    torch.save(want, tmp_path / "model.pt")
    assert from_torch_save(tmp_path / "model.pt", tmp_path / "ours") == 6  # the keys stored: each leaf of a nested dict
    got = blank_like(want)
    distckpt.load(got, checkpoint_id=tmp_path / "ours")
    assert_same(got, want)
    assert to_torch_save(tmp_path / "ours", tmp_path / "flat.pt") == 6
    flat = torch.load(tmp_path / "flat.pt", weights_only=True)
    assert_same(flat, _flat(want))

    torch.save({"w": torch.ones(1), "f": _Unsafe()}, tmp_path / "unsafe.pt")
    with pytest.raises(distckpt.CheckpointError, match="does not unpickle it"):
        from_torch_save(tmp_path / "unsafe.pt", tmp_path / "u")
    torch.save([torch.ones(1)], tmp_path / "list.pt")
    with pytest.raises(distckpt.CheckpointError, match="not a dict"):
        from_torch_save(tmp_path / "list.pt", tmp_path / "l")


class _Unsafe:
    pass


def test_convert_command_other_formats(tmp_path):
    want = _state()
    distckpt.save(want, checkpoint_id=tmp_path / "ours")
    runner = CliRunner()
    res = runner.invoke(main, ["convert", "--to", "safetensors", str(tmp_path / "ours"), str(tmp_path / "m.safetensors")])
    assert res.exit_code == 0 and "6 keys" in res.output, res.output
    res = runner.invoke(main, ["convert", "--from", "safetensors", str(tmp_path / "m.safetensors"), str(tmp_path / "b1")])
    assert res.exit_code == 0, res.output
    res = runner.invoke(main, ["convert", "--to", "torch-save", str(tmp_path / "b1"), str(tmp_path / "m.pt")])
    assert res.exit_code == 0, res.output
    res = runner.invoke(main, ["convert", "--from", "torch-save", str(tmp_path / "m.pt"), str(tmp_path / "b2")])
    assert res.exit_code == 0, res.output
    got = blank_like(want)
    distckpt.load(got, checkpoint_id=tmp_path / "b2")
    assert_same(got, want)
    res = runner.invoke(main, ["convert", "--to", "dcp", "--from", "dcp", str(tmp_path / "b2"), str(tmp_path / "x")])
    assert res.exit_code == 2
    res = runner.invoke(main, ["convert", "--from", "torch-save", str(tmp_path / "missing.pt"), str(tmp_path / "y")])
    assert res.exit_code == 3 and "does not exist" in res.output


def _optimizer_layout(fill):
    """torch's get_state_dict layout: param groups are a list of dicts of plain values."""
    return {"model": {"w": torch.full((4, 3), float(fill))},
            "optim": {"state": {"w": {"exp_avg": torch.full((4, 3), fill + 0.5), "step": torch.tensor(float(fill))}},
                      "param_groups": [{"lr": 0.01 * fill, "betas": (0.9, 0.99), "params": ["w"]}]}}


def test_a_dcp_checkpoint_of_the_get_state_dict_layout_loads_directly_and_converted(tmp_path):
    dcp.save(_optimizer_layout(3), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)  # DCP flattens the param groups
    direct = _optimizer_layout(0)
    distckpt.load(direct, checkpoint_id=tmp_path / "dcp")
    assert from_dcp(tmp_path / "dcp", tmp_path / "ours") == 4  # the keys stored: param_groups is one
    assert "optim.param_groups" in distckpt.read_metadata(tmp_path / "ours").state_dict_metadata  # nested again
    converted = _optimizer_layout(0)
    distckpt.load(converted, checkpoint_id=tmp_path / "ours")
    for got in (direct, converted):
        assert got["optim"]["param_groups"] == [{"lr": 0.03, "betas": (0.9, 0.99), "params": ["w"]}]
        assert torch.equal(got["optim"]["state"]["w"]["exp_avg"], torch.full((4, 3), 3.5))
        assert torch.equal(got["model"]["w"], torch.full((4, 3), 3.0)) and got["optim"]["state"]["w"]["step"].item() == 3.0


def test_an_existing_destination_is_refused_before_anything_is_read(tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("mine")
    (tmp_path / "taken.pt").write_bytes(b"mine")
    for convert_call in (lambda: from_torch_save(tmp_path / "huge-and-missing.pt", taken),
                         lambda: from_dcp(tmp_path / "huge-and-missing", taken),
                         lambda: to_torch_save(tmp_path / "huge-and-missing", tmp_path / "taken.pt"),
                         lambda: to_safetensors(tmp_path / "huge-and-missing", tmp_path / "taken.pt")):
        with pytest.raises(distckpt.CheckpointError, match="already exists"):
            convert_call()
    assert (taken / "x").read_text() == "mine" and (tmp_path / "taken.pt").read_bytes() == b"mine"


def test_a_dcp_folder_is_named_by_inspect_and_a_sharded_hf_checkpoint_by_convert(tmp_path):
    dcp.save({"w": torch.ones(3), "n": 2}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    res = CliRunner().invoke(main, ["inspect", str(tmp_path / "dcp")])
    assert res.exit_code == 0 and "DCP checkpoint" in res.output and "reads it directly" in res.output
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"a": torch.ones(2)}, str(hf / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.ones(2)}, str(hf / "model-00002-of-00002.safetensors"))
    (hf / "model.safetensors.index.json").write_text('{"metadata": {}, "weight_map": {}}')
    for src in (hf, hf / "model.safetensors.index.json"):
        res = CliRunner().invoke(main, ["convert", "--from", "safetensors", str(src), str(tmp_path / "out")])
        text = " ".join(res.output.split())
        assert res.exit_code == 4 and "Hugging Face" in text and "--from hf" in text, res.output
    assert not (tmp_path / "out").exists()


def test_read_whole_rebuilds_dicts_keyed_by_int_and_lists_exactly(tmp_path):
    from distckpt.convert import read_whole

    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optim.step()
    sd = {"optim": optim.state_dict(), "layers": [torch.ones(2), {"w": torch.zeros(1)}], "n": 3}
    distckpt.save(sd, checkpoint_id=tmp_path / "ck")
    back = read_whole(tmp_path / "ck")
    assert sorted(back["optim"]["state"]) == [0, 1]  # int keys of a dict, not a list
    assert isinstance(back["optim"]["param_groups"], list) and back["optim"]["param_groups"][0]["params"] == [0, 1]
    assert isinstance(back["layers"], list) and torch.equal(back["layers"][1]["w"], torch.zeros(1)) and back["n"] == 3
    fresh = torch.optim.AdamW(model.parameters())
    fresh.load_state_dict(back["optim"])
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], sd["optim"]["state"][0]["exp_avg"])
