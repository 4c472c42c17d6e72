"""Rank bodies of bench/load_memory.py: save a GPT-like state in one layout, then load it into destinations that are
already allocated and touched, and measure the peak RSS the load adds above them.

Every value is a small integer in float32, a function of the key and the element's place in the full tensor
(:func:`pattern`), so any rank can build or check any region of any tensor without holding the rest.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import time

import torch
import torch.distributed as dist

from .measure import _reset_peak, _rss_kb
from .states import gpt_like

WARM_KEY = "layers.0.ln1.weight"  # loaded alone first: imports, clients, the process group's buffers, metadata


def shapes(total: int) -> dict[str, tuple[int, ...]]:
    """The keys and full shapes of bench.states.gpt_like(total), without making its bytes."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in gpt_like(total).items()}


def pattern(key_id: int, offsets: tuple, sizes: tuple) -> torch.Tensor:
    """The values of the region ``offsets``/``sizes`` of key number ``key_id``: exact in float32."""
    rows = torch.arange(offsets[0], offsets[0] + sizes[0])
    if len(sizes) == 1:
        values = (rows * 31 + key_id * 7) % 8191
    else:
        cols = torch.arange(offsets[1], offsets[1] + sizes[1])
        values = (rows.view(-1, 1) * 31 + cols.view(1, -1) * 17 + key_id * 7) % 8191
    return values.to(torch.float32)


def region(shape: tuple, dim: int, rank: int, world_size: int) -> tuple[tuple, tuple]:
    """Offsets and sizes of this rank's part of a tensor sharded on ``dim`` (DTensor's Shard: ceil-sized chunks)."""
    n = shape[dim]
    chunk = -(-n // world_size)
    first = min(rank * chunk, n)
    size = max(0, min(n, first + chunk) - first)
    offsets = tuple(first if d == dim else 0 for d in range(len(shape)))
    sizes = tuple(size if d == dim else s for d, s in enumerate(shape))
    return offsets, sizes


def _stride(shape: tuple) -> tuple:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


def build(total: int, placement: str, rank: int, world_size: int, keys=None) -> tuple[dict, dict]:
    """A state dict of the GPT-like keys (``keys``: only those) and the region each rank-local tensor holds.

    ``placement``: ``shard0`` / ``shard1`` (DTensors on a 1-D mesh of every rank, sharded on that dim; 1-D
    tensors on dim 0), ``full`` (plain tensors of the full shape, as replicas). Values are not set."""
    full_shapes = shapes(total)
    mesh = None
    if placement != "full":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world_size,))
    sd, regions = {}, {}
    for key_id, (key, shape) in enumerate(full_shapes.items()):
        if keys is not None and key not in keys:
            continue
        if placement == "full":
            offsets, sizes = (0,) * len(shape), shape
            sd[key] = torch.empty(shape)
        else:
            from torch.distributed.tensor import DTensor, Shard

            dim = 1 if placement == "shard1" and len(shape) > 1 else 0
            offsets, sizes = region(shape, dim, rank, world_size)
            sd[key] = DTensor.from_local(torch.empty(sizes), mesh, [Shard(dim)], run_check=False, shape=torch.Size(shape),
                                         stride=_stride(shape))
        regions[key] = (key_id, offsets, sizes)
    return sd, regions


def local(value):
    return value.to_local() if hasattr(value, "to_local") else value


def fill(sd: dict, regions: dict) -> None:
    for key, (key_id, offsets, sizes) in regions.items():
        local(sd[key]).copy_(pattern(key_id, offsets, sizes))


def check(sd: dict, regions: dict, what: str) -> None:
    for key, (key_id, offsets, sizes) in regions.items():
        if not torch.equal(local(sd[key]), pattern(key_id, offsets, sizes)):
            raise AssertionError(f"{what}: key {key!r} loaded wrong values")


# ------------------------------------------------------------------ saving each layout

def save(rank: int, world_size: int, layout: str, total: int, path: str) -> int:
    """Save the state at this world size in ``layout``; return this rank's bytes."""
    if layout in ("hf", "torch.save"):
        return _save_whole_tensors(rank, world_size, layout, total, path)
    placement = "full" if layout == "replicated" else "shard0"
    sd, regions = build(total, placement, rank, world_size)
    fill(sd, regions)
    if layout == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save(sd, checkpoint_id=path)
    else:  # distckpt's own, on disk or s3://
        import distckpt

        distckpt.save(sd, checkpoint_id=path)
    return sum(local(v).nbytes for v in sd.values())


def _save_whole_tensors(rank: int, world_size: int, layout: str, total: int, path: str) -> int:
    """A Hugging Face directory (the keys dealt round the ranks, one shard file each, and an index), or one
    ``torch.save`` file (``path``) written by rank 0."""
    names = list(shapes(total))
    if layout == "torch.save":
        if rank != 0:
            return 0
        sd, regions = build(total, "full", 0, 1)
        fill(sd, regions)
        torch.save(sd, path)
        return sum(v.nbytes for v in sd.values())
    from safetensors.torch import save_file

    files = [f"model-{r + 1:05d}-of-{world_size:05d}.safetensors" for r in range(world_size)]
    mine = {k for i, k in enumerate(names) if i % world_size == rank}
    sd, regions = build(total, "full", 0, 1, keys=mine)
    fill(sd, regions)
    os.makedirs(path, exist_ok=True)
    save_file(sd, os.path.join(path, files[rank]))
    if rank == 0:
        weight_map = {k: files[i % world_size] for i, k in enumerate(names)}
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return sum(v.nbytes for v in sd.values())


# ------------------------------------------------------------------ loading, measured

def _trim() -> None:
    """Give freed heap memory back to the kernel, so that the load cannot reuse it unseen."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _load(reader: str, sd: dict, path: str, partial: bool) -> None:
    """``reader``: ``distckpt`` or ``dcp`` by checkpoint id; ``distckpt-bcast`` or ``dcp-bcast``, a torch.save file
    through each one's BroadcastingTorchSaveReader (rank 0 reads, the others receive)."""
    import warnings

    import distckpt

    warnings.simplefilter("ignore")  # DCP's deprecation warnings, once per rank and row
    if reader == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.load(sd, checkpoint_id=path)
        return
    if reader.endswith("-bcast"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import format_utils as theirs

        from distckpt import format_utils as ours

        lib = ours if reader.startswith("distckpt") else theirs
        call = distckpt.load if lib is ours else dcp.load
        call(sd, storage_reader=lib.BroadcastingTorchSaveReader(path), planner=lib.DynamicMetaLoadPlanner())
        return
    from distckpt.planning import DefaultLoadPlanner

    # a load of one key of a Hugging Face directory leaves the others unexpected, which that reader refuses by default
    planner = DefaultLoadPlanner(allow_unexpected_keys=True) if partial else None
    distckpt.load(sd, checkpoint_id=path, planner=planner)


def load(rank: int, world_size: int, reader: str, total: int, path: str, placement: str) -> dict:
    """Load the checkpoint at ``path`` with ``reader`` (see :func:`_load`) into ``placement`` destinations,
    allocated and touched first; measure the peak RSS above the level right before the load.

    A load of one small key runs first, so that imports, clients and the process group's first buffers are not
    charged to the load; freed heap memory is then given back (malloc_trim), so that the load cannot hide its
    buffers in memory an earlier step left behind."""
    warm, warm_regions = build(total, placement, rank, world_size, keys={WARM_KEY})
    _load(reader, warm, path, partial=True)
    check(warm, warm_regions, f"{reader} warm-up")
    warm = None
    sd, regions = build(total, placement, rank, world_size)
    for v in sd.values():
        local(v).fill_(-1.0)  # every page of the destinations touched
    dest_bytes = sum(local(v).nbytes for v in sd.values())
    _trim()
    _barrier()
    _reset_peak()
    base = _rss_kb("VmRSS")
    t0 = time.perf_counter()
    _load(reader, sd, path, partial=False)
    wall = time.perf_counter() - t0
    peak = _rss_kb("VmHWM")
    _barrier()
    check(sd, regions, reader)
    return {"dest_bytes": dest_bytes, "base_mib": base / 1024, "above_mib": max(0, peak - base) / 1024, "wall_s": wall}
