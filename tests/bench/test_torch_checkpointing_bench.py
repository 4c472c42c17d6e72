"""A tiny run of bench/torch_checkpointing.py, so that it cannot rot (no timed assertions)."""

import pytest

pytest.importorskip("torch_checkpointing")

from bench import torch_checkpointing  # noqa: E402


def test_bench_times_every_variant_and_reports_the_bit_flips(tmp_path, capsys):
    results = torch_checkpointing.main(["--gib", "0.002", "--repeat", "1", "--dir", str(tmp_path)])
    assert set(results["times"]) == {f"{v}|{op}" for v in torch_checkpointing.VARIANTS for op in ("save", "load")}
    assert all(r["wall_s"] > 0 for r in results["times"].values())
    flips = results["bit_flip"]
    assert flips["distckpt"].startswith("raised CorruptCheckpointError") and "fail their" in flips["distckpt"]
    assert flips["raw"].startswith("loaded")
    assert "one bit flipped" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
