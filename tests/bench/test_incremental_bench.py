"""A tiny run of bench/incremental.py (issue 49), so that it cannot rot: 10 saves of a frozen-base fine-tuning state
by every peer, the kept steps loaded bit-exact, and the incremental peer within 1.1 x (one full save + 9 x the
trainable state)."""

import os

from bench import incremental


def test_incremental_bench_writes_little_more_than_the_trainable_state_and_loads_every_kept_step(tmp_path, capsys):
    res = incremental.main(["--gib", "0.004", "--repeat", "1", "--warm-gib", "0", "--dir", str(tmp_path),
                            "--json", str(tmp_path / "r.json")])
    peers = res["peers"]
    assert set(peers) == set(incremental.PEERS)
    assert res["met"] and res["incremental_ratio"] <= incremental.TARGET, res["incremental_ratio"]
    assert 0.2 < res["trainable_share"] < 0.3  # 10% of the weights trained, with two moments each
    # the floor writes exactly the bound; full saves and DCP write the whole state every time
    assert peers["raw"]["total_bytes"] == res["bound_bytes"]
    for name in ("full", "dcp"):
        assert peers[name]["total_bytes"] >= res["saves"] * res["state_bytes"]
    assert peers["incremental"]["bytes"][0] >= res["state_bytes"]
    assert all(b < 0.5 * res["state_bytes"] for b in peers["incremental"]["bytes"][1:])
    assert all(peers[name]["checked_steps"] == [9, 10] for name in ("incremental", "full", "dcp"))
    assert "target (issue 49)" in capsys.readouterr().out and (tmp_path / "r.json").exists()
    assert [p for p in os.listdir(tmp_path) if p.startswith("distckpt-bench")] == []


def test_a_renamed_file_is_not_counted_as_written(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_bytes(b"x" * 100)

    def save():
        os.rename(tmp_path / "a", tmp_path / ".retired-a")  # as retention retires a step
        (tmp_path / "g").write_bytes(b"y" * 7)
        os.symlink(tmp_path / ".retired-a" / "f", tmp_path / "link")

    nbytes, wall = incremental.written(str(tmp_path), save)
    assert nbytes == 7 and wall > 0


def test_embedding_chunk_arithmetic_agrees_with_its_simulation(capsys):
    from bench import embedding_chunks

    out = embedding_chunks.main(["--rows", "65536", "--dim", "8"])
    rows = {r["k"]: r for r in out["rows"]}
    for k in (1, 16, 64, 256):
        assert abs(rows[k]["simulated"] - rows[k]["written"][0.01]) < 0.02, k
    assert rows[1]["chunks"] == 65536 and rows[max(rows)]["written"][0.01] > 0.999  # a shard: written whole
    # retention holds whole files: without full saves the run keeps several tables; full_every=10 bounds it
    assert rows[16]["held"][0] > rows[16]["held"][10] > 2
    assert "rows/chunk" in capsys.readouterr().out
