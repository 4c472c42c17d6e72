"""Rank bodies of the shared-read benchmark (bench/shared_reads.py): a replicated state loaded by every rank."""

from __future__ import annotations

import os
import random
import time

import torch
import torch.distributed as dist

from distckpt.format.checksum import crc32c
from distckpt.testing.read_counts import FileReads

from .measure import drop_cache
from .states import gpt_like, many_small


def _state(total: int, chunks: int) -> dict:
    """The replicated state: GPT-like weights of ``total`` bytes, or ``chunks`` small tensors (1-64 KiB each)."""
    return many_small(chunks, seed=0) if chunks else gpt_like(total, seed=0)

PEERS = ("shared", "alone", "dcp", "raw")


def save_copies(rank, world_size, total, location, copies, chunks=0):
    """One process: save the replicated state with distckpt and with DCP, and copy each ``copies`` times (each rank
    of the load reads its own copy, as a node would through its own page cache, from one shared device)."""
    import shutil

    import torch.distributed.checkpoint as dcp

    import distckpt

    sd = _state(total, chunks)
    distckpt.save(sd, checkpoint_id=os.path.join(location, "distckpt"))
    dcp.save(sd, checkpoint_id=os.path.join(location, "dcp"))
    for peer in ("distckpt", "dcp"):
        for c in range(copies):
            shutil.copytree(os.path.join(location, peer), os.path.join(location, f"{peer}-{c}"))
        shutil.rmtree(os.path.join(location, peer))
    os.sync()
    return sum(os.path.getsize(os.path.join(location, "distckpt-0", f)) for f in os.listdir(os.path.join(location, "distckpt-0"))
               if f.startswith("data-"))


def _device_reads(path: str) -> int:
    """Bytes the device holding ``path`` has served so far, to every process (its sectors read): what the store
    counts. On the throttled loop device nothing else reads; on a shared disk, other work is counted too."""
    dev = os.stat(path).st_dev
    with open(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat") as f:
        return int(f.read().split()[2]) * 512


def _raw(dest: dict, path: str, rank: int, world_size: int) -> None:
    """The floor: each rank reads its share of the data files' bytes once (one range of their concatenation), with
    no format or checksum, and broadcasts it, 64 MiB at a time: the same bytes from storage once, then over the
    group, without reading ahead while sending."""
    names = [f for f in sorted(os.listdir(path)) if f.startswith("data-")]
    sizes = [os.path.getsize(os.path.join(path, f)) for f in names]
    total = sum(sizes)
    share = -(-total // world_size)
    mine = torch.zeros(share, dtype=torch.uint8)
    view = memoryview(mine.numpy())
    lo, hi = rank * share, min(total, (rank + 1) * share)
    at = 0
    for name, size in zip(names, sizes):  # the part of [lo, hi) in each file
        a, b = max(lo, at), min(hi, at + size)
        if a < b:
            fd = os.open(os.path.join(path, name), os.O_RDONLY)
            try:
                assert os.preadv(fd, [view[a - lo:b - lo]], a - at) == b - a
            finally:
                os.close(fd)
        at += size
    # the bytes land in the destinations, as a load's would (not at the format's offsets): one rank's share in turn,
    # 64 MiB at a time through a bounce buffer, as shared reads send
    flat = [t.view(-1).view(torch.uint8) for t in dest.values()]
    room = sum(f.numel() for f in flat)
    bounce = torch.empty(64 << 20, dtype=torch.uint8)
    at = 0  # position in the destinations' bytes
    for src in range(world_size):
        for a in range(0, share, bounce.numel()):
            n = min(bounce.numel(), share - a)
            if src == rank:
                bounce[:n].copy_(mine[a:a + n])
            dist.broadcast(bounce[:n], src=src)
            at = _spill(flat, at, bounce[:n], room)


def _spill(flat: list, at: int, data: torch.Tensor, room: int) -> int:
    """Copy ``data`` into the concatenation of ``flat`` from byte ``at`` on (what does not fit is dropped)."""
    start, used = 0, 0
    for f in flat:
        n = f.numel()
        if at < start + n and used < data.numel():
            k = min(start + n - at, data.numel() - used)
            f[at - start:at - start + k].copy_(data[used:used + k])
            at, used = at + k, used + k
        start += n
    return min(room, at + data.numel() - used)


def _load(peer, dest, path, rank, world_size):
    if peer in ("shared", "alone"):
        import distckpt

        distckpt.load(dest, storage_reader=distckpt.FileSystemReader(path, shared_reads=peer == "shared"))
    elif peer == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.load(dest, storage_reader=dcp.FileSystemReader(path))
    else:
        _raw(dest, path, rank, world_size)


def load_rounds(rank, world_size, total, location, repeat, chunks=0):
    """Every peer loads the replicated state at every rank, ``repeat`` rounds in shuffled order, page caches
    emptied before each; per (peer, round): the slowest rank's time and the bytes all ranks read from storage.
    Each rank is a node of its own (DISTCKPT_NODE_ID), reading its own copy, as nodes of a cluster would."""
    os.environ["DISTCKPT_NODE_ID"] = f"node{rank}"
    want = _state(total, chunks)
    like = {k: (v.shape, v.dtype) for k, v in want.items()}
    expected = {k: crc32c(memoryview(v.numpy()).cast("B")) for k, v in want.items()}
    want = None  # checked by checksum: a copy of the state per rank would not fit beside the loads at 2 GiB
    counter = FileReads()
    out: dict = {}
    for r in range(-1, repeat):  # round -1 warms every peer up (imports, the group's first exchanges), unrecorded
        order = list(PEERS)
        random.Random(r).shuffle(order)
        for peer in order:
            path = os.path.join(location, f"{'dcp' if peer == 'dcp' else 'distckpt'}-{rank}")
            dest = {k: torch.zeros(shape, dtype=dtype) for k, (shape, dtype) in like.items()}
            drop_cache(path)
            dist.barrier()
            before = _device_reads(path)
            asked_before = counter.total
            dist.barrier()
            t0 = time.perf_counter()
            _load(peer, dest, path, rank, world_size)
            wall = time.perf_counter() - t0
            dist.barrier()
            read = _device_reads(path) - before
            asked = None
            if peer in ("shared", "alone"):  # what distckpt asked of its files, every rank together
                total = torch.tensor([counter.total - asked_before], dtype=torch.int64)
                dist.all_reduce(total)
                asked = int(total)
            if peer != "raw":
                assert all(crc32c(memoryview(dest[k].numpy()).cast("B")) == c for k, c in expected.items()), \
                    f"{peer} loaded wrong data"
            slowest = torch.tensor([wall], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if r >= 0:
                out.setdefault(peer, []).append((float(slowest[0]), read, asked))
            dest = None
            dist.barrier()
    return out
