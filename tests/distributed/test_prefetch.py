"""Prefetch at several ranks: each rank reads ahead on its own (no collective), and the load takes the bytes from
memory; ranks that did not prefetch, or prefetched less, read the rest as usual."""

from __future__ import annotations

from distckpt.testing import run_ranks

from . import prefetch_workers as workers


def test_ranks_that_prefetched_their_own_files_read_only_the_rest_at_the_load(tmp_path):
    """A restart at the world size that saved: each rank prefetches the files it wrote, and the load reads from
    storage only what it needs of the other rank's file (the replicated keys stored there)."""
    root = str(tmp_path)
    run_ranks(workers.save_mixed, 2, root)
    alone = run_ranks(workers.load_after_prefetch, 2, root, [], False)
    ahead = run_ranks(workers.load_after_prefetch, 2, root, [0, 1], False)
    assert all(r["exact"] for r in alone + ahead), (alone, ahead)
    assert all(r["held"] > 0 for r in ahead), ahead
    before, after, held = (sum(r[k] for r in rs) for rs, k in ((alone, "read"), (ahead, "read"), (ahead, "held")))
    assert abs(after - (before - held)) <= 0.02 * before, (alone, ahead)  # every prefetched byte saved a read


def test_a_prefetch_given_the_state_dict_serves_its_rank_and_only_one_rank_need_prefetch(tmp_path):
    root = str(tmp_path)
    run_ranks(workers.save_mixed, 2, root)
    results = run_ranks(workers.load_after_prefetch, 2, root, [1], True, timeout_s=120)
    assert all(r["exact"] for r in results), results
    assert results[0]["held"] == 0 and results[1]["held"] > 0, results
    assert results[1]["read"] < 16 << 10, results  # headers at most: what it loads came from memory
