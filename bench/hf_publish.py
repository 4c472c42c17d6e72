"""Publishing a sharded model as a Hugging Face checkpoint: distckpt beside the ways users do it today, and the floor.

    python -m bench.hf_publish                      # 1 GiB Llama-style model, 2 ranks, 3 rounds, on /dev/shm
    python -m bench.hf_publish --small              # a smoke run (0.01 GiB, 3 MB shards, 1 round)

A Llama-style model of ``--gib`` GiB (float32, the config of bench/hf_load.py) is built with FSDP2 at ``--ranks``
ranks (gloo, CPU) and filled with random values. In each round, in an order shuffled per round, fresh processes
publish it into a new directory under ``--dir`` with each peer, in shards of at most ``--shard-mb`` MB:

- ``distckpt``: ``distckpt.save(state, storage_writer=HuggingFaceWriter(dir, max_shard_size=..., config=...))``,
  each rank writing its rows straight into the shards;
- ``dcp-hf``: torch's ``dcp.save`` with ``HuggingFaceStorageWriter(save_distributed=True,
  enable_consolidation=True, fqn_to_index_mapping=<the same shards>)``: each rank writes its own files under
  ``sharded/``, then rank 0 consolidates them into the final shards (and leaves ``sharded/`` behind);
- ``save_pretrained``: ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` gathers the model on
  rank 0, which writes it with ``model.save_pretrained(dir, state_dict=..., max_shard_size=...)``;
- ``raw``: the floor: each rank ``pwrite``s its local shards' bytes into files of its own (bench.workers' raw
  save: one file per I/O thread), no format.

Durability is the same for every peer: with DISTCKPT_FSYNC on (the default; ``--no-fsync`` turns it off),
distckpt syncs its shards, index, config and directory, the floor each file, DCP its per-rank files itself, and
the bench syncs the files DCP's consolidation and save_pretrained leave unsynced (rank 0, inside the timed call).

Reported per peer: the time from a barrier before the call to a barrier after it (best of the rounds), that
time over the floor's, the peak RSS above the start of the call per rank (VmRSS sampled every 2 ms from a thread;
beside it VmHWM, reset before the call, which also catches spikes shorter than a sample), and the bytes the output
takes on the file system. Every output is checked after its timed call: each rank reads its rows of every tensor
back with ``safetensors`` from the shard the index names and compares them with the model's local shards; the
shards and the index must be the expected ones; distckpt's directory is also loaded with ``from_pretrained``
(rank 0's rows compared); the floor's files are read back. The run fails unless every byte of the model was
checked in every peer's every round.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

from distckpt.testing import run_ranks

from . import hf_publish_workers

PEERS = ("distckpt", "dcp-hf", "save_pretrained", "raw")


def _fs_type(path: str) -> str:
    try:
        out = subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0, help="model size in GiB of float32 weights")
    p.add_argument("--small", action="store_true", help="a smoke run: --gib 0.01 --shard-mb 3 --repeat 1")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--shard-mb", type=int, default=200, help="max_shard_size in MB (10**6 bytes), as save_pretrained takes it")
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                   help="where the output directories are made (default /dev/shm, a tmpfs)")
    p.add_argument("--fsync", action=argparse.BooleanOptionalAction, default=None,
                   help="sync every peer's output (default: DISTCKPT_FSYNC, on unless set to 0)")
    p.add_argument("--json", default=None)
    p.add_argument("--txt", default=None, help="also write the command line, the machine's load and the table here")
    a = p.parse_args(argv)
    if a.small:
        a.gib, a.shard_mb, a.repeat = 0.01, 3, 1
    if a.fsync is None:
        a.fsync = os.environ.get("DISTCKPT_FSYNC", "1").strip().lower() not in ("0", "false", "no", "off")
    size = f"{a.shard_mb}MB"
    load_before = os.getloadavg()
    work = tempfile.mkdtemp(prefix="distckpt-bench-hf-publish-", dir=a.dir)
    fs = _fs_type(work)
    runs: dict[str, list] = {peer: [] for peer in PEERS}
    try:
        for round_index in range(a.repeat):
            order = list(PEERS)
            random.Random(round_index).shuffle(order)
            for peer in order:
                out = os.path.join(work, f"{peer}-{round_index}")
                runs[peer].append(run_ranks(hf_publish_workers.publish_round, a.ranks, peer, out, a.gib, size,
                                            peer == "distckpt", timeout_s=1800, collective_timeout_s=900,
                                            env={"DISTCKPT_FSYNC": "1" if a.fsync else "0"}))
                shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    total = runs["raw"][0][0]["total_bytes"]
    for peer, rounds in runs.items():
        for per_rank in rounds:
            checked = sum(x["checked_bytes"] for x in per_rank)
            if checked != total:
                raise SystemExit(f"{peer}: the check covered {checked} bytes of the model's {total}")
            if peer == "distckpt" and not per_rank[0]["from_pretrained"]:
                raise SystemExit("distckpt's directory was not loaded with from_pretrained")
    first = runs["raw"][0][0]
    results = {"gib": a.gib, "ranks": a.ranks, "dtype": "float32", "nbytes": total, "shards": first["shards"],
               "max_shard_size": size, "same_split_as_save_pretrained": first["same_split_as_save_pretrained"],
               "fsync": a.fsync, "dir": a.dir, "fs": fs, "repeat": a.repeat,
               "loadavg_before": list(load_before), "loadavg_after": list(load_after), "peers": {}}
    for peer, rounds in runs.items():
        best = min(rounds, key=lambda per_rank: max(x["span_s"] for x in per_rank))
        results["peers"][peer] = {"time_s": max(x["span_s"] for x in best),
                                  "times_s": [round(max(x["span_s"] for x in r), 4) for r in rounds],
                                  "wall_s_per_rank": [round(x["wall_s"], 4) for x in best],
                                  "cpu_s_per_rank": [round(x["cpu_s"], 3) for x in best],
                                  "peak_rss_delta_mb_per_rank": [round(x["peak_rss_delta_mb"]) for x in best],
                                  "hwm_delta_mb_per_rank": [round(x["hwm_delta_mb"]) for x in best],
                                  "local_bytes_per_rank": [x["local_bytes"] for x in best],
                                  "out_bytes": best[0]["out_bytes"],
                                  "checked_bytes": sum(x["checked_bytes"] for x in best),
                                  "from_pretrained": best[0]["from_pretrained"]}
    lines = report(results)
    for line in lines:
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if a.txt:
        command = "python -m bench.hf_publish " + " ".join(argv if argv is not None else sys.argv[1:])
        with open(a.txt, "w") as f:
            f.write(f"{command}   ({os.cpu_count()} cores, {fs} {a.dir}, CPU; {datetime.date.today().isoformat()}; "
                    f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after)\n")
            f.write("\n".join(lines) + "\n")
    return results


def report(results: dict) -> list[str]:
    floor = results["peers"]["raw"]["time_s"]
    mib = 1 << 20
    lines = [f"Hugging Face publish: {results['nbytes'] / (1 << 30):.2f} GiB ({results['dtype']}) from FSDP2 at "
             f"{results['ranks']} ranks into {results['shards']} shards of <= {results['max_shard_size']}, "
             f"{results['fs']} {results['dir']}, DISTCKPT_FSYNC={int(results['fsync'])} "
             f"(slowest rank, best of {results['repeat']} rounds)",
             f"  {'peer':<16} {'time s':>8} {'time/floor':>10} {'peak RSS MiB per rank':>22} {'(VmHWM)':>10} {'on disk MiB':>12}  rounds s"]
    for peer, r in results["peers"].items():
        rss = "/".join(str(m) for m in r["peak_rss_delta_mb_per_rank"])
        hwm = "/".join(str(m) for m in r["hwm_delta_mb_per_rank"])
        times = " ".join(f"{t:.3f}" for t in r["times_s"])
        lines.append(f"  {peer:<16} {r['time_s']:>8.3f} {r['time_s'] / floor:>10.2f} {rss:>22} {hwm:>10} "
                     f"{r['out_bytes'] / mib:>12.0f}  {times}")
    local = "/".join(f"{b / mib:.0f}" for b in results["peers"]["raw"]["local_bytes_per_rank"])
    lines.append(f"  each rank holds {local} MiB of the model; every output read back and equal to it "
                 f"({', '.join(p for p, r in results['peers'].items() if r['from_pretrained'])} also via from_pretrained)")
    if not results["same_split_as_save_pretrained"]:
        lines.append("  NOTE: save_pretrained split the state into other shards than distckpt (a tensor over the shard size "
                     "follows others); each was checked against its own split")
    if results["fsync"]:
        lines.append("  synced: distckpt (shards, index, config, dir), raw (its files), dcp-hf (sharded/ files; the bench "
                     "syncs the consolidated ones), save_pretrained (by the bench)")
    return lines


if __name__ == "__main__":
    main(sys.argv[1:])
