"""Transient buffers stay within DISTCKPT_MEMORY_BUDGET_BYTES."""

import pytest
import torch

import distckpt
from distckpt.backends import direct_io
from distckpt.engine import budget, write
from distckpt.engine import read as reading


class Recording(budget.ByteBudget):
    seen: list = []

    def __init__(self, limit):
        super().__init__(limit)
        Recording.seen.append(self)


def _patch(monkeypatch):
    Recording.seen = []
    monkeypatch.setattr(reading, "ByteBudget", Recording)
    monkeypatch.setattr(write, "ByteBudget", Recording)


def test_read_buffers_respect_the_budget(tmp_path, monkeypatch):
    _patch(monkeypatch)
    monkeypatch.setenv("DISTCKPT_MEMORY_BUDGET_BYTES", str(64 * 1024))
    monkeypatch.setenv("DISTCKPT_IO_THREADS", "4")
    sd = {f"w{i}": torch.randn(1024, 256) for i in range(4)}  # 1 MiB each
    distckpt.save(sd, checkpoint_id=tmp_path / "ck")
    # non-contiguous destinations cannot be read into directly: they go through the buffers
    dest = {k: torch.zeros(256, 1024).t() for k in sd}
    kept = []  # each thread's slab buffer, kept across chunks: together within half the budget
    real = reading.host_buffer
    monkeypatch.setattr(reading, "host_buffer", lambda n, pinned: kept.append(n) or real(n, pinned))
    distckpt.load(dest, checkpoint_id=tmp_path / "ck")
    assert all(torch.equal(dest[k], sd[k]) for k in sd)
    assert kept and len(kept) <= 4 and sum(kept) <= 32 * 1024
    assert Recording.seen[-1].high_water <= 32 * 1024  # and whatever else the other half held


def test_host_copies_on_save_respect_the_budget(tmp_path, monkeypatch):
    _patch(monkeypatch)
    one = 256 * 1024 * 4
    monkeypatch.setenv("DISTCKPT_MEMORY_BUDGET_BYTES", str(one))
    monkeypatch.setenv("DISTCKPT_IO_BATCH_BYTES", "0")  # one item per task, 4 threads
    sd = {f"w{i}": torch.randn(1024, 256).t() for i in range(8)}  # non-contiguous: each needs a host copy
    distckpt.save(sd, checkpoint_id=tmp_path / "ck")
    assert Recording.seen[0].high_water == one  # never two copies at once
    out = {k: torch.zeros(256, 1024) for k in sd}
    distckpt.load(out, checkpoint_id=tmp_path / "ck")
    assert all(torch.equal(out[k], sd[k]) for k in sd)


def test_budget_lets_an_oversized_request_through_alone():
    b = budget.ByteBudget(10)
    b.acquire(100)
    assert b.held == 100
    b.release(100)
    b.acquire(4)
    b.acquire(6)
    assert b.high_water == 100 and b.held == 10


def test_direct_write_buffers_take_their_share_of_the_budget(tmp_path, monkeypatch):
    """On local disk the data files' bounce buffers fit in half the budget, split between the files written at
    once; host copies of tensors get the other half."""
    _patch(monkeypatch)
    assert direct_io.bounce_buffer_bytes() == 16 << 20 == direct_io.bounce_buffer_bytes((1 << 30) // 2 // 4)
    monkeypatch.setenv("DISTCKPT_DIRECT_IO", "on")
    monkeypatch.setenv("DISTCKPT_MEMORY_BUDGET_BYTES", str(1 << 20))
    monkeypatch.setenv("DISTCKPT_IO_THREADS", "2")
    monkeypatch.setenv("DISTCKPT_MIN_FILE_BYTES", str(1 << 20))  # two files for this small state
    taken = []
    real = direct_io._BouncePool.take
    monkeypatch.setattr(direct_io._BouncePool, "take", lambda self, size: taken.append(size) or real(self, size))
    sd = {f"w{i}": torch.randn(1024, 256) for i in range(4)}  # 1 MiB each
    distckpt.save(sd, checkpoint_id=tmp_path / "ck")
    if not taken:
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT")
    assert taken == [128 << 10] * 4  # two files, each with two buffers in its 256 KiB share
    assert Recording.seen[0].limit == 512 << 10
    out = {k: torch.zeros(1024, 256) for k in sd}
    distckpt.load(out, checkpoint_id=tmp_path / "ck")
    assert all(torch.equal(out[k], sd[k]) for k in sd)
