"""distckpt.open, `distckpt cat` and `distckpt diff` attacked as a stranger would (HOSTILE.md): indices torch
reads otherwise, stored sizes that lie through a codec, value pairs that compare equal in Python but differ,
checkpoints whose data files a checksum-only diff would never open, rows larger than the memory budget."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import distckpt
from distckpt.errors import CheckpointIndexError

from .helpers import make_checkpoint


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("good") / "ck")
    return path, make_checkpoint(path)


# ------------------------------------------------------------------------------------------------ indices


@pytest.mark.parametrize("index", [torch.tensor([3]), torch.tensor([[3]]), torch.tensor(True), torch.tensor(1, dtype=torch.uint8),
                                   (slice(0, 2), torch.tensor([1])), np.array([3])],
                         ids=["one-element", "one-element-2d", "bool-0d", "uint8-0d", "second-dim", "numpy-1d"])
def test_an_index_torch_reads_as_advanced_or_a_mask_is_refused_not_taken_as_an_int(good, index):
    """A one-element tensor has __index__, but torch indexes with it as a list (keeping the dimension), and a bool
    or uint8 tensor as a mask: taken as an int, the slice came back of another shape, with other elements."""
    path, sd = good
    with distckpt.open(path) as ckpt:
        with pytest.raises(CheckpointIndexError, match="read it whole"):
            ckpt["w"][index]
        # what torch takes as an int still is one
        for as_int in (torch.tensor(3), np.int64(3), np.array(3)):
            assert torch.equal(ckpt["w"][as_int], sd["w"][3])


def test_a_step_beyond_64_bits_reads_one_row_not_a_runtime_error(good):
    path, sd = good
    with distckpt.open(path) as ckpt:
        got = ckpt["w"][::1 << 100, 1 << 70::1 << 64]
        assert got.shape == (1, 0)
        assert torch.equal(ckpt["w"][5::1 << 100], sd["w"][5:6])
        assert torch.equal(ckpt["ids"][-(1 << 80):1 << 80:1 << 65], sd["ids"][0:1])


# ------------------------------------------------------------------------------------------------ sizes that lie


_PEAK = """
import resource, sys, distckpt
from distckpt.errors import CorruptCheckpointError
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    with distckpt.open(sys.argv[1]) as ckpt:
        ckpt["w"][0]
    print("read")
except CorruptCheckpointError as exc:
    print("refused:", exc)
print("grew", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_a_compressed_chunk_claiming_a_huge_size_is_refused_without_filling_the_claim(tmp_path):
    """A chunk stored through a codec has no stored length to check its claimed size against: the decoder was
    handed a zero-filled buffer of the claimed size first (here 1 GiB for 12 KiB of zeros), so a slice of one
    row of a forged checkpoint of a few KiB made the reader take the whole claim in memory."""
    from distckpt import FileSystemWriter, ZStandard

    from .helpers import read_body, write_body

    path = str(tmp_path / "zstd")
    distckpt.save({"w": torch.zeros(64, 48)}, storage_writer=FileSystemWriter(path, _extensions=[ZStandard()]))
    body = read_body(path)
    entry = body["state_dict_metadata"]["w"]
    assert entry["chunks"][0][5]["codec"] != ["identity"]
    entry["size"] = entry["chunks"][0][1] = [1 << 22, 64]  # 1 GiB of float32 claimed
    write_body(path, body)
    out = _python(_PEAK, path)
    assert "refused:" in out and "'w'" in out and "not the 1073741824" in out, out
    assert int(out.rsplit("grew", 1)[1]) < 256, out  # MiB


def _python(script, *args):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout
