"""bench/resume.py runs end to end at a small size on the plain disk: every peer restores bit-exact (the workers
load real checkpoints), and the prefetch's rows are filled."""

from bench import resume


def test_the_resume_bench_restores_with_every_peer(capsys):
    result = resume.main(["--gib", "0.02", "--ranks", "2", "--mbps", "0", "--build-s", "0.1", "--repeat", "1"])
    rows = result["rows"]
    assert set(rows) == {"dcp", "cold", "prefetch", "memcpy"}
    assert all(r["resume_s"] > 0 and r["load_s"] > 0 for r in rows.values()), rows
    assert rows["prefetch"]["peak_extra_bytes"] > 0, rows  # it held the bytes it read ahead
    assert "goals" in capsys.readouterr().out
