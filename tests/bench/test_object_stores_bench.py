"""A tiny run of bench/object_stores.py, so that it cannot rot: distckpt, the raw client and (where gcsfs is
installed) DCP save and load on gs:// against fake-gcs-server at 2 ranks, each figure in the table and the JSON."""

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.storage.gcs_server import binary


@pytest.mark.skipif(binary() is None, reason="fake-gcs-server is not installed (scripts/setup.sh installs it)")
def test_object_stores_bench_runs_every_peer(tmp_path):
    out = subprocess.run([sys.executable, "-m", "bench.object_stores", "--mib", "8", "--tensors", "4", "--repeat", "1",
                          "--json", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "raw/save" in out.stdout
    best = json.loads((tmp_path / "r.json").read_text())["best"]
    want = {"distckpt", "raw"} | ({"dcp"} if importlib.util.find_spec("gcsfs") else set())
    assert set(best) == want
    for peer, row in best.items():
        assert row["save"] > 0 and row["load"] > 0, (peer, row)
