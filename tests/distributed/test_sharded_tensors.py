"""ShardedTensors (FSDP1's SHARDED_STATE_DICT) and DTensors on a sub-mesh save and load with resharding, across
real processes: shards become chunks, and a rank outside a DTensor's mesh simply holds no shard."""

import warnings

import pytest
import torch

import distckpt
from distckpt.default_planner import _create_default_local_metadata
from distckpt.testing import run_ranks

from . import sharded_workers as w


@pytest.fixture(autouse=True)
def _quiet_deprecations():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield


def test_fsdp1_sharded_state_dict_round_trip_resharding_to_one_and_three_ranks(tmp_path):
    path = str(tmp_path / "ck")
    expected = run_ranks(w.fsdp1_save, 2, path, timeout_s=240)[0]
    md = distckpt.read_metadata(path)
    assert len(md.state_dict_metadata["model.0.weight"].chunks) == 2  # each rank's shard is a chunk
    for got in run_ranks(w.fsdp1_load, 3, path, timeout_s=240):
        assert got.keys() == expected.keys()
        for k in expected:
            assert torch.equal(got[k], expected[k]), k
    plain = {k: torch.zeros_like(v) for k, v in expected.items()}
    distckpt.load({"model": plain}, checkpoint_id=path)  # one rank, plain tensors
    for k in expected:
        assert torch.equal(plain[k], expected[k]), k


@pytest.mark.parametrize("saved,loaded,save_ranks,load_ranks", [
    ("rows", "cols", 2, 3),       # row-wise chunks into column-wise
    ("rows", "uneven", 2, 3),     # into another shard plan: uneven blocks, two on one rank
    ("uneven", "cols", 3, 2),
    ("uneven", "dtensor", 2, 3),  # ShardedTensor into DTensor
    ("dtensor", "uneven", 3, 2),  # and back
])
def test_sharded_tensor_reshards_to_other_plans_and_world_sizes(tmp_path, saved, loaded, save_ranks, load_ranks):
    path = str(tmp_path / "ck")
    run_ranks(w.save_sharded_tensor, save_ranks, path, saved)
    assert run_ranks(w.load_sharded_tensor, load_ranks, path, loaded) == [True] * load_ranks
    out = {"st": torch.zeros(24, 10)}
    distckpt.load(out, checkpoint_id=path, planner=distckpt.DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(out["st"], w.FULL)


def test_async_save_of_a_sharded_tensor_copies_every_local_shard(tmp_path):
    path = str(tmp_path / "ck")
    run_ranks(w.async_save_sharded_tensor, 2, path)
    out = {"st": torch.zeros(24, 10)}
    distckpt.load(out, checkpoint_id=path)
    assert torch.equal(out["st"], w.FULL)


def test_metadata_of_a_sharded_tensor_lists_every_shard_of_the_spec():
    """DCP's local-metadata helper describes the whole ShardedTensor, also from one process."""
    results = run_ranks(_metadata_chunks, 2)
    assert results == [[[0, 0], [12, 0]]] * 2


def _metadata_chunks(rank, world_size):
    from torch.distributed._shard import sharded_tensor

    warnings.filterwarnings("ignore", category=FutureWarning)
    md = _create_default_local_metadata({"st": sharded_tensor.zeros(w.chunk_spec(world_size, 0), 24, 10)})
    return [list(c.offsets) for c in md.state_dict_metadata["st"].chunks]


def test_dtensors_on_sub_meshes_of_four_ranks(tmp_path):
    path = str(tmp_path / "ck")
    assert run_ranks(w.submesh_save, 4, path, timeout_s=240) == [True] * 4
    md = distckpt.read_metadata(path)
    assert [list(c.offsets) for c in md.state_dict_metadata["a"].chunks] == [[0, 0], [12, 0]]
    assert [list(c.offsets) for c in md.state_dict_metadata["b"].chunks] == [[0, 0], [0, 12]]
    assert run_ranks(w.submesh_load, 4, path, timeout_s=240) == [True] * 4
    out = {"a": torch.zeros(24, 10), "b": torch.zeros(10, 24), "r": torch.zeros(3)}
    distckpt.load(out, checkpoint_id=path, planner=distckpt.DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(out["a"], w.FULL) and torch.equal(out["b"], w.FULL.t()) and torch.equal(out["r"], torch.ones(3))
