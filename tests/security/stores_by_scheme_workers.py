"""Rank functions for test_stores_by_scheme_and_commit_hostile.py: columnar saves through a chunk codec whose ranks disagree in form."""

from __future__ import annotations

import dataclasses
import os
import time

import torch

import distckpt


def _attempt(fn) -> dict:
    """Run ``fn``; what it raised (type, text, seconds taken), or ok."""
    start = time.monotonic()
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        return {"ok": False, "type": type(exc).__name__, "checkpoint_error": isinstance(exc, distckpt.CheckpointError),
                "msg": str(exc), "s": time.monotonic() - start}
    return {"ok": True, "s": time.monotonic() - start}


def odd_state(rank: int, world_size: int, fill: bool = True) -> dict:
    """Replicated tensors of odd kinds (empty, 0-d, bool, int), values, and one DTensor sharded by rows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    def t(x):
        return x if fill else torch.zeros_like(x)

    full = torch.arange(6 * 64, dtype=torch.float32).reshape(6, 64)
    sd = {f"rep{i}": t(torch.arange(100 * (i + 1), dtype=torch.float32) / 7) for i in range(6)}
    sd.update({
        "empty": t(torch.zeros(0)),
        "empty2d": t(torch.zeros(3, 0, dtype=torch.int64)),
        "scalar": t(torch.tensor(3.5)),
        "flags": t(torch.tensor([True, False, True, True])),
        "flag0d": t(torch.tensor(True)),
        "ints": t(torch.arange(1000, dtype=torch.int32)),
        "step": 7 if fill else 0,
        "opt": {"lr": 0.1, "name": "adam"} if fill else {"lr": 0.0, "name": ""},
        "w": distribute_tensor(full if fill else torch.zeros_like(full), init_device_mesh("cpu", (world_size,)), [Shard(0)]),
    })
    return sd


class RewritingPlanner(distckpt.DefaultSavePlanner):
    """On ``rank`` only, finish_plan hands back a new plan of item objects: that rank's results go in JSON, the
    others' as columns (the coordinator's global step still declares plans_on_columns, inherited)."""

    def __init__(self, rank_to_rewrite: int):
        super().__init__()
        self.rank_to_rewrite = rank_to_rewrite

    def finish_plan(self, new_plan):
        plan = super().finish_plan(new_plan)
        if torch.distributed.get_rank() == self.rank_to_rewrite:
            return dataclasses.replace(plan, items=list(plan.items))
        return plan


def _compare(got: dict, want: dict) -> list:
    wrong = []
    for k, v in want.items():
        g = got[k]
        if hasattr(v, "full_tensor"):
            v, g = v.full_tensor(), g.full_tensor()
        if isinstance(v, torch.Tensor):
            if g.dtype != v.dtype or g.shape != v.shape or not torch.equal(g, v):
                wrong.append(k)
        elif g != v:
            wrong.append(k)
    return wrong


def mixed_result_forms_through_zstd(rank: int, world_size: int, root: str) -> dict:
    """A zstd save where one rank's results travel in JSON, the others' as columns; then load it back."""
    from distckpt import saving

    forms: list = []
    real = saving.decode_results

    def recording(raw):
        out = real(raw)
        forms.append(type(out).__name__)
        return out

    sd = odd_state(rank, world_size)
    saving.decode_results = recording
    try:
        distckpt.save(sd, storage_writer=distckpt.FileSystemWriter(root, _extensions=[distckpt.ZStandard()]),
                      planner=RewritingPlanner(1))
    finally:
        saving.decode_results = real
    back = odd_state(rank, world_size, fill=False)
    distckpt.load(back, checkpoint_id=root)
    return {"wrong": _compare(back, sd), "forms": forms}


def columns_through_zstd(rank: int, world_size: int, root: str) -> dict:
    """The same odd state through zstd with every rank's results as columns; then load it back."""
    sd = odd_state(rank, world_size)
    distckpt.save(sd, storage_writer=distckpt.FileSystemWriter(root, _extensions=[distckpt.ZStandard()]))
    back = odd_state(rank, world_size, fill=False)
    distckpt.load(back, checkpoint_id=root)
    return {"wrong": _compare(back, sd)}


class DataFileThief(distckpt.FileSystemWriter):
    """Removes rank 1's data file from the save's staging directory just before the commit (the coordinator's
    finish), as another process on the same directory might."""

    def finish(self, metadata, results):
        staging = self.store.staging(self.save_id)
        os.unlink(staging.describe("data-00001.safetensors"))
        return super().finish(metadata, results)


def commit_with_a_data_file_removed(rank: int, world_size: int, root: str) -> dict:
    sd = odd_state(rank, world_size)
    res = _attempt(lambda: distckpt.save(sd, storage_writer=DataFileThief(root, _extensions=[distckpt.ZStandard()])))
    res["exists"] = os.path.exists(os.path.join(root, "metadata.json"))
    return res


def overwrite_zstd(rank: int, world_size: int, root: str) -> dict:
    """Save through zstd, refuse a second save without overwrite, replace it with overwrite=True, load the new one."""
    first = odd_state(rank, world_size)
    distckpt.save(first, storage_writer=distckpt.FileSystemWriter(root, _extensions=[distckpt.ZStandard()]))
    second = odd_state(rank, world_size)
    for k in list(second):
        if k.startswith("rep"):
            second[k] = second[k] + 1
    second["step"] = 8
    refused = _attempt(lambda: distckpt.save(second, storage_writer=distckpt.FileSystemWriter(root, _extensions=[distckpt.ZStandard()])))
    distckpt.save(second, storage_writer=distckpt.FileSystemWriter(root, _extensions=[distckpt.ZStandard()]), overwrite=True)
    back = odd_state(rank, world_size, fill=False)
    distckpt.load(back, checkpoint_id=root)
    return {"refused": refused, "wrong": _compare(back, second), "step": back["step"]}

