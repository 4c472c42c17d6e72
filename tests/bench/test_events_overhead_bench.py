"""A tiny run of bench/events_overhead.py, so that it cannot rot: both arms timed, the ratio reported."""

from bench import events_overhead


def test_events_overhead_bench_times_both_arms(tmp_path, capsys):
    res = events_overhead.main(["--tensors", "200", "--repeat", "1", "--dir", str(tmp_path), "--json", str(tmp_path / "r.json")])
    assert res["save_ratio"] > 0 and res["load_ratio"] > 0 and (tmp_path / "r.json").exists()
    assert "observed" in capsys.readouterr().out
    assert [p for p in tmp_path.iterdir() if p.name.startswith("distckpt-bench")] == []
