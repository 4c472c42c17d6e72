"""Loads of a replicated state from a store whose bandwidth the ranks share: read once and send, beside every
rank reading on its own, DCP, and the raw floor.

    python -m bench.shared_reads --gib 1 --ranks 4 --mbps 300      # a loop device read at 300 MB/s in all
    python -m bench.shared_reads --gib 0.02 --ranks 2 --mbps 0     # a smoke run on the plain disk
    python -m bench.shared_reads --chunks 4000 --ranks 4 --mbps 100  # 4,000 small tensors (1-64 KiB)

Every rank reads its own copy of the checkpoint, each on one device throttled for all of them together
(bench/throttle.py ``throttled_reads``), with the page cache emptied before each load: as nodes of a cluster
read one shared store through page caches of their own. Bytes read are what storage served each process
(the sectors its device read, all ranks together), as a ratio to the checkpoint's data bytes.

Peers, in shuffled order each round, best of ``--repeat`` rounds (the slowest rank of each):
  shared  distckpt as it loads by default: each chunk read by one rank, sent to the others
  alone   distckpt with shared reads off (FileSystemReader(shared_reads=False)): every rank reads all it needs
  dcp     torch.distributed.checkpoint.load
  raw     the floor: each rank reads 1/ranks of the data file's bytes, then the ranks all-gather them
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile

from distckpt.testing import run_ranks

from . import shared_read_workers, throttle
from .measure import warm_memory


def run(gib: float, ranks: int, mbps: float, repeat: int, where: str, chunks: int = 0) -> dict:
    total = int(gib * (1 << 30))
    with tempfile.TemporaryDirectory(prefix="distckpt-shared-reads-", dir=where) as scratch:
        limit = (throttle.throttled_reads(mbps, scratch, 2 * ranks * total + (1 << 30)) if mbps > 0
                 else contextlib.nullcontext(scratch))
        with limit as location:
            data = run_ranks(shared_read_workers.save_copies, 1, total, location, ranks, chunks, timeout_s=3600)[0]
            warm_memory(min(8.0, 1.5 * gib * ranks))
            rounds = run_ranks(shared_read_workers.load_rounds, ranks, total, location, repeat, chunks, timeout_s=3600)[0]
    rows = {peer: min(runs) for peer, runs in rounds.items()}
    return {"gib": gib, "ranks": ranks, "mbps": mbps, "data_bytes": data, "chunks": chunks,
            "storage_floor_s": data / (mbps * 1e6) if mbps > 0 else None,
            "rows": {peer: {"s": s, "read_bytes": b, "read_ratio": b / data,
                            "asked_ratio": None if asked is None else asked / data}
                     for peer, (s, b, asked) in rows.items()}}


def table(result: dict) -> str:
    rows = result["rows"]
    base = rows["shared"]["s"]
    what = f"{result['chunks']} small tensors" if result.get("chunks") else f"{result['gib']} GiB"
    lines = [f"replicated state of {what} ({result['data_bytes']} data bytes) loaded by {result['ranks']} ranks, "
             f"each from its own copy on one device read at {result['mbps'] or 'full'} MB/s in all; slowest rank, "
             "best of the rounds",
             f"  {'peer':8} {'load s':>8} {'/shared':>8} {'read/size':>10} {'asked/size':>11}"]
    for peer in ("shared", "alone", "dcp", "raw"):
        r = rows[peer]
        asked = "-" if r["asked_ratio"] is None else f"{r['asked_ratio']:.3f}"
        lines.append(f"  {peer:8} {r['s']:8.3f} {r['s'] / base:8.2f} {r['read_ratio']:10.3f} {asked:>11}")
    if result["storage_floor_s"]:
        lines.append(f"  the device alone: {result['storage_floor_s']:.3f} s to serve the data bytes once")
    lines.append("  read/size: what the device served (read-ahead and the file system's own reads included); asked/size: "
                 "what distckpt's ranks asked of their files")
    lines.append("  goals: shared asked/size <= 1.02 (DCP and alone: one per rank); shared faster than alone and DCP where "
                 "the store's bandwidth is the limit")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--mbps", type=float, default=300.0, help="the shared read bandwidth; 0: no throttle")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--where", default=os.environ.get("TMPDIR", "/tmp"), help="a directory on a real disk")
    p.add_argument("--chunks", type=int, default=0, help="a state of this many small tensors (1-64 KiB) instead")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    result = run(a.gib, a.ranks, a.mbps, a.repeat, a.where, a.chunks)
    print(table(result), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
