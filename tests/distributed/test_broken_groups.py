"""Broken and out-of-step groups get typed errors: a rank whose first async_save meets another rank's save, a tiered
manager made on one rank only, and a group whose transport failed (every later call says the group must be rebuilt,
at once, with no timeout advice)."""

from distckpt.testing import run_ranks

from . import broken_group_workers as w


def test_an_async_save_meeting_a_save_fails_out_of_step_on_both_ranks_not_in_new_group(tmp_path):
    got = run_ranks(w.async_save_beside_save, 2, str(tmp_path), env={"DISTCKPT_ARRIVAL_TIMEOUT_S": "20"}, timeout_s=90)
    for rank, r in enumerate(got):
        assert r["checkpoint_error"] and "out of step" in r["message"], (rank, r)
        assert r["seconds"] < 15, r  # met at once, not after a timeout
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_tiered_manager_made_on_one_rank_fails_within_the_arrival_bound_naming_it(tmp_path):
    got = run_ranks(w.tiered_manager_on_one_rank, 2, str(tmp_path), env={"DISTCKPT_ARRIVAL_TIMEOUT_S": "3"}, timeout_s=90)
    r = got[0]
    assert r["checkpoint_error"] and "TieredCheckpointManager" in r["message"] and "every rank" in r["message"].lower(), r
    assert r["seconds"] < 15, r


def test_after_a_peer_dies_every_later_call_says_the_group_must_be_rebuilt_at_once(tmp_path):
    got = run_ranks(w.a_peer_dies_then_later_calls, 2, str(tmp_path), env={"DISTCKPT_TIMEOUT_S": "20"}, timeout_s=120,
                    allow_failures=True)
    first, *later = got[0]
    assert first["type"] is not None, first  # the save the peer died in failed
    for r in later:
        assert r["broken"] and "rebuild" in r["message"] and "ARRIVAL_TIMEOUT" not in r["message"], r
        assert r["seconds"] < 2, r
