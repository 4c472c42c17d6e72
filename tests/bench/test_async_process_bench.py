"""A tiny run of bench/async_process.py, so that it cannot rot: every peer (distckpt's thread and writer process,
DCP's writer process, and the raw floor of a writer process) saved beside the training loop, each figure in the table and the JSON."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow  # guards that stay: tests/distributed/test_writer_process.py (the writer process itself)
def test_async_process_bench_runs_every_peer(tmp_path):
    out = subprocess.run([sys.executable, "-m", "bench.async_process", "--mib", "16", "--repeat", "1", "--root",
                          str(tmp_path / "root"), "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step ratio" in out.stdout and "targets for distckpt-process" in out.stdout
    best = json.loads((tmp_path / "r.json").read_text())["best"]
    assert set(best) == {"distckpt-thread", "distckpt-process", "dcp-process", "raw-process"}
    for peer, row in best.items():
        assert row["step_ratio"] > 0 and row["total_s"] >= row["blocking_s"] > 0, (peer, row)
        assert row["peak_pss_mb"] > 0 or peer == "raw-process", (peer, row)  # a tiny raw write ends before a sample
    assert list((tmp_path / "root").iterdir()) == []
