"""A tiny run of the shared-read benchmark (bench/shared_reads.py), so that it cannot rot."""

from bench import shared_reads


def test_shared_read_bench_runs_every_peer_and_checks_what_they_loaded(tmp_path, capsys):
    # no throttle at this size: the loads are checked bit-exact inside; the figures are the device's, shared here
    result = shared_reads.main(["--gib", "0.004", "--ranks", "2", "--mbps", "0", "--repeat", "1", "--where", str(tmp_path),
                                "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert set(result["rows"]) == {"shared", "alone", "dcp", "raw"}
    assert all(r["s"] > 0 and r["read_bytes"] >= 0 for r in result["rows"].values())
    assert "read/size" in out and "goals:" in out and (tmp_path / "r.json").exists()
