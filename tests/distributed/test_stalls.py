"""No silent hangs: a rank stopped (SIGSTOP) at any phase of a load makes every other rank raise a
CheckpointError within the bound, naming the stopped rank and the phase."""

import pytest

from distckpt.testing import RankFailure, run_ranks

from . import stall_workers as w

TIMEOUT_S = 5
# the bound, the grace in which the live ranks report failing (2 s at this timeout; up to 5 s where the store
# does not answer), and slack for 8 ranks on 2 cores
LIMIT_S = TIMEOUT_S + 2 + 8


def _check(results, phase: str, victim: int) -> None:
    assert isinstance(results[victim], RankFailure) and results[victim].exitcode == 0, results[victim]
    names = w.PHASES[phase][2]
    for rank, got in enumerate(results):
        if rank == victim:
            continue
        kind, message, seconds, typed = got
        assert typed, (rank, kind, message)
        assert f"rank {victim}" in message or f"ranks {victim}" in message, (rank, message)
        assert names in message, (rank, message)
        assert seconds < LIMIT_S, (rank, seconds, message)


def _run(phase: str, world_size: int, victim: int, root, store_on_rank_0: bool = False):
    # shared reads on one node too (auto leaves them to the page cache), so that the exchange phase runs
    env = {"DISTCKPT_TIMEOUT_S": str(TIMEOUT_S), "DISTCKPT_ARRIVAL_TIMEOUT_S": str(TIMEOUT_S), "DISTCKPT_SHARED_READS": "1"}
    return run_ranks(w.stall_at, world_size, str(root), phase, victim, env=env, timeout_s=240, allow_failures=True,
                     store_on_rank_0=store_on_rank_0)


def test_a_rank_stopped_at_the_plan_vote_is_named_by_the_others(tmp_path):
    _check(_run("plan vote", 4, 2, tmp_path), "plan vote", 2)


@pytest.mark.slow
@pytest.mark.parametrize("phase", list(w.PHASES))
def test_a_rank_stopped_at_any_phase_is_named_at_8_ranks(tmp_path, phase):
    victim = 1 + list(w.PHASES).index(phase) % 7
    _check(_run(phase, 8, victim, tmp_path), phase, victim)


@pytest.mark.slow
def test_a_stopped_rank_0_is_named_as_the_silent_store_host_at_8_ranks(tmp_path):
    """Where rank 0 hosts the group's store too (init_method="tcp://" without torchrun's agent), the others cannot
    take a census, and say that its host is stalled."""
    results = _run("plan vote", 8, 0, tmp_path, store_on_rank_0=True)
    _check(results, "plan vote", 0)
    assert all("store did not answer" in r[1] for r in results[1:]), results
