"""Rank functions for test_rough_edges: what a new user meets at a new world size."""

from __future__ import annotations

import torch

import distckpt


def save_rank_local(rank, world_size, path):
    distckpt.save({"loader": {"pos": distckpt.RankLocal(torch.tensor(rank))}, "w": torch.ones(2)}, checkpoint_id=path)
    return True


def load_rank_local(rank, world_size, path):
    try:
        distckpt.load({"loader": {"pos": distckpt.RankLocal(torch.tensor(-1))}, "w": torch.zeros(2)}, checkpoint_id=path)
    except distckpt.CheckpointError as exc:
        return str(exc)
    return None
