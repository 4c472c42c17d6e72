"""Rank bodies of ``bench/tiers_shared.py``: the tier on a cluster whose durable store (S3) is shared by every node.

Every rank holds its part of a GPT-like state as DTensors (``Shard(0)``). Each figure sits beside its floor or
peer, taken in the same round of the same job: a save's blocked time beside one memcpy, replication beside a raw
send of the same messages over the same links, and a restore after one node is lost from its peers' memory
beside the same restore from the durable store and DCP's load of the same state from the same store.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .tier_workers import _fingerprint, _max_dict, _raw_send, _step_sizes, _timed, _wipe
from .workers import _local_state


def _s3_env(endpoint: str) -> None:
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": endpoint})


def _manager(endpoint: str):
    import distckpt

    return distckpt.TieredCheckpointManager("s3://bench/tier", local=os.environ["DISTCKPT_TIER_DIR"], replicas=1,
                                            keep_local=1, persist_every=0,
                                            durable_options={"storage_options": {"endpoint_url": endpoint}})


def _dcp_storage(endpoint: str, write: bool):
    """DCP's own way to S3: its fsspec storage layer over s3fs (None where s3fs is not installed)."""
    try:
        import s3fs  # noqa: F401
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    except ImportError:
        return None
    options = {"client_kwargs": {"endpoint_url": endpoint}}
    url = "s3://bench/dcp"
    return FsspecWriter(url, **options) if write else FsspecReader(url, **options)


def first_job(rank, world_size, total, endpoint):
    """Save step 1 to the tiers, persist it to the shared store, save DCP's copy there too; the job then ends, as
    one does before it loses a node."""
    import torch.distributed.checkpoint as dcp

    _s3_env(endpoint)
    if rank == 0:
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
    dist.barrier()
    sd, _ = _local_state(total, world_size, rank, sharded=True)
    mgr = _manager(endpoint)
    mgr.save(1, {"model": sd})
    mgr.wait()
    out = {"persist_s": _timed(lambda: mgr.persist(1))}
    writer = _dcp_storage(endpoint, write=True)
    if writer is not None:
        out["dcp_save_s"] = _timed(lambda: dcp.save(sd, storage_writer=writer))
    mgr.close()
    return out


def rounds(rank, world_size, total, endpoint, repeat):
    """After the last node was lost and replaced: the first restore (fresh processes), then ``repeat`` rounds of
    saves beside their floors and of restores from peers, from the durable store and by DCP."""
    import torch.distributed.checkpoint as dcp

    _s3_env(endpoint)
    sd, local = _local_state(total, world_size, rank, sharded=True)
    expected = _fingerprint(local)
    size = sum(v.numel() * v.element_size() for v in local.values())
    for v in local.values():
        v.zero_()
    mgr = _manager(endpoint)
    state = {"model": sd}
    lost = world_size - 1
    out: dict = {"bytes": size, "rank": rank}
    first = []
    out["restore_first_s"] = _timed(lambda: first.append(mgr.restore(state)))
    out["first_report"] = {"step": first[0].step, "tier": first[0].tier, "bytes_from": first[0].bytes_from,
                           "sources": {str(k): v for k, v in first[0].sources.items()}}
    if _fingerprint(local) != expected or first[0].tier != "memory":
        raise AssertionError(f"rank {rank}: the first restore went wrong: {first[0]}")

    flat = torch.empty(size, dtype=torch.uint8).fill_(0)
    recv = torch.empty(size, dtype=torch.uint8).fill_(0)
    views = [v.contiguous().view(-1).view(torch.uint8) for v in local.values()]
    (dst,), (src,) = mgr.targets[rank], mgr.sources

    def memcpy() -> None:
        pos = 0
        for v in views:
            flat[pos:pos + v.numel()].copy_(v)
            pos += v.numel()

    keys = ("memcpy_s", "blocked_s", "replicate_s", "raw_send_s", "restore_peer_s", "restore_durable_s", "dcp_load_s")
    for k in keys:
        out[k] = []
    out["restore_peer_parts"] = []
    reader = _dcp_storage(endpoint, write=False)
    step, peer_sizes = 1, None
    for i in range(repeat + 1):
        warm = i == 0  # the first save fills the tier and its spares
        record = (lambda k, v: None) if warm else (lambda k, v: out[k].append(v))
        step += 1
        record("memcpy_s", _timed(memcpy))
        record("blocked_s", _timed(lambda: mgr.save(step, state)))
        mgr.wait()
        t = torch.tensor([mgr.timings[step]["replicate_s"]], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        record("replicate_s", float(t[0]))
        if peer_sizes is None:
            sizes = _step_sizes(mgr, step)
            peer_sizes = [None] * world_size
            dist.all_gather_object(peer_sizes, sizes)
        record("raw_send_s", _timed(lambda: _raw_send(flat, sizes, peer_sizes[src], recv, dst, src)))
        if warm:
            continue
        # the last node loses its memory; its rank's step comes from its replica holder
        if rank == lost:
            _wipe(mgr)
        for v in local.values():
            v.zero_()
        reports = []
        out["restore_peer_s"].append(_timed(lambda: reports.append(mgr.restore(state))))
        if reports[0].tier != "memory" or reports[0].bytes_from["durable"] or _fingerprint(local) != expected:
            raise AssertionError(f"rank {rank}: the restore from peers went wrong: {reports[0]}")
        out["peer_report"] = {"sources": {str(k): v for k, v in reports[0].sources.items()},
                              "bytes_from": reports[0].bytes_from}
        out["restore_peer_parts"].append(_max_dict(reports[0].seconds))
        # every node loses its memory: the whole state comes from the shared store (step 1, persisted by job 1)
        _wipe(mgr)
        for v in local.values():
            v.zero_()
        reports.clear()
        out["restore_durable_s"].append(_timed(lambda: reports.append(mgr.restore(state))))
        if reports[0].tier != "durable" or _fingerprint(local) != expected:
            raise AssertionError(f"rank {rank}: the durable restore went wrong: {reports[0]}")
        out["durable_report"] = {"bytes_from": reports[0].bytes_from}
        if reader is not None:
            for v in local.values():
                v.zero_()
            out["dcp_load_s"].append(_timed(lambda: dcp.load(sd, storage_reader=reader)))
            if _fingerprint(local) != expected:
                raise AssertionError(f"rank {rank}: DCP's load is not bit-exact")
    out["replicated_bytes"] = mgr.timings[step]["replicated_bytes"]
    mgr.close()
    return out
