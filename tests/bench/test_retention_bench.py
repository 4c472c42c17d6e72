"""A tiny run of bench/retention.py, so that it cannot rot: both runs, retention timed after each save, the oldest kept
step loaded bit-exact, and the table printed."""

from bench import retention


def test_retention_bench_times_both_runs_and_loads_the_oldest_kept_step(tmp_path, capsys):
    res = retention.main(["--steps", "8", "--keep", "3", "--tensors", "4", "--dir", str(tmp_path),
                          "--json", str(tmp_path / "r.json")])
    assert [r["kind"] for r in res["rows"]] == ["full", "incremental"]
    assert all(r["retentions"] == 8 and 0 < r["median_ms"] <= r["max_ms"] for r in res["rows"])
    assert "median ms" in capsys.readouterr().out and (tmp_path / "r.json").exists()
    assert [p for p in tmp_path.iterdir() if p.name.startswith("distckpt-bench")] == []
