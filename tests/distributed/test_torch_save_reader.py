"""DCP's BroadcastingTorchSaveReader and DynamicMetaLoadPlanner: a torch.save file loads straight into a state
dict, in one process and into DTensor shards at 2 ranks (the coordinator reads, the others receive)."""

import pytest
import torch

import distckpt
from distckpt.format_utils import BroadcastingTorchSaveReader, DynamicMetaLoadPlanner
from distckpt.testing import run_ranks


def _model_state():
    g = torch.Generator().manual_seed(3)
    return {"model": {"w": torch.randn(6, 4, generator=g), "b": torch.randn(4, generator=g).to(torch.bfloat16)},
            "layers": [torch.arange(5.0), torch.ones(2, 2)]}


def test_a_torch_save_file_loads_in_one_process(tmp_path):
    path = str(tmp_path / "model.pt")
    torch.save(_model_state(), path)
    out = {"model": {"w": torch.zeros(6, 4), "b": torch.zeros(4, dtype=torch.bfloat16)},
           "layers": [torch.zeros(5), torch.zeros(2, 2)]}
    distckpt.load(out, planner=DynamicMetaLoadPlanner(), storage_reader=BroadcastingTorchSaveReader(), checkpoint_id=path)
    want = _model_state()
    assert torch.equal(out["model"]["w"], want["model"]["w"]) and torch.equal(out["model"]["b"], want["model"]["b"])
    assert all(torch.equal(a, b) for a, b in zip(out["layers"], want["layers"]))


def test_a_missing_key_or_a_value_is_a_typed_error(tmp_path):
    path = str(tmp_path / "model.pt")
    torch.save(_model_state(), path)
    extra = {"model": {"w": torch.zeros(6, 4), "gone": torch.zeros(1)}}
    with pytest.raises(distckpt.CheckpointError, match="'model.gone'.*Missing key in checkpoint"):
        distckpt.load(extra, planner=DynamicMetaLoadPlanner(), storage_reader=BroadcastingTorchSaveReader(path))
    with pytest.raises(distckpt.CheckpointError, match="'step'.*loads tensors only"):
        distckpt.load({"step": 3}, planner=DynamicMetaLoadPlanner(), storage_reader=BroadcastingTorchSaveReader(path))
    with pytest.raises(distckpt.CheckpointError, match="Size mismatch"):
        distckpt.load({"model": {"w": torch.zeros(3, 4)}}, planner=DynamicMetaLoadPlanner(),
                      storage_reader=BroadcastingTorchSaveReader(path))


def _load_sharded(rank, world_size, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    out = {"model": {"w": distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)]),
                     "b": distribute_tensor(torch.zeros(4, dtype=torch.bfloat16), mesh, [Shard(0)])},
           "layers": [torch.zeros(5), torch.zeros(2, 2)]}
    distckpt.load(out, planner=DynamicMetaLoadPlanner(), storage_reader=BroadcastingTorchSaveReader(), checkpoint_id=path)
    want = _model_state()
    return (torch.equal(out["model"]["w"].full_tensor(), want["model"]["w"])
            and torch.equal(out["model"]["b"].full_tensor(), want["model"]["b"])
            and all(torch.equal(a, b) for a, b in zip(out["layers"], want["layers"])))


def test_the_coordinator_reads_and_every_rank_gets_its_shard(tmp_path):
    path = str(tmp_path / "model.pt")
    torch.save(_model_state(), path)
    assert run_ranks(_load_sharded, 2, path) == [True, True]


def _load_missing(rank, world_size, path):
    try:
        distckpt.load({"model": {"w": torch.zeros(6, 4), "gone": torch.zeros(2)}}, planner=DynamicMetaLoadPlanner(),
                      storage_reader=BroadcastingTorchSaveReader(), checkpoint_id=path)
    except distckpt.CheckpointError as exc:
        return "Missing key in checkpoint" in str(exc)
    return False


def test_when_the_coordinator_cannot_serve_every_rank_raises_instead_of_waiting(tmp_path):
    path = str(tmp_path / "model.pt")
    torch.save(_model_state(), path)
    assert run_ranks(_load_missing, 2, path, timeout_s=60) == [True, True]
