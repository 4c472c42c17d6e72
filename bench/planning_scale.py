"""Coordinator cost of planning a save at thousands of ranks, simulated without data.

distckpt's side is what distckpt.save's coordinator runs with the default
planner and its own writer: plans travel as columns (wire/columns.py),
global planning runs on arrays (planning/columnar.py), and the metadata
document is written from the column write results.

Every rank holds ITEMS items: half replicated (the same key on every rank),
half sharded (one chunk per rank). Timed, for distckpt and for
torch.distributed.checkpoint on the same plans, is the whole coordinator path:
decoding the gathered local plans, global planning (dedup, balancing,
metadata), encoding the plans scattered back, decoding the write results and
building and encoding the metadata. The last columns time what every rank
does with that metadata on load: decode it (DCP: unpickle it), and plan its
reads with the default load planner, for a rank in the middle of the world
whose state dict holds the same items (the sharded ones as DTensors on a
simulated process group of that size: torch's "fake" backend, in a
subprocess).

python bench/planning_scale.py [--ranks 512 4096] [--items 500] [--no-dcp] [--repeat N]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time

import torch


def _tensor_item_args(r, i, world, replicated):
    if replicated:
        return f"rep{i}", (0, 0), (64, 64), (64, 64)
    return f"shard{i}", (r * 16, 0), (16, 64), (world * 16, 64)


LAST_DOCUMENTS: dict[str, bytes] = {}  # the metadata each path built last (for load-side measurements)


def distckpt_path(world: int, items: int) -> dict:
    """What distckpt.save's coordinator does with the default planner and its own writer: column plans."""
    import distckpt
    from distckpt.engine.commit import columns_document
    from distckpt.format.records import FileInfo, FileResult, StorageInfo
    from distckpt.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from distckpt.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
    from distckpt.planning.columnar import plan_columns
    from distckpt.storage import WriteResult
    from distckpt.wire.columns import (
        decode_keep,
        decode_plan_columns,
        decode_result_columns,
        encode_keep,
        encode_plan_columns,
        encode_result_columns,
    )

    props = TensorProperties(torch.float32)
    local_plans, local_bytes = [], []
    for r in range(world):
        its = []
        for i in range(items):
            fqn, off, size, glob = _tensor_item_args(r, i // 2, world, i % 2 == 0)
            its.append(WriteItem(MetadataIndex(fqn, off), WriteItemType.SHARD if i % 2 else WriteItemType.TENSOR,
                                 tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size(off), torch.Size(size)), props,
                                                             torch.Size(glob))))
        mappings = {it.index.fqn: (it.index.fqn,) for it in its}  # what the default planners send
        local_plans.append(SavePlan(its, planner_data=mappings))
        local_bytes.append(encode_plan_columns(local_plans[-1]))
    where = tempfile.mkdtemp(prefix="distckpt-planning-")
    writer = distckpt.FileSystemWriter(os.path.join(where, "bench"))
    writer.set_up_storage_writer(True)
    gc.disable()
    t0 = time.perf_counter()
    cols = [decode_plan_columns(b) for b in local_bytes]
    plan = plan_columns(cols)
    storage = writer.prepare_global_plan([SavePlan([]) for _ in cols])
    replies = [encode_keep(k, s.storage_data) for k, s in zip(plan.keep, storage)]
    t_plan = time.perf_counter() - t0
    gc.enable()
    # each rank's write results, as the coordinator receives them (built on the ranks: not timed)
    results_bytes = []
    for r, (raw, local) in enumerate(zip(replies, local_plans)):
        central = decode_keep(raw, local)
        name = central.storage_data["file"]
        res, size = [], 4096
        for it in central.items:
            n = it.tensor_data.chunk.sizes.numel() * 4
            res.append(WriteResult(it.index, n, StorageInfo(name, size, n, 0x1234abcd)))
            size += n
        res.append(FileResult.of(name, FileInfo(size, r, 0)))
        results_bytes.append(encode_result_columns(res, central))
    gc.disable()
    t1 = time.perf_counter()
    results = [decode_result_columns(b) for b in results_bytes]
    doc = columns_document(plan, results, writer.save_id, "/nonexistent/bench")
    t_md = time.perf_counter() - t1
    gc.enable()
    writer.discard_incomplete()  # gives back the save's lease; nothing was written
    os.rmdir(where)
    LAST_DOCUMENTS["distckpt"] = doc
    from distckpt.format.codec import parse_metadata

    t2 = time.perf_counter()
    parse_metadata(doc, "bench")  # what every rank does on load
    t_decode = time.perf_counter() - t2
    return {"plan_s": t_plan, "metadata_s": t_md, "total_s": t_plan + t_md, "gathered_bytes": sum(map(len, local_bytes)),
            "scattered_bytes": sum(map(len, replies)), "metadata_bytes": len(doc), "load_decode_s": t_decode}


def dcp_path(world: int, items: int) -> dict:
    import io

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    props = TensorProperties(torch.float32)
    local_bytes = []
    for r in range(world):
        its = []
        for i in range(items):
            fqn, off, size, glob = _tensor_item_args(r, i // 2, world, i % 2 == 0)
            its.append(WriteItem(MetadataIndex(fqn, torch.Size(off)), WriteItemType.SHARD if i % 2 else WriteItemType.TENSOR,
                                 tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size(off), torch.Size(size)), props,
                                                             torch.Size(glob))))
        mappings = {it.index.fqn: (it.index.fqn,) for it in its}
        local_bytes.append(pickle.dumps(SavePlan(its, planner_data=mappings)))
    planner = DefaultSavePlanner()
    planner.set_up_planner({}, None, True)
    writer = FileSystemWriter("/nonexistent/bench")
    gc.disable()
    t0 = time.perf_counter()
    plans = [pickle.loads(b) for b in local_bytes]
    final, md = planner.create_global_plan(plans)
    final = writer.prepare_global_plan(final)
    replies = [pickle.dumps(p) for p in final]
    t_plan = time.perf_counter() - t0
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    results_bytes = []
    for r, p in enumerate(final):
        res = [WriteResult(it.index, 16384, _StorageInfo(f"__{r}_0.distcp", 4096 + k * 16384, 16384)) for k, it in enumerate(p.items)]
        results_bytes.append(pickle.dumps(res))
    t1 = time.perf_counter()
    all_results = [pickle.loads(b) for b in results_bytes]
    md.storage_data = {res.index: res.storage_data for rr in all_results for res in rr}
    buf = io.BytesIO()
    pickle.dump(md, buf)
    t_md = time.perf_counter() - t1
    gc.enable()
    LAST_DOCUMENTS["dcp"] = buf.getvalue()
    t2 = time.perf_counter()
    pickle.loads(buf.getvalue())  # what every rank does on load (DCP's reader unpickles .metadata)
    t_decode = time.perf_counter() - t2
    return {"plan_s": t_plan, "metadata_s": t_md, "total_s": t_plan + t_md, "gathered_bytes": sum(map(len, local_bytes)),
            "scattered_bytes": sum(map(len, replies)), "metadata_bytes": len(buf.getvalue()), "load_decode_s": t_decode}


def middle_rank_state(world: int, items: int) -> tuple[int, dict]:
    """On torch's fake process group of ``world`` ranks, this process its middle rank: the rank and its state of
    ``items`` items (the replicated ones plain tensors, the sharded ones DTensors)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rank = world // 2
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    mesh = init_device_mesh("cpu", (world,))
    state = {}
    for i in range(items):
        fqn, off, size, glob = _tensor_item_args(rank, i // 2, world, i % 2 == 0)
        if i % 2 == 0:
            state[fqn] = torch.zeros(size)
        else:
            state[fqn] = DTensor.from_local(torch.zeros(size), mesh, [Shard(0)], run_check=False, shape=torch.Size(glob),
                                            stride=(glob[1], 1))
    return rank, state


def _load_plan_worker(world: int, items: int, doc_path: str, peer: str) -> float:
    """Seconds the default load planner of ``peer`` takes to plan a middle rank's reads (run in a subprocess)."""
    rank, state = middle_rank_state(world, items)
    raw = open(doc_path, "rb").read()
    if peer == "distckpt":
        from distckpt.format.codec import parse_metadata
        from distckpt.planning import DefaultLoadPlanner

        md = parse_metadata(raw, "bench")
        planner = DefaultLoadPlanner()
        planner.rank = rank
    else:
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner as DcpLoadPlanner

        md = pickle.loads(raw)
        planner = DcpLoadPlanner()
    gc.disable()  # distckpt's load() pauses the collector; DCP's does not, but here both peers plan without it
    t0 = time.perf_counter()
    planner.set_up_planner(state, md, False)
    plan = planner.create_local_plan()
    elapsed = time.perf_counter() - t0
    if len(plan.items) != items:
        raise AssertionError(f"{peer}: {len(plan.items)} read items for {items} items")
    return elapsed


def load_plan_seconds(world: int, items: int, peer: str) -> float | None:
    """_load_plan_worker in a fresh interpreter, on the document the peer's path built last; None if it cannot run."""
    with tempfile.TemporaryDirectory() as tmp:
        doc = os.path.join(tmp, "metadata")
        with open(doc, "wb") as f:
            f.write(LAST_DOCUMENTS[peer])
        code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import planning_scale as ps; "
                "print(json.dumps(ps._load_plan_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])))")
        done = subprocess.run([sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__)), str(world), str(items), doc, peer],
                              capture_output=True, text=True)
    if done.returncode != 0:
        print(f"  ({peer} load planning not measured: {done.stderr.strip().splitlines()[-1:]})", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def _fastest(path, world: int, items: int, repeat: int) -> dict:
    """The run with the smallest total of ``repeat`` runs, with the fastest load decode among them."""
    runs = [path(world, items) for _ in range(max(1, repeat))]
    best = dict(min(runs, key=lambda r: r["total_s"]))
    best["load_decode_s"] = min(r["load_decode_s"] for r in runs)
    peer = "distckpt" if path is distckpt_path else "dcp"
    best["load_plan_s"] = load_plan_seconds(world, items, peer)
    return best


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[512])
    p.add_argument("--items", type=int, default=500)
    p.add_argument("--no-dcp", action="store_true")
    p.add_argument("--repeat", type=int, default=1, help="runs of each path; the fastest (by total) is reported")
    a = p.parse_args(argv)
    rows = []
    print(f"{'ranks':>6} {'peer':>9} {'plan s':>8} {'meta s':>8} {'total s':>8} {'gathered MB':>12} {'metadata MB':>12} "
          f"{'DCP/distckpt':>13}"
          f" {'load decode s':>14} {'DCP/distckpt':>13} {'load plan s':>12} {'DCP/distckpt':>13}")
    for world in a.ranks:
        ours = _fastest(distckpt_path, world, a.items, a.repeat)
        theirs = None if a.no_dcp else _fastest(dcp_path, world, a.items, a.repeat)
        for name, r in (("distckpt", ours), ("dcp", theirs)):
            if r is None:
                continue
            ratio = "" if name == "distckpt" else f"{r['total_s'] / ours['total_s']:.1f}x"
            decode_ratio = "" if name == "distckpt" else f"{r['load_decode_s'] / ours['load_decode_s']:.1f}x"
            plan = "n/a" if r["load_plan_s"] is None else f"{r['load_plan_s']:.3f}"
            plan_ratio = "" if name == "distckpt" or r["load_plan_s"] is None or not ours["load_plan_s"] else \
                f"{r['load_plan_s'] / ours['load_plan_s']:.1f}x"
            print(f"{world:>6} {name:>9} {r['plan_s']:8.2f} {r['metadata_s']:8.2f} {r['total_s']:8.2f} "
                  f"{r['gathered_bytes'] / 1e6:12.1f} {r['metadata_bytes'] / 1e6:12.1f} {ratio:>13}"
                  f" {r['load_decode_s']:14.2f} {decode_ratio:>13} {plan:>12} {plan_ratio:>13}", flush=True)
            rows.append({"ranks": world, "peer": name, **r})
    return rows


if __name__ == "__main__":
    main()
