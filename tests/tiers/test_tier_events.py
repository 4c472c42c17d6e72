"""A TieredCheckpointManager's persist and restore report their events (distckpt.observe), with the tier and step."""

from __future__ import annotations

import os

import torch

import distckpt
from distckpt.testing import run_ranks


def _observed_tier(rank, world_size, root):
    os.environ["DISTCKPT_NODE_ID"] = "node0"
    got: list = []
    with distckpt.observe(got.append):
        mgr = distckpt.TieredCheckpointManager(os.path.join(root, "durable"), local=os.path.join(root, "node0"),
                                               replicas=0, persist_every=0)
        state = {"w": torch.arange(1024, dtype=torch.float32)}
        mgr.save(1, state)
        mgr.wait()
        mgr.persist(1)
        back = {"w": torch.zeros(1024)}
        report = mgr.restore(back)
        mgr.close()
    assert torch.equal(back["w"], state["w"])
    return report.tier, [(e.operation, e.phase, e.step, e.tier, e.bytes > 0, e.error) for e in got
                         if e.operation in ("persist", "restore")]


def test_persist_and_restore_report_their_tier_step_and_bytes(tmp_path):
    [(tier, got)] = run_ranks(_observed_tier, 1, str(tmp_path))
    assert ("persist", "total", 1, "durable", True, None) in got, got
    assert ("restore", "total", 1, tier, True, None) in got, got
    assert {phase for op, phase, *_ in got if op == "restore"} >= {"agree", "load", "total"}, got
