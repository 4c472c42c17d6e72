"""Compressed chunks resharded: saved by 2 ranks with compression="zstd", loaded by 3, each rank decoding the chunks it
overlaps (a compressed chunk is read whole, checked, decoded and cut)."""

import torch

import distckpt
from distckpt.testing import run_ranks

ROWS, COLS = 12, 1024


def _full(dtype):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(ROWS, COLS, generator=g) * 0.02).to(dtype)


def _state(world_size, fill, dims):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    sd = {}
    for dtype in (torch.bfloat16, torch.float32):
        for dim in dims:
            full = _full(dtype) if fill else torch.zeros(ROWS, COLS, dtype=dtype)
            sd[f"{dtype}-{dim}"] = distribute_tensor(full, mesh, [Shard(dim)])
    return sd


def save_compressed(rank, world_size, path):
    distckpt.save(_state(world_size, True, (0, 1)), storage_writer=distckpt.FileSystemWriter(path, compression="zstd"))
    return True


def load_resharded(rank, world_size, path, shared):
    sd = _state(world_size, False, (1, 0))  # each tensor split along the other dimension, at other boundaries
    distckpt.load(sd, storage_reader=distckpt.FileSystemReader(path, shared_reads=shared))
    wrong = []
    for key, dt in sd.items():
        full = _full(dt.dtype)
        if not torch.equal(dt.full_tensor(), full):
            wrong.append(key)
    return wrong


def test_two_ranks_save_compressed_and_three_load_them(tmp_path):
    path = str(tmp_path / "ck")
    assert run_ranks(save_compressed, 2, path) == [True, True]
    assert distckpt.read_metadata(path).version == "4.0"
    for shared in (False, True):
        assert run_ranks(load_resharded, 3, path, shared) == [[], [], []]
    assert distckpt.verify(path).ok
