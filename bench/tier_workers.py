"""Rank bodies of the tier benchmark (``bench/tiers.py``), run on the nodes of a simulated cluster.

Every rank holds its half of a GPT-like state as DTensors (``Shard(0)``). Each measured figure sits beside the
floor it is compared with, taken in the same round of the same job: a local save's blocked time beside one
memcpy of the state, replication beside a raw send of the same bytes over the same process group, the durable
write beside a raw write of the same bytes, restores beside a raw cold read.
"""

from __future__ import annotations

import os
import random
import shutil
import time

import torch
import torch.distributed as dist

from .measure import drop_cache, warm_memory
from .workers import _local_state, _raw_io


def _fingerprint(local: dict) -> int:
    from distckpt.format.checksum import crc32c

    value = 0
    for k in sorted(local):
        value = crc32c(local[k].contiguous().view(-1).view(torch.uint8).numpy(), value)
    return value


def _timed(fn) -> float:
    """Wall time of ``fn`` on the slowest rank (each rank starts after a barrier)."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took.item())


def _manager(durable: str, group_local: str):
    import distckpt

    return distckpt.TieredCheckpointManager(durable, local=group_local, replicas=1, keep_local=1, persist_every=0)


def _step_sizes(mgr, step: int) -> list[int]:
    """The sizes of the files of this rank's step in its own tier (what replication sends)."""
    folder = os.path.join(mgr.own_dir, f"step-{step}")
    return [os.path.getsize(os.path.join(folder, n)) for n in sorted(os.listdir(folder))]


def _raw_send(flat: torch.Tensor, sizes: list[int], peer_sizes: list[int], recv: torch.Tensor, dst: int, src: int) -> None:
    """The floor of replication: the same messages, from and into memory that is already there."""
    works, pos = [], 0
    for n in sizes:
        works.append(dist.isend(flat[pos:pos + n], dst))
        pos += n
    pos = 0
    for n in peer_sizes:
        works.append(dist.irecv(recv[pos:pos + n], src))
        pos += n
    for w in works:
        w.wait()


def _raw_land(flat: torch.Tensor, folder: str) -> None:
    """The floor of keeping a copy in the node's memory tier: the same bytes written into a new file there."""
    path = os.path.join(folder, "raw-land")  # kept between rounds: overwritten, as the tier's spares are
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        view = memoryview(flat.numpy())
        for off in range(0, len(view), 64 << 20):
            os.pwrite(fd, view[off:off + (64 << 20)], off)
    finally:
        os.close(fd)


def _one_way(flat: torch.Tensor, recv: torch.Tensor, rank: int) -> None:
    """The floor of a lost node's fetch: rank 0 sends its bytes to rank 1, memory to memory."""
    if rank == 0:
        dist.send(flat, 1)
    elif rank == 1:
        dist.recv(recv, 0)


def _max_dict(d: dict) -> dict:
    keys = sorted(d)
    t = torch.tensor([d[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(keys, t.tolist()))


def _wipe(mgr) -> None:
    """What losing this rank's node does to the tier: its own steps and the replicas it held are gone."""
    for folder in (mgr.own_dir, mgr.held_dir):
        shutil.rmtree(folder, ignore_errors=True)


def first_save(rank, world_size, total, durable):
    """Save step 1 to the tiers (local and replicated) and end, as a job does before it loses a node."""
    sd, _ = _local_state(total, world_size, rank, sharded=True)
    mgr = _manager(durable, os.environ["DISTCKPT_TIER_DIR"])
    mgr.save(1, {"model": sd})
    mgr.wait()
    mgr.close()
    return {"timings": mgr.timings[1]}


def rounds(rank, world_size, total, durable, scratch, repeat):
    """After node 1 was lost: restore (timed), then ``repeat`` rounds of every measure. Returns lists of seconds."""
    import torch.distributed.checkpoint as dcp

    local_root = os.environ["DISTCKPT_TIER_DIR"]
    sd, local = _local_state(total, world_size, rank, sharded=True)
    expected = _fingerprint(local)
    size = sum(v.numel() * v.element_size() for v in local.values())
    for v in local.values():
        v.zero_()
    mgr = _manager(durable, local_root)
    state = {"model": sd}
    out: dict = {"bytes": size, "rank": rank}
    out["restore_after_kill_s"] = [_timed(lambda: out.setdefault("first", mgr.restore(state)))]
    first = out.pop("first")
    out["first_report"] = {"step": first.step, "tier": first.tier, "sources": {str(k): v for k, v in first.sources.items()},
                           "bytes_from": first.bytes_from}
    if _fingerprint(local) != expected:
        raise AssertionError(f"rank {rank}: the restore after the node loss is not bit-exact")

    flat = torch.empty(size, dtype=torch.uint8).fill_(0)  # one memcpy's destination, and the raw send's source
    recv = torch.empty(size, dtype=torch.uint8).fill_(0)
    views = {k: v.contiguous().view(-1).view(torch.uint8) for k, v in local.items()}
    (dst,), (src,) = mgr.targets[rank], mgr.sources

    def memcpy() -> None:
        pos = 0
        for v in views.values():
            flat[pos:pos + v.numel()].copy_(v)
            pos += v.numel()

    dcp_dir = os.path.join(scratch, "dcp")
    raw_dir = os.path.join(scratch, "raw")
    step = 1
    keys = ("memcpy_s", "blocked_s", "local_s", "replicate_s", "raw_send_s", "raw_land_s", "raw_send_one_way_s",
            "restore_replica_s", "persist_s", "raw_write_s", "dcp_save_s", "restore_durable_cold_s", "dcp_load_cold_s",
            "raw_read_cold_s")
    out["restore_replica_parts"] = []
    for k in keys:
        out.setdefault(k, [])
    peer_sizes: list = []
    # steady state first: saves in a row (the first two fill the tier and its spares), each beside its floors
    for i in range(repeat + 2):
        step += 1
        warm = i < 2
        record = (lambda k, v: None) if warm else (lambda k, v: out[k].append(v))
        record("memcpy_s", _timed(memcpy))
        record("blocked_s", _timed(lambda: mgr.save(step, state)))
        mgr.wait()
        t = torch.tensor([mgr.timings[step]["local_s"], mgr.timings[step]["replicate_s"]], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        record("local_s", float(t[0]))
        record("replicate_s", float(t[1]))
        out["replicated_bytes"] = mgr.timings[step]["replicated_bytes"]
        if not peer_sizes:
            sizes = _step_sizes(mgr, step)
            peer_sizes = [None] * world_size
            dist.all_gather_object(peer_sizes, sizes)
        record("raw_send_s", _timed(lambda: _raw_send(flat, sizes, peer_sizes[src], recv, dst, src)))
        record("raw_land_s", _timed(lambda: _raw_land(flat, local_root)))
        record("raw_send_one_way_s", _timed(lambda: _one_way(flat, recv, rank)))
    os.unlink(os.path.join(local_root, "raw-land"))

    for r in range(repeat):
        step += 1
        mgr.save(step, state)
        mgr.wait()
        # node 1 loses its memory: its own steps and the replicas it held
        if rank == 1:
            _wipe(mgr)
        for v in local.values():
            v.zero_()
        reports = []
        out["restore_replica_s"].append(_timed(lambda: reports.append(mgr.restore(state))))
        if reports[0].tier != "memory" or reports[0].bytes_from["durable"] or _fingerprint(local) != expected:
            raise AssertionError(f"rank {rank}: the restore from memory went wrong: {reports[0]}")
        out["replica_report"] = {"sources": {str(k): v for k, v in reports[0].sources.items()},
                                 "bytes_from": reports[0].bytes_from}
        out["restore_replica_parts"].append(_max_dict(reports[0].seconds))

        out["persist_s"].append(_timed(lambda: mgr.persist(step)))
        # the cold loads, after every tier in memory is gone, in an order shuffled alike on every rank
        _wipe(mgr)
        shutil.rmtree(dcp_dir, ignore_errors=True)
        out["dcp_save_s"].append(_timed(lambda: dcp.save(sd, checkpoint_id=dcp_dir)))
        out["raw_write_s"].append(_timed(lambda: _raw_io(local, raw_dir, rank, write=True)))
        order = ["durable", "dcp", "raw"]
        random.Random(r).shuffle(order)
        for which in order:
            if rank == 0:
                drop_cache({"durable": durable, "dcp": dcp_dir, "raw": raw_dir}[which])
            warm_memory(size / (1 << 30))
            for v in local.values():
                v.zero_()
            if which == "durable":
                reports.clear()
                out["restore_durable_cold_s"].append(_timed(lambda: reports.append(mgr.restore(state))))
                if reports[0].tier != "durable" or reports[0].step != step:
                    raise AssertionError(f"rank {rank}: expected a durable restore of step {step}: {reports[0]}")
            elif which == "dcp":
                out["dcp_load_cold_s"].append(_timed(lambda: dcp.load(sd, checkpoint_id=dcp_dir)))
            else:
                out["raw_read_cold_s"].append(_timed(lambda: _raw_io(local, raw_dir, rank, write=False)))
            if _fingerprint(local) != expected:
                raise AssertionError(f"rank {rank}: {which} load is not bit-exact")
    mgr.close()
    return out
