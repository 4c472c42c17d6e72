"""A tiny run of bench/load_memory.py, so that it cannot rot: it prints its table, and at a few MiB every load of
distckpt's own checkpoint (resharded, with and without shared reads) stays within a small budget."""

from bench import load_memory


def test_load_memory_bench_prints_its_table_and_the_bound_holds_at_a_tiny_size(tmp_path, capsys):
    results = load_memory.main(["--gib", "0.008", "--budget-mib", "8", "--only", "distckpt", "--dir", str(tmp_path),
                                "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert "RSS above dests MiB" in out and "/ budget" in out and (tmp_path / "r.json").exists()
    rows = results["rows"]
    assert [r["row"].strip() for r in rows] == ["reshard 2->3 Shard(1)", "same, DISTCKPT_SHARED_READS=0",
                                                "reshard 2->3 Shard(0)"]
    assert all(r["ranks"] == 3 and 2 < r["dest_mib_per_rank"] < 3 and len(r["above_mib_per_rank"]) == 3 for r in rows)
    assert all(0 <= r["above_mib"] <= 8 and not r["exceeds"] for r in rows), rows
    assert "every distckpt row within the budget" in out
