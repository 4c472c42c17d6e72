"""The tiered manager where it matters: a cluster whose durable store is shared by every node.

    python -m bench.tiers_shared                        # 2, 3 and 4 nodes x 1 rank, 64 MiB per rank, 3 rounds
    python -m bench.tiers_shared --nodes 2 --mib 8 --repeat 1   # a smoke run

Needs root (network namespaces and ``tc``). Each node is a network namespace with a private tmpfs
(``distckpt.testing.Cluster``); its link to the others is shaped to ``--link-mbit`` each way. The durable tier is
an S3 server (moto's) in a namespace of its own behind one link that every node shares, shaped to
``--store-mbit`` each way. The default ratio, 2:1 between one node's link and the whole store, is a real
cluster's scaled down to fit this machine: a 400 Gb/s NIC per node against a shared store of a few hundred Gb/s
in all (docs/tiers.md). A first job saves a step to the tiers and persists it (and DCP saves the same state to the
same store, through fsspec, where s3fs is installed: ``pip install "distckpt[bench-s3]"``); the last node is then
killed and replaced, and a second job measures, in each round:

- a save's blocked time against one memcpy of the rank's state;
- replication against a raw send of the same messages over the same links;
- a restore after the last node lost its memory: from its peers' replicas, against the same restore from the
  shared store (every node's memory lost), and DCP's load of the same state from the same store.

Each figure is the slowest rank's time, best of the rounds (docs/performance.md).
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


def run_size(nodes: int, a: argparse.Namespace) -> dict:
    total = nodes * (a.mib << 20)
    memory = tempfile.mkdtemp(prefix="distckpt-bench-shared-", dir=a.memory_dir)
    env = {"DISTCKPT_CLUSTER_TIMEOUT_S": "900"}
    try:
        with Cluster(memory, nodes=nodes, ranks_per_node=1, tmpfs_bytes=8 * (a.mib << 20) + (256 << 20),
                     link_mbit=a.link_mbit) as cluster:
            endpoint = cluster.start_store(a.store_mbit)
            first = cluster.run("bench.tier_shared_workers:first_job", env=env, timeout_s=1800, total=total,
                                endpoint=endpoint)
            cluster.kill_node(nodes - 1)
            cluster.replace_node(nodes - 1)
            per = cluster.run("bench.tier_shared_workers:rounds", env=env, timeout_s=3600, total=total,
                              endpoint=endpoint, repeat=a.repeat)
    finally:
        shutil.rmtree(memory, ignore_errors=True)
    res = dict(per[0])
    res.update(nodes=nodes, first=first[0], first_report=per[nodes - 1]["first_report"],
               peer_report=per[nodes - 1]["peer_report"], durable_report=per[0]["durable_report"])
    return res


def report(results: list[dict], a: argparse.Namespace) -> list[str]:
    lines = [f"tiered manager on a shaped cluster: node links {a.link_mbit} Mbit/s each way, one shared store link "
             f"{a.store_mbit} Mbit/s each way, {a.mib} MiB per rank, 1 rank per node, best of {a.repeat} round(s), "
             "slowest rank"]
    head = f"  {'nodes':>5} {'peers':>8} {'durable':>8} {'DCP':>8} {'dur/peer':>9} {'DCP/peer':>9} {'repl/raw':>9} " \
           f"{'blocked/memcpy':>15}"
    lines.append(head)
    for r in results:
        best = {k: min(v) for k, v in r.items() if isinstance(v, list) and v and isinstance(v[0], float)}
        peer, durable, dcp = best["restore_peer_s"], best["restore_durable_s"], best.get("dcp_load_s")
        lines.append(f"  {r['nodes']:>5} {peer:8.3f} {durable:8.3f} {dcp if dcp else float('nan'):8.3f} "
                     f"{durable / peer:9.2f} {(dcp / peer) if dcp else float('nan'):9.2f} "
                     f"{best['raw_send_s'] / best['replicate_s']:9.2f} {best['blocked_s'] / best['memcpy_s']:15.2f}")
    lines.append("  goals: dur/peer >= 3 at 4 nodes; the peer restore flat as nodes are added while the durable one "
                 "grows; repl/raw (replication speed / raw send) >= 0.8; blocked/memcpy <= 1.2")
    for r in results:
        parts = min(r["restore_peer_parts"], key=lambda d: sum(d.values()))
        lines.append(f"  {r['nodes']} nodes: restore from peers, slowest rank per part (s): "
                     + ", ".join(f"{k} {v:.3f}" for k, v in parts.items())
                     + f"; first restore after the loss (fresh processes) {r['restore_first_s']:.3f} s, sources "
                     f"{r['first_report']['sources']}")
    return lines


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--mib", type=int, default=64, help="state per rank, MiB")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--link-mbit", type=int, default=1000, help="each node's link, each way")
    p.add_argument("--store-mbit", type=int, default=500, help="the store's one link, shared by every node")
    p.add_argument("--memory-dir", default="/dev/shm")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("bench.tiers_shared needs root: each node is a network namespace with shaped links")
    warm_memory(2)
    results = []
    for nodes in a.nodes:
        results.append(run_size(nodes, a))
        print("\n".join(report(results, a)), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
