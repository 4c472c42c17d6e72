"""A tiny run of the benchmark suite, so that it cannot rot."""

from bench import run


def test_bench_suite_runs_every_peer_at_a_tiny_size(tmp_path, capsys):
    results = run.main(["--gib", "0.004", "--small", "100", "--planning-ranks", "4", "--repeat", "2", "--disk-dir", str(tmp_path),
                        "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    for peer in ("distckpt", "dcp", "torch.save", "safetensors"):
        assert f"{peer}|save" in results["disk/1"] and f"{peer}|load" in results["tmpfs/2"]
    assert "time vs distckpt" in out and "blocking / memcpy" in out
    assert {r["peer"] for r in results["planning"]} == {"distckpt", "dcp"}
    assert results["baselines"]["write_fsync_gbps"] > 0
    assert (tmp_path / "r.json").exists()
