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
