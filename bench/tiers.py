"""The tiered manager's benchmark: a GPT-like state on 2 simulated nodes x 1 rank, each figure beside its floor.

    python -m bench.tiers                 # 2 GiB state (1 GiB per rank), 3 rounds
    python -m bench.tiers --gib 0.02 --repeat 1   # a smoke run

The nodes are network namespaces with a private tmpfs each where this runs as root (``distckpt.testing.Cluster``;
huge pages unless ``--pages 4k``), else folders under ``--memory-dir`` on loopback. A first job saves a step to
the tiers; node 1 is then killed (every process, and its tmpfs) and replaced, and a second job restores from node
0's replica and measures, in each round:

- a local save's blocked time, against one memcpy of the rank's state into memory that is already there;
- replication (the exchange of each rank's step with its holder), against a raw send of the same messages
  over the same process group, from and into memory that is already there, and against that send plus a raw
  write of the same bytes into a file of the node's tier (where a replica must land);
- a restore after node 1 loses its memory (its own steps and the replicas it held): from the replica,
  against cold restores of the same state from the durable tier on disk and from DCP's format, and a raw
  cold read of the same bytes;
- the durable write (``persist``), against DCP's save and a raw write + fsync of the same bytes.

Each figure is the slowest rank's time, best of the rounds (see docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from distckpt.testing.cluster import Cluster

from .measure import warm_memory

# (figure, floor or peer it is compared with, what the issue asks of the ratio figure / other)
_PAIRS = (
    ("blocked_s", "memcpy_s", "local save blocked / one memcpy", "<=", 1.2),
    ("replicate_s", "raw_send_s", "replication speed / raw send", ">=", 0.8),
    ("replicate_s", "raw_send_land_s", "replication speed / (raw send + raw landing)", None, None),
    ("restore_replica_s", "restore_durable_cold_s", "restore: replica vs cold durable (x faster)", ">=", 3.0),
    ("raw_send_one_way_s", "raw_read_cold_s", "floors: one-way raw send vs raw cold read (x faster)", None, None),
    ("restore_replica_s", "dcp_load_cold_s", "restore: replica vs cold DCP (x faster)", None, None),
    ("restore_durable_cold_s", "raw_read_cold_s", "cold durable restore / raw cold read", None, None),
    ("persist_s", "raw_write_s", "durable write / raw write+fsync", None, None),
    ("persist_s", "dcp_save_s", "durable write vs DCP save (x faster)", None, None),
)


def _ratio(fig: float, base: float, label: str) -> float:
    return base / fig if "speed" in label or "x faster" in label else fig / base


def report(res: dict) -> list[str]:
    best = {k: min(v) for k, v in res.items() if isinstance(v, list) and v and isinstance(v[0], float)}
    best["raw_send_land_s"] = best["raw_send_s"] + best["raw_land_s"]
    gb = res["bytes"] * res["world_size"] / 1e9
    lines = [f"tiered manager, {res['world_size']} nodes x 1 rank, {gb:.2f} GB state ({res['mode']} mode), "
             f"best of {res['repeat']} round(s), slowest rank"]
    for k in sorted(best):
        lines.append(f"  {k:<26}{best[k]:9.3f} s{gb / best[k]:9.2f} GB/s")
    lines.append("ratios in this run:")
    for fig, base, label, sign, goal in _PAIRS:
        if fig in best and base in best:
            r = _ratio(best[fig], best[base], label)
            mark = "ref   " if sign is None else ("met   " if (r <= goal if sign == "<=" else r >= goal) else "MISSED")
            target = f"  (goal {sign} {goal})" if sign else ""
            lines.append(f"  {mark} {label:<46}{r:7.2f}{target}")
    parts = min(res["restore_replica_parts"], key=lambda d: sum(d.values()))
    lines.append("  restore from a replica, slowest rank per part (s): " + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()))
    lines.append(f"  restore right after node 1 was killed and replaced (fresh processes): {best['restore_after_kill_s']:.3f} s;"
                 f" sources {res['first_report']['sources']}, bytes {res['first_report']['bytes_from']}")
    return lines


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=2.0, help="size of the whole state (each rank holds half)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--disk-dir", default=None, help="where the durable tier goes (default: under the current directory)")
    p.add_argument("--memory-dir", default="/dev/shm", help="where the cluster keeps its nodes (a tmpfs)")
    p.add_argument("--pages", choices=("huge", "4k"), default="huge",
                   help="the nodes' tmpfs pages in netns mode: huge (huge=within_size, as docs/tiers.md advises) or 4k")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    nodes = 2
    total = int(a.gib * (1 << 30))
    disk = tempfile.mkdtemp(prefix="distckpt-bench-tiers-", dir=a.disk_dir or os.getcwd())
    memory = tempfile.mkdtemp(prefix="distckpt-bench-tiers-", dir=a.memory_dir)
    env = {"DISTCKPT_FSYNC": "1", "DISTCKPT_CLUSTER_TIMEOUT_S": "600"}
    per_rank = total // nodes
    try:
        warm_memory(min(3 * a.gib + 1, 12))
        # a node's tier holds its own steps and the replicas it keeps (two of each while a new step is replicated),
        # a spare, and the raw floor's file
        with Cluster(memory, nodes=nodes, ranks_per_node=1, tmpfs_bytes=6 * per_rank + (256 << 20),
                     huge_pages=a.pages == "huge") as cluster:
            durable = os.path.join(disk, "durable")
            first = cluster.run("bench.tier_workers:first_save", env=env, timeout_s=1800, total=total, durable=durable)
            cluster.kill_node(1)
            cluster.replace_node(1)
            per = cluster.run("bench.tier_workers:rounds", env=env, timeout_s=3600, total=total, durable=durable,
                              scratch=os.path.join(disk, "scratch"), repeat=a.repeat)
            res = dict(per[0])
            mode = cluster.mode + (f", {a.pages} pages" if cluster.mode == "netns" else "")
            res.update(world_size=nodes, mode=mode, repeat=a.repeat, first_save=first[0]["timings"],
                       first_report=per[1]["first_report"], replica_report=per[1]["replica_report"])
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)
    lines = report(res)
    print("\n".join(lines), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
