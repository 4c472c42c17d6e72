"""One rank's failure never pairs two saves: every rank fails the same save, and the next commits whole."""

import os

import pytest

import distckpt
from distckpt.testing import run_ranks

from . import in_step_workers as w

ENV = {"DISTCKPT_TIMEOUT_S": "15"}


def _check_committed(result, world_size):
    for step, got in result["committed"].items():
        assert got["step"] == step, (step, got)
        assert got["w"] == [float(step)] and got["rep"] == [float(step)] and got["shard"] == [float(step)], (step, got)


@pytest.mark.parametrize("mode", ["sync", "async", "manager", "manager-async"])
def test_failure_before_the_first_collective_fails_that_save_on_every_rank(tmp_path, mode):
    """Faults on one rank before anything is exchanged: in the caller's Stateful, in the staging allocation
    (async), in picking the storage. Every rank raises for that step, and only for it; every committed
    step holds that step's data from every rank."""
    faults_at = {2: ("state_dict", 1), 4: ("stage" if "async" in mode else "storage", 0)}
    results = run_ranks(w.faulty_steps, 2, str(tmp_path), mode, faults_at, env=ENV, timeout_s=240)
    for rank, result in enumerate(results):
        out = result["outcomes"]
        assert [s for s, o in out.items() if o == "ok"] == [1, 3, 5], (rank, out)
        assert out[2].startswith("RankFailuresError") and "rank 1" in out[2] and "state_dict of rank 1" in out[2], out[2]
        if "async" in mode:
            assert "StagingMemoryError" in out[4] and "DefaultCPUAllocator" in out[4], out[4]
        else:
            assert out[4].startswith("RankFailuresError") and ("rank 0" in out[4]), out[4]
        _check_committed(result, 2)
        for step, got in result["committed"].items():
            assert got["mine"] == [step * 10.0 + rank], (rank, step, got)
    if mode.startswith("manager"):
        assert sorted(results[0]["committed"]) == [1, 3, 5]
        assert distckpt.CheckpointManager(str(tmp_path), read_only=True).all_steps() == [1, 3, 5]
        leftovers = [n for n in os.listdir(tmp_path) if not n.startswith("step-")]
        assert not leftovers, leftovers


def test_three_ranks_async_with_manager(tmp_path):
    faults_at = {2: ("stage", 2), 3: ("state_dict", 0)}
    results = run_ranks(w.faulty_steps, 3, str(tmp_path), "manager-async", faults_at, env=ENV, timeout_s=240)
    for rank, result in enumerate(results):
        assert [s for s, o in result["outcomes"].items() if o == "ok"] == [1, 4, 5], result["outcomes"]
        _check_committed(result, 3)
        assert all(got["mine"] == [step * 10.0 + rank] for step, got in result["committed"].items())


def test_a_rank_that_skips_a_save_fails_the_mismatched_saves_instead_of_mixing_them(tmp_path):
    results = run_ranks(w.skipped_call, 2, str(tmp_path), env={"DISTCKPT_TIMEOUT_S": "8"}, timeout_s=120)
    assert results[0][1] == "ok" and results[1][1] == "ok"
    assert "out of step" in results[0][2] and "ck-3" in results[0][2], results[0][2]
    assert "out of step" in results[1][3], results[1][3]
    for step in (2, 3):
        assert not os.path.exists(tmp_path / f"ck-{step}" / ".metadata"), f"ck-{step} committed from mixed saves"


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_collective_timeout_does_not_poison_later_async_saves(tmp_path, world_size):
    """One rank's write stalls past the timeout in save 2: that save fails on every rank, every later one
    commits with its own step's data, and once the stalled save is over no call blocks near the timeout."""
    results = run_ranks(w.timeout_then_recover, world_size, str(tmp_path), 1, env={"DISTCKPT_TIMEOUT_S": "6"},
                        timeout_s=240)
    for rank, result in enumerate(results):
        out = result["outcomes"]
        assert out[2] != "ok", out
        assert all(out[s] == "ok" for s in (1, 4, 5, 6)), out
        for step, (w_values, mine) in result["values"].items():
            assert w_values == [float(step)] and mine == [step * 10.0 + rank] * 2, (step, w_values, mine)
        assert max(result["blocked"][s] for s in (5, 6)) < 4, result["blocked"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_max_in_flight_above_one_across_ranks(tmp_path, world_size):
    results = run_ranks(w.overlapping_saves, world_size, str(tmp_path), 2, env=ENV, timeout_s=180)
    for rank, result in enumerate(results):
        assert result["outcomes"] == ["ok"] * 5, result["outcomes"]
        assert result["values"] == [([float(s)], [s * 10.0 + rank] * 2) for s in range(1, 6)]


@pytest.mark.slow
@pytest.mark.parametrize("world_size,seed", [(2, 1), (3, 2), (2, 3)])
def test_randomized_fault_soak(tmp_path, world_size, seed):
    """Async saves through a manager with a random fault at a random phase on a random rank, at about every
    other step: a save with a fault never commits, one without commits, and every committed step holds
    that step's data from every rank."""
    steps = 24
    results = run_ranks(w.soak, world_size, str(tmp_path), seed, steps, env={"DISTCKPT_TIMEOUT_S": "5"}, timeout_s=900)
    plan = results[0]["plan"]
    for rank, result in enumerate(results):
        out = result["outcomes"]
        for step, (fault, where) in enumerate(plan, start=1):
            if fault == "none":
                assert out[step] == "ok", (rank, step, plan, out)
            else:
                assert out[step] != "ok", (rank, step, fault, where, out[step])
        _check_committed(result, world_size)
        for step, got in result["committed"].items():
            assert got["mine"] == [step * 10.0 + rank], (rank, step, got)
    clean = [s for s, (f, _) in enumerate(plan, start=1) if f == "none"]
    assert sorted(results[0]["committed"]) == clean[-3:]


@pytest.mark.slow
def test_randomized_fault_soak_on_s3_through_a_faulty_network(tmp_path):
    """The same soak on S3, with the network between the ranks and the store also failing now and then:
    503s on part uploads, lost answers to commits, ranged reads cut short. Those are absorbed by retries."""
    from distckpt.testing import FaultProxy, Rule

    from ..storage.s3_server import new_bucket, s3_server

    with s3_server() as endpoint, FaultProxy(endpoint) as proxy:
        import boto3

        bucket = new_bucket(boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1"))
        proxy.add(Rule("status", method="PUT", query=r"partNumber=", times=6))
        proxy.add(Rule("drop_response", method="PUT", path=r"/metadata\.json$", header="If-None-Match", times=2))
        proxy.add(Rule("reset_body", method="GET", header="Range", times=4))
        results = run_ranks(w.soak, 2, f"s3://{bucket}/soak", 5, 16,
                            env={"DISTCKPT_TIMEOUT_S": "8", "AWS_ENDPOINT_URL_S3": proxy.url}, timeout_s=900)
        assert proxy.hits("status") + proxy.hits("drop_response") + proxy.hits("reset_body") > 0
    plan = results[0]["plan"]
    for rank, result in enumerate(results):
        out = result["outcomes"]
        for step, (fault, where) in enumerate(plan, start=1):
            assert (out[step] == "ok") == (fault == "none"), (rank, step, fault, where, out[step])
        _check_committed(result, 2)
    clean = [s for s, (f, _) in enumerate(plan, start=1) if f == "none"]
    assert sorted(results[0]["committed"]) == clean[-3:]


def test_a_save_refused_on_one_rank_for_a_save_in_flight_is_refused_on_every_rank(tmp_path):
    results = run_ranks(w.busy_on_one_rank, 2, str(tmp_path), env=ENV, timeout_s=120)
    for result in results:
        assert result["second"].startswith("RankFailuresError") and "still in flight" in result["second"], result
        assert result["third"] == "ok", result
    assert not os.path.exists(tmp_path / "ck-2")


def test_no_dist_saves_and_loads_one_process_alone_in_an_initialised_group(tmp_path):
    results = run_ranks(w.no_dist_on_one_rank, 2, str(tmp_path), env={"DISTCKPT_TIMEOUT_S": "10"}, timeout_s=60)
    assert results[0] is None and results[1] == {"loaded": [6.0, 6.0, 6.0], "files": 1}
