"""A tiny run of the benchmark suite, so that it cannot rot."""

from bench import run


def test_bench_suite_runs_every_peer_at_a_tiny_size(tmp_path, capsys):
    results = run.main(["--gib", "0.004", "--small", "100", "--planning-ranks", "4", "--repeat", "2", "--disk-dir", str(tmp_path),
                        "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    for peer in ("distckpt", "dcp", "torch.save", "safetensors", "raw"):
        assert f"{peer}|save" in results["disk/1"] and f"{peer}|load" in results["tmpfs/2"]
    assert "time vs distckpt" in out and "blocking / memcpy" in out and "(copy + save: " in out and "training on every core while the write runs" in out
    assert {r["peer"] for r in results["planning"]} == {"distckpt", "dcp"}
    assert results["baselines"]["write_fsync_gbps"] > 0
    assert (tmp_path / "r.json").exists()


def test_gpu_bench_reports_recorded_results_and_refuses_without_a_gpu(capsys):
    import json
    from pathlib import Path

    import pytest
    import torch

    from bench import gpu

    recorded = json.loads((Path(gpu.__file__).parent / "results" / "cuda-h100-2gib.json").read_text())
    lines = gpu.report(recorded)
    assert any(line.strip().startswith("dcp|save") and line.rstrip().endswith("x") for line in lines)
    assert any("train slowdown" in line for line in lines)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA device"):
            gpu.main(["--gib", "0.01"])
