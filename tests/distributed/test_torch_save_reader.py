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


def _load_two_batches(rank, world_size, path):
    out = {"a": torch.zeros(256, 1024), "b": torch.zeros(256, 1024)}
    try:
        distckpt.load(out, planner=DynamicMetaLoadPlanner(), storage_reader=BroadcastingTorchSaveReader(), checkpoint_id=path)
    except distckpt.CheckpointError as exc:
        return type(exc).__name__, str(exc), bool(out["a"].eq(1.0).all())
    return "loaded", "", bool(out["a"].eq(1.0).all())


def test_a_damaged_tensor_in_a_later_batch_fails_every_rank_without_a_hang(tmp_path):
    """The coordinator reads a batch of keys at a time (half the memory budget): one that fails its CRC after
    others were delivered still raises on every rank, and no rank waits for a broadcast that never comes."""
    import io

    buf = io.BytesIO()
    torch.save({"a": torch.ones(256, 1024), "b": torch.full((256, 1024), 2.0)}, buf)
    data = bytearray(buf.getvalue())
    data[data.find(torch.full((16,), 2.0).numpy().tobytes()) + 1000] ^= 0x10  # inside b's record
    path = tmp_path / "m.pt"
    path.write_bytes(bytes(data))
    per_rank = run_ranks(_load_two_batches, 2, str(path), timeout_s=60, env={"DISTCKPT_MEMORY_BUDGET_BYTES": str(2 << 20)})
    # every rank raises the error that names each rank's: the coordinator's CRC failure, and the others' word of it
    assert all(r[0] == "RankFailuresError" and "fails its CRC-32" in r[1] for r in per_rank), per_rank
    assert all("rank 1: CheckpointError" in r[1] and "coordinator (rank 0) could not read" in r[1] for r in per_rank)
    assert all(r[2] for r in per_rank)  # the batch before it was delivered


def test_torch_save_reader_reads_lists_of_tensors(tmp_path):
    """Each rank's own reads (TorchSaveReader) find tensors kept in lists, as the state dict flattens them."""
    path = str(tmp_path / "model.pt")
    torch.save(_model_state(), path)
    out = {"model": {"w": torch.zeros(6, 4), "b": torch.zeros(4, dtype=torch.bfloat16)},
           "layers": [torch.zeros(5), torch.zeros(2, 2)]}
    distckpt.load(out, checkpoint_id=path, no_dist=True)
    want = _model_state()
    assert all(torch.equal(a, b) for a, b in zip(out["layers"], want["layers"]))
    assert torch.equal(out["model"]["w"], want["model"]["w"])
