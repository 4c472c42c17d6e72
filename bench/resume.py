"""Resume time: from "process group up" to "training can step", for a sharded state restored at the world size that
saved it, each rank reading its shards from one device whose bandwidth the ranks share.

    python -m bench.resume --gib 2 --ranks 4 --mbps 400            # throttled loop device (root)
    python -m bench.resume --gib 0.05 --ranks 2 --mbps 0 --build-s 0.2  # a smoke run on the plain disk

Each rank builds its model in ``--build-s`` seconds (a wait; default: the device's time for all the state's bytes,
so that building takes as long as the read) and then loads. Peers, shuffled each round, page caches emptied before
each, the slowest rank of each, best of ``--repeat`` rounds after a warm-up round:
  dcp       torch.distributed.checkpoint.load after the model is built
  cold      CheckpointManager.load after the model is built
  prefetch  CheckpointManager.prefetch() first thing, then the build, then CheckpointManager.load
  memcpy    the floor of a load whose bytes are in memory: a copy of this rank's state
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile

from distckpt.testing import run_ranks

from . import resume_workers, throttle
from .measure import warm_memory


def run(gib: float, ranks: int, mbps: float, build_s: float | None, repeat: int, where: str,
        max_bytes: int | None = None) -> dict:
    total = int(gib * (1 << 30))
    with tempfile.TemporaryDirectory(prefix="distckpt-resume-", dir=where) as scratch:
        limit = (throttle.throttled_reads(mbps, scratch, 3 * total + (1 << 30)) if mbps > 0
                 else contextlib.nullcontext(scratch))
        with limit as location:
            held = run_ranks(resume_workers.save, ranks, total, location, timeout_s=3600)
            data = sum(held)
            build = build_s if build_s is not None else (data / (mbps * 1e6) if mbps > 0 else 1.0)
            warm_memory(min(8.0, 2.5 * gib))
            ahead = max_bytes if max_bytes is not None else 2 * total // ranks  # all of a rank's share by default
            rounds = run_ranks(resume_workers.rounds, ranks, total, location, repeat, build, ahead, timeout_s=3600)[0]
    rows = {peer: min(runs) for peer, runs in rounds.items()}
    return {"gib": gib, "ranks": ranks, "mbps": mbps, "build_s": build, "state_bytes": data, "prefetch_max_bytes": ahead,
            "rows": {peer: {"resume_s": r[0], "load_s": r[1], "peak_extra_bytes": r[2]} for peer, r in rows.items()}}


def table(result: dict) -> str:
    rows = result["rows"]
    cold = rows["cold"]["resume_s"]
    lines = [f"sharded state of {result['state_bytes'] / 2**30:.2f} GiB restored by {result['ranks']} ranks from one device "
             f"read at {result['mbps'] or 'full'} MB/s in all; model built in {result['build_s']:.2f} s; slowest rank, best "
             "of the rounds",
             f"  {'peer':9} {'resume s':>9} {'/cold':>7} {'load s':>8} {'/memcpy':>8} {'peak MiB':>9}"]
    for peer in ("dcp", "cold", "prefetch", "memcpy"):
        r = rows[peer]
        lines.append(f"  {peer:9} {r['resume_s']:9.3f} {r['resume_s'] / cold:7.2f} {r['load_s']:8.3f} "
                     f"{r['load_s'] / rows['memcpy']['load_s']:8.2f} {r['peak_extra_bytes'] / 2**20:9.0f}")
    lines.append(f"  peak MiB: the most memory a rank held above its start during the restore (its state: "
                 f"{result['state_bytes'] / result['ranks'] / 2**20:.0f} MiB; prefetch at most "
                 f"{result['prefetch_max_bytes'] / 2**20:.0f} MiB)")
    lines.append("  goals: prefetch resume <= 0.6x cold where the build takes as long as the read; its load <= 1.2x memcpy")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--mbps", type=float, default=400.0, help="the device's read bandwidth, shared; 0: no throttle")
    p.add_argument("--build-s", type=float, default=None)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--where", default=os.environ.get("TMPDIR", "/tmp"), help="a directory on a real disk")
    p.add_argument("--max-bytes", type=int, default=None, help="the prefetch's budget a rank (default: its share)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    result = run(a.gib, a.ranks, a.mbps, a.build_s, a.repeat, a.where, a.max_bytes)
    print(table(result), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
