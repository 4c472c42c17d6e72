"""Rank bodies of the resume benchmark (bench/resume.py): a sharded state saved, then restored after a job
restart by each peer, the model's construction simulated by a wait."""

from __future__ import annotations

import os
import random
import time

import torch
import torch.distributed as dist

from distckpt.format.checksum import crc32c

from .measure import drop_cache
from .states import gpt_like

PEERS = ("dcp", "cold", "prefetch")


def _local(total: int, rank: int, world: int, fill: bool, shapes: dict | None = None) -> dict:
    """This rank's rows of every tensor of a GPT-like state of ``total`` bytes (Shard(0) over the world); zeros of
    the ``shapes`` given (key -> full shape, dtype), without making the state, where not ``fill``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    full = gpt_like(total, seed=0) if fill or shapes is None else None
    like = shapes if full is None else {k: (tuple(t.shape), t.dtype) for k, t in full.items()}
    out = {}
    for k, (shape, dtype) in like.items():
        rows = shape[0] // world * world
        if rows == 0:
            continue
        n = rows // world
        part = full[k][rank * n:(rank + 1) * n].contiguous() if fill else torch.zeros((n,) + shape[1:], dtype=dtype)
        glob = torch.Size((rows,) + shape[1:])
        stride = torch.empty(0).new_empty(glob, device="meta").stride()
        out[k] = DTensor.from_local(part, mesh, [Shard(0)], run_check=False, shape=glob, stride=stride)
    return out


def shapes_of(total: int) -> dict:
    return {k: (tuple(t.shape), t.dtype) for k, t in gpt_like(total, seed=0).items()}


def save(rank, world_size, total, location):
    import torch.distributed.checkpoint as dcp

    from distckpt import CheckpointManager

    sd = _local(total, rank, world_size, True)
    CheckpointManager(os.path.join(location, "distckpt")).save(1, sd)
    dcp.save(sd, checkpoint_id=os.path.join(location, "dcp"))
    os.sync()
    return sum(v.to_local().numel() * v.to_local().element_size() for v in sd.values())


class _PeakRss:
    """This process's resident memory, sampled every 5 ms: the most above what it held at the start."""

    def __init__(self) -> None:
        import threading

        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _rss()) - self.start


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _restore(peer: str, location: str, total: int, rank: int, world: int, build_s: float, shapes: dict,
             max_bytes: int, expected: dict) -> tuple[float, float, int]:
    """From "process group up": (seconds until the state is loaded and training could step, seconds of the load
    call itself, the most memory held above the start meanwhile)."""
    rss = _PeakRss()
    import torch.distributed.checkpoint as dcp

    from distckpt import CheckpointManager

    t0 = time.perf_counter()
    mgr = CheckpointManager(os.path.join(location, "distckpt"))
    if peer == "prefetch":
        mgr.prefetch(max_bytes=max_bytes)  # first thing: the read runs while the model is built
    time.sleep(build_s)  # building the model, compiling, warming up the data loader
    dest = _local(total, rank, world, False, shapes)
    t1 = time.perf_counter()
    if peer == "dcp":
        dcp.load(dest, checkpoint_id=os.path.join(location, "dcp"))
    else:
        mgr.load(dest)
    t2 = time.perf_counter()
    peak = rss.stop()
    if {k: crc32c(memoryview(v.to_local().numpy()).cast("B")) for k, v in dest.items()} != expected:
        raise AssertionError(f"{peer} restored other bytes than were saved")
    del dest
    return t2 - t0, t2 - t1, peak


def rounds(rank, world_size, total, location, repeat, build_s, max_bytes):
    """Every peer restores, ``repeat`` rounds in shuffled order after one warm-up round, page caches emptied before
    each; per peer and round: the slowest rank's resume and load seconds. Also a memcpy of this rank's state."""
    out: dict = {}
    shapes = shapes_of(total)
    expected = {k: crc32c(memoryview(v.to_local().numpy()).cast("B")) for k, v in _local(total, rank, world_size, True).items()}
    for r in range(-1, repeat):
        order = list(PEERS)
        random.Random(r).shuffle(order)
        for peer in order:
            drop_cache(location)
            dist.barrier()
            resume, load, peak = _restore(peer, location, total, rank, world_size, build_s, shapes, max_bytes, expected)
            times = torch.tensor([resume, load, peak], dtype=torch.float64)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            if r >= 0:
                out.setdefault(peer, []).append((float(times[0]), float(times[1]), int(times[2])))
            dist.barrier()
    state = _local(total, rank, world_size, True)
    dest = _local(total, rank, world_size, False, shapes)
    best = None
    for _ in range(3):
        t0 = time.perf_counter()
        for k, v in state.items():
            dest[k].to_local().copy_(v.to_local())
        took = time.perf_counter() - t0
        best = took if best is None else min(best, took)
    copy = torch.tensor([best], dtype=torch.float64)
    dist.all_reduce(copy, op=dist.ReduceOp.MAX)
    out["memcpy"] = [(float(copy[0]), float(copy[0]), 0)]
    return out
