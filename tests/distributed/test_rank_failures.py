"""Every rank learns what each failing rank raised, as the exception itself: a ValueError raised by a storage
layer on rank 2 is a ValueError in ``failures[2][0]`` on every rank, in each phase of a save and of a load."""

import pytest
import torch

import distckpt
from distckpt.distributed import describe, rebuild
from distckpt.testing import run_ranks

from . import faulty_storage as faulty

SAVE_CASES = [(0, None, [])] + [(0, phase, [rank]) for phase, rank in zip(faulty.SAVE_PHASES, [0, 1, 0, 2, 3, 0])] + [
    (1, "set_up_storage_writer", [1]), (1, "finish", [1]), (2, "prepare_local_plan", [0, 3])]
LOAD_CASES = [(0, None, [])] + [(0, phase, [rank]) for phase, rank in zip(faulty.LOAD_PHASES, [0, 0, 1, 0, 3, 1])] + [
    (3, "set_up_storage_reader", [0]), (1, "read_metadata", [3]), (2, "read_data", [0]), (3, "read_data_async", [2]),
    (1, "prepare_global_plan", [1])]


def _check(cases, results_per_rank):
    for rank, results in enumerate(results_per_rank):
        for (coordinator, phase, failing), got in zip(cases, results):
            where = f"rank {rank}, coordinator {coordinator}, {phase} failing on {failing}"
            if not failing:
                assert got is None, where
                continue
            assert got is not None and got["error"] == "CheckpointException", (where, got)
            if phase in ("prepare_global_plan", "finish"):  # only the coordinator runs these
                failing = [coordinator] if coordinator in failing else []
            assert sorted(got["failures"]) == failing, (where, got)
            assert set(got["failures"].values()) == {"ValueError"}, (where, got)
            assert all(f"injected failure of {phase} on rank {r}" == got["texts"][r] for r in failing), (where, got)
            assert got["stack_named_phase"], where


@pytest.mark.parametrize("kind,cases", [("save", SAVE_CASES), ("load", LOAD_CASES)])
def test_each_phase_failure_reaches_every_rank_with_its_type(kind, cases):
    # a phase only the coordinator runs can only fail there: keep the cases whose failing ranks make sense
    runnable = [c for c in cases if c[1] not in ("prepare_global_plan", "finish") or c[0] in c[2]]
    _check(runnable, run_ranks(faulty.run_cases, 4, kind, runnable, timeout_s=240))


@pytest.mark.parametrize("kind,phases", [("save", faulty.SAVE_PHASES), ("load", faulty.LOAD_PHASES)])
def test_no_dist_failures_are_checkpoint_exceptions_too(kind, phases):
    cases = [(0, None, [])] + [(0, phase, [0]) for phase in phases]
    _check(cases, [faulty.run_cases(0, 1, kind, cases)])


def test_caught_by_the_failing_type_when_every_rank_raised_the_same_checkpoint_error(tmp_path):
    distckpt.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "ck")
    with pytest.raises(distckpt.MissingKeyError) as info:
        distckpt.load({"w": torch.zeros(2), "nope": torch.zeros(1)}, checkpoint_id=tmp_path / "ck")
    assert isinstance(info.value, distckpt.CheckpointException)
    assert type(info.value.failures[0][0]) is distckpt.MissingKeyError
    assert "'nope'" in str(info.value)


class _ForeignError(Exception):
    pass


def test_a_type_outside_the_allowlist_arrives_as_remote_rank_error_naming_it():
    try:
        raise _ForeignError("not rebuilt here")
    except _ForeignError as exc:
        info = describe(exc)
    got = rebuild(info)
    assert type(got.exception) is distckpt.RemoteRankError
    assert got.exception.type_name.endswith("_ForeignError") and str(got.exception) == "not rebuilt here"
    assert got.traceback[-1].name == "test_a_type_outside_the_allowlist_arrives_as_remote_rank_error_naming_it"
    # allowlisted types come back as themselves, with their arguments
    back = rebuild(describe(OSError(28, "No space left on device"))).exception
    assert type(back) is OSError and back.errno == 28
    # a description naming an importable but unlisted type does not construct it
    forged = dict(describe(ValueError("x")), module="os", type="system")
    assert type(rebuild(forged).exception) is distckpt.RemoteRankError


def _only_rank_zero_calls(rank, world_size, path, op):
    import time

    if rank != 0:
        time.sleep(6)  # busy elsewhere (training): never calls save or load
        return None
    start = time.monotonic()
    try:
        if op == "save":
            distckpt.save({"w": torch.ones(3)}, checkpoint_id=path)
        else:
            distckpt.load({"w": torch.ones(3)}, checkpoint_id=path)
    except distckpt.CheckpointError as exc:
        return str(exc), time.monotonic() - start
    return "returned", 0.0


@pytest.mark.parametrize("op", ["save", "load"])
def test_a_save_or_load_only_one_rank_calls_fails_within_the_arrival_bound(tmp_path, op):
    path = str(tmp_path / "ck")
    distckpt.save({"w": torch.zeros(3)}, checkpoint_id=path, no_dist=True) if op == "load" else None
    got = run_ranks(_only_rank_zero_calls, 2, path, op, env={"DISTCKPT_ARRIVAL_TIMEOUT_S": "3"}, timeout_s=60)
    text, seconds = got[0]
    assert f"every rank of the group must call {op}" in text.lower() and "no_dist=True" in text, text
    assert seconds < 15, seconds
    if op == "save":
        assert not (tmp_path / "ck").exists()  # nothing was written
