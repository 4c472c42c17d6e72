import os

import torch

import distckpt
from distckpt.testing import run_ranks

from . import workers


def test_ddp_load_balancing_planner_spreads_items_over_ranks(tmp_path):
    path = str(tmp_path / "ck")
    states = run_ranks(workers.ddp_balanced_save, 2, path)
    md = distckpt.read_metadata(path)
    files = {si.file for si in md.storage_data.items.values()}
    assert len(files) == 2
    sd = {"model." + k: torch.zeros_like(v) for k, v in states[0].items()}
    distckpt.load(sd, checkpoint_id=path)
    for k, v in states[0].items():
        assert torch.equal(sd["model." + k], v)


def test_rank_local_values_keep_each_ranks_copy(tmp_path):
    results = run_ranks(workers.rank_local_roundtrip, 3, str(tmp_path / "ck"))
    assert results == [[0, 0, 0], [1, 1, 1], [2, 2, 2]]
    md = distckpt.read_metadata(tmp_path / "ck")
    assert {k for k in md.state_dict_metadata if k.startswith("rng")} == {"rng@rank0", "rng@rank1", "rng@rank2"}


def test_inconsistent_replicas_are_an_error_not_a_silent_pick(tmp_path):
    results = run_ranks(workers.mismatched_replicas, 2, str(tmp_path / "ck"))
    for text in results:
        assert text is not None and "RankLocal" in text and "'w'" in text


def test_sharded_parameters_with_gradients_save_and_load_in_place(tmp_path):
    assert run_ranks(workers.dtensor_parameters_with_grads, 2, str(tmp_path / "ck")) == [[True, True, True]] * 2


def test_async_save_across_ranks_with_training_collectives(tmp_path):
    assert run_ranks(workers.async_sharded_save, 2, str(tmp_path / "ck")) == [True, True]


def test_a_plain_key_on_one_rank_cannot_forge_another_ranks_rank_local_value(tmp_path):
    path = str(tmp_path / "ck")
    results = run_ranks(workers.forged_rank_local_name, 2, path)
    assert all(r is not None and r[0] == "RankFailuresError" for r in results), results
    assert all("ends like the stored name of a RankLocal" in r[1] and "rank 1" in r[1] for r in results)
    assert not os.path.exists(path)
