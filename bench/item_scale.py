"""Planning cost per item as the item count grows: does a save or load plan cost the same per item at 2M as at 20k?

One process, no data written: for N tiny fp32 tensors (views into one buffer, 16-1024 elements),
the steps distckpt.save runs before and after the bytes move (the default planner's local plan on
columns, global planning on columns, the metadata document from column results), and the steps a
load runs before it reads (parsing that document, the default load planner's local plan). DCP's
planning of the same state (its local and global plan, metadata built) is timed beside it at the
counts where it finishes in reasonable time, with the size of its pickled metadata.

    python -m bench.item_scale [--items 20000 200000 2000000] [--dcp-max 200000]
"""

from __future__ import annotations

import argparse
import gc
import pickle
import time

import numpy as np
import torch


def tiny_state(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(16, 1025, (n,), generator=g)
    flat = torch.empty(int(sizes.sum()))
    return {f"state.{i}.exp_avg": t for i, t in enumerate(flat.split(sizes.tolist()))}


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def distckpt_steps(sd: dict) -> dict:
    from distckpt import DefaultLoadPlanner, DefaultSavePlanner
    from distckpt.engine.commit import columns_document
    from distckpt.format.codec import parse_metadata
    from distckpt.item_columns import ResultColumns
    from distckpt.planning.columnar import plan_columns
    from distckpt.wire.columns import local_plan_columns

    planner = DefaultSavePlanner()
    gc.disable()
    try:
        _, flatten_s = _timed(lambda: planner.set_up_planner(sd, None, True))
        plan, local_s = _timed(planner.create_local_plan)
        cols, _ = _timed(lambda: local_plan_columns(plan))
        cplan, global_s = _timed(lambda: plan_columns([cols]))
        n = len(plan.items)
        length = np.asarray(plan.items.nbytes, dtype=np.int64)
        offset = np.cumsum(length) - length + 4096
        results = ResultColumns([["data-00000.safetensors", int(offset[-1] + length[-1]), 0, 0]], np.zeros(n, np.int64), offset,
                                length, np.zeros(n, np.int64))
        doc, document_s = _timed(lambda: columns_document(cplan, [results], "0" * 32, "/bench"))
        md, parse_s = _timed(lambda: parse_metadata(doc, "bench"))
        loader = DefaultLoadPlanner()
        _, load_setup_s = _timed(lambda: loader.set_up_planner(sd, md, True))
        _, load_plan_s = _timed(loader.create_local_plan)
    finally:
        gc.enable()
    return {"save_plan_s": flatten_s + local_s + global_s, "document_s": document_s, "metadata_bytes": len(doc),
            "parse_s": parse_s, "load_plan_s": load_setup_s + load_plan_s}


def dcp_steps(sd: dict) -> dict:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

    planner = DefaultSavePlanner()
    gc.disable()
    try:
        t = time.perf_counter()
        planner.set_up_planner(sd, None, True)
        plan = planner.create_local_plan()
        _, md = planner.create_global_plan([plan])
        save_s = time.perf_counter() - t
        loader = DefaultLoadPlanner()
        t = time.perf_counter()
        loader.set_up_planner(sd, md, True)
        loader.create_local_plan()
        load_s = time.perf_counter() - t
    finally:
        gc.enable()
    return {"save_plan_s": save_s, "load_plan_s": load_s, "metadata_bytes": len(pickle.dumps(md))}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, nargs="+", default=[20000, 200000, 2000000])
    p.add_argument("--dcp-max", type=int, default=200000, help="largest count DCP is timed at")
    a = p.parse_args(argv)
    rows = []
    print(f"{'items':>9} {'peer':<9} {'save plan s':>12} {'us/item':>8} {'document s':>11} {'metadata MB':>12} "
          f"{'parse s':>8} {'load plan s':>12} {'us/item':>8}")
    for n in a.items:
        sd = tiny_state(n)
        peers = [("distckpt", distckpt_steps)] + ([("dcp", dcp_steps)] if n <= a.dcp_max else [])
        for peer, fn in peers:
            r = fn(sd) | {"items": n, "peer": peer}
            rows.append(r)
            doc = f"{r['document_s']:11.3f} {r['metadata_bytes'] / 1e6:12.1f} {r['parse_s']:8.3f}" if "document_s" in r else \
                f"{'':11} {r['metadata_bytes'] / 1e6:12.1f} {'':8}"
            print(f"{n:9d} {peer:<9} {r['save_plan_s']:12.3f} {r['save_plan_s'] / n * 1e6:8.2f} {doc} "
                  f"{r['load_plan_s']:12.3f} {r['load_plan_s'] / n * 1e6:8.2f}", flush=True)
    return rows


if __name__ == "__main__":
    main()
