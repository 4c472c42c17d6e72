"""bench/load_planning.py runs end to end at a small size: both states, every column filled."""

from bench import load_planning


def test_the_load_planning_bench_times_every_step(capsys):
    rows = load_planning.main(["--ranks", "64", "--keys", "200", "--sharded-keys", "20", "--repeat", "1"])
    assert [(r["state"], r["ranks"]) for r in rows] == [("replicated", 64), ("mixed", 64)]
    for r in rows:
        assert all(r[c] > 0 for c in ("parse_s", "local_plan_s", "table_s", "assign_s", "decode_s")), r
        # the replicated keys are listed (another rank needs them too); the sharded ones, read whole, are not
        assert r["listed_chunks"] == (200 if r["state"] == "replicated" else 20), r
        assert 0 < r["messages"] <= r["ranks"], r  # each rank reads at most one run of chunks for all the others
    assert "gathered MB" in capsys.readouterr().out
