"""Persisting from the node's tier maps each tensor of a step from its file's pages, verified, instead of loading
it into fresh host tensors: same values, no copy, a flipped bit refused; what cannot be mapped whole is loaded."""

import os

import pytest
import torch

import distckpt
from distckpt.tiers.mapped_step import map_step


def _state():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(64, 33, generator=g),
        "half": torch.randn(17, generator=g).to(torch.bfloat16),
        "ids": torch.arange(-5, 300, dtype=torch.int64),
        "mask": torch.rand(40, generator=g) > 0.5,
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(3.5),
        "layers": [torch.randn(3, 3, generator=g), torch.randn(5, generator=g)],
        "progress": {"step": 7, "name": "run-1", "lr": 1e-3},
    }


def _placeholders(obj):
    if isinstance(obj, torch.Tensor):
        return torch.empty(obj.shape, dtype=obj.dtype, device="meta")
    if isinstance(obj, dict):
        return {k: _placeholders(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_placeholders(v) for v in obj)
    return None if isinstance(obj, (int, float, str)) else obj


def _assert_same(got, want):
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    elif isinstance(want, (dict, list, tuple)):
        assert type(got) is type(want) and len(got) == len(want)
        for g, w in zip(got.values() if isinstance(want, dict) else got, want.values() if isinstance(want, dict) else want):
            _assert_same(g, w)
    else:
        assert got == want


def test_a_step_maps_whole_with_its_values_loaded(tmp_path):
    saved = _state()
    path = str(tmp_path / "step")
    distckpt.save(saved, checkpoint_id=path, no_dist=True)
    view = _placeholders(saved)
    marker = view["w"]
    dtensors = {id(marker): "the DTensor of w"}
    assert map_step(path, view, dtensors)
    _assert_same(view, saved)
    assert dtensors == {id(view["w"]): "the DTensor of w"}  # re-keyed to the tensor that replaced the placeholder
    # a view of the file's pages, not a copy: writing the file shows through (a private mapping shares the page
    # cache until written)
    first = distckpt.read_metadata(path).storage_data.items
    info = next(i for idx, i in first.items() if idx.fqn == "w")
    with open(os.path.join(path, info.file), "r+b") as f:
        f.seek(info.offset)
        f.write(torch.tensor([2.5]).numpy().tobytes())
    assert view["w"][0, 0].item() == 2.5


def test_a_flipped_bit_is_refused_naming_the_key(tmp_path):
    path = str(tmp_path / "step")
    distckpt.save(_state(), checkpoint_id=path, no_dist=True)
    info = next(i for idx, i in distckpt.read_metadata(path).storage_data.items.items() if idx.fqn == "half")
    with open(os.path.join(path, info.file), "r+b") as f:
        f.seek(info.offset + 3)
        byte = f.read(1)[0]
        f.seek(info.offset + 3)
        f.write(bytes([byte ^ 0x10]))
    with pytest.raises(distckpt.CorruptCheckpointError, match=r"'half'.*fail their checksum"):
        map_step(path, _placeholders(_state()), {})


@pytest.mark.parametrize("case", ["tuple", "other shape", "other dtype"])
def test_what_cannot_be_mapped_whole_changes_nothing(tmp_path, case):
    saved = _state()
    if case == "tuple":
        saved["layers"] = tuple(saved["layers"])
    path = str(tmp_path / "step")
    distckpt.save(saved, checkpoint_id=path, no_dist=True)
    view = _placeholders(saved)
    if case == "other shape":
        view["w"] = torch.empty(33, 64, device="meta")
    elif case == "other dtype":
        view["w"] = torch.empty(64, 33, dtype=torch.float64, device="meta")
    before = {k: v for k, v in view.items()}
    assert not map_step(path, view, {})
    assert all(view[k] is before[k] for k in view) and view["w"].device.type == "meta"


def _persist_job(rank, world_size, root):
    os.environ["DISTCKPT_NODE_ID"] = "node0"
    local = os.path.join(root, "node0")
    mgr = distckpt.TieredCheckpointManager(os.path.join(root, "durable"), local=local, replicas=0, persist_every=0)
    state = _state()
    mgr.save(1, state)
    mgr.wait()
    own = os.path.join(mgr.own_dir, "step-1")
    info = next(i for idx, i in distckpt.read_metadata(own).storage_data.items.items() if idx.fqn == "w")
    with open(os.path.join(own, info.file), "r+b") as f:  # a bit flips in the node's memory
        f.seek(info.offset + 100)
        byte = f.read(1)[0]
        f.seek(info.offset + 100)
        f.write(bytes([byte ^ 1]))
    error = None
    try:
        mgr.persist(1)
    except distckpt.CheckpointError as exc:
        error = str(exc)
    durable_after_flip = mgr.durable.all_steps()
    state["w"].add_(1)
    state["progress"]["step"] = 8
    mgr.save(2, state)
    mgr.persist(2)
    back = _state()
    back["w"].zero_()
    back["progress"]["step"] = 0
    mgr.durable.load(back)
    mgr.close()
    return {"error": error, "durable_after_flip": durable_after_flip, "w": torch.equal(back["w"], state["w"]),
            "step": back["progress"]["step"], "ids": torch.equal(back["ids"], state["ids"])}


def test_persist_writes_the_tier_s_step_and_refuses_a_damaged_one(tmp_path):
    from distckpt.testing import run_ranks

    (out,) = run_ranks(_persist_job, 1, str(tmp_path), timeout_s=120)
    assert out["error"] and "'w'" in out["error"] and "fail their checksum" in out["error"], out
    assert out["durable_after_flip"] == []
    assert out["w"] and out["ids"] and out["step"] == 8, out
