"""A tiny run of bench/hf_publish.py, so that it cannot rot: every peer publishes, and every output was checked."""


def test_hugging_face_publish_bench_runs_every_peer_and_checks_every_output(tmp_path, capsys):
    from bench import hf_publish

    results = hf_publish.main(["--small", "--dir", str(tmp_path), "--json", str(tmp_path / "r.json"),
                               "--txt", str(tmp_path / "r.txt")])
    peers = results["peers"]
    assert set(peers) == {"distckpt", "dcp-hf", "save_pretrained", "raw"} and results["shards"] >= 2
    # every byte of the model read back from every peer's output, distckpt's also through from_pretrained
    assert all(r["checked_bytes"] == results["nbytes"] > 0 for r in peers.values())
    assert peers["distckpt"]["from_pretrained"] and results["same_split_as_save_pretrained"]
    assert all(r["time_s"] > 0 and len(r["peak_rss_delta_mb_per_rank"]) == 2 for r in peers.values())
    # DCP's consolidation leaves its per-rank files behind: twice the bytes of the others
    assert peers["dcp-hf"]["out_bytes"] > 1.9 * results["nbytes"] and peers["distckpt"]["out_bytes"] < 1.1 * results["nbytes"]
    out = capsys.readouterr().out
    assert "time/floor" in out and "every output read back" in out
    assert (tmp_path / "r.json").exists() and "python -m bench.hf_publish --small" in (tmp_path / "r.txt").read_text()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("distckpt-bench")] == []  # the outputs are removed
