"""Save at N ranks, load at M ranks, for every tensor kind: bit-exact."""

import os

import pytest

import distckpt
from distckpt.testing import run_ranks

from . import workers

WORLD_SIZES = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    paths = []
    for n in WORLD_SIZES:
        path = str(root / f"saved_at_{n}")
        run_ranks(workers.save_all_layouts, n, path, timeout_s=180)
        paths.append(path)
    return paths


@pytest.mark.parametrize("m", WORLD_SIZES)
def test_load_every_checkpoint_at_m_ranks(saved, m):
    results = run_ranks(workers.load_all_layouts, m, saved, timeout_s=300)
    for rank, failures in enumerate(results):
        assert failures == {}, f"rank {rank} of {m}: {failures}"


def test_saved_checkpoints_record_every_chunk(saved):
    for path in saved:
        md = distckpt.read_metadata(path)
        entry = md.state_dict_metadata["m2.ss"]
        assert sum(c.sizes[0] * c.sizes[1] for c in entry.chunks) == 9 * 6
        assert isinstance(md.state_dict_metadata["values.step"], distckpt.metadata.BytesStorageMetadata)
        files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
        assert 1 <= len(files) <= int(path.rsplit("_", 1)[1])
