"""Loading a Hugging Face checkpoint into a sharded model: distckpt beside the ways users do it today.

    python -m bench.hf_load                         # 1 GiB Llama-style model, 2 ranks, 3 rounds, on /dev/shm
    python -m bench.hf_load --gib 0.05 --repeat 1   # a smoke run

A Llama-style model of ``--gib`` GiB (float32) is written by ``save_pretrained`` in shards of ``--shard-mb``.
Then, in each round and in an order shuffled per round, fresh processes at ``--ranks`` ranks build the model
with FSDP2 and load it with each peer:

- ``distckpt``: ``distckpt.load(state, checkpoint_id=dir)``, each rank reading its own rows;
- ``dcp-hf``: torch's ``dcp.load`` with DCP's ``HuggingFaceStorageReader``;
- ``from_pretrained``: ``from_pretrained`` on rank 0, then ``set_model_state_dict(full_state_dict=True,
  broadcast_from_rank0=True)``, torch's documented way to shard a full state dict;
- ``raw``: the floor: each rank ``preadv``s exactly its rows of each tensor into its shard, no format, no checks.

Reported per peer: the slowest rank's time (best of the rounds), bytes read from files per rank (where counted:
distckpt's readers and the floor's; DCP's reader maps the files, so its reads do not show up as reads), and peak
RSS above the start of the load. Every peer's loaded shards are checked against the floor's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile

from distckpt.testing import run_ranks

from . import hf_workers

PEERS = ("distckpt", "dcp-hf", "from_pretrained", "raw")


def write_checkpoint(path: str, gib: float, shard_mb: int) -> int:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_workers.llama_config(gib))
    model.save_pretrained(path, max_shard_size=f"{shard_mb}MB")
    return sum(p.nbytes for p in model.state_dict().values())


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--shard-mb", type=int, default=200)
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="distckpt-bench-hf-", dir=a.dir)
    path = os.path.join(work, "hf")
    try:
        nbytes = write_checkpoint(path, a.gib, a.shard_mb)
        shards = len([n for n in os.listdir(path) if n.endswith(".safetensors")])
        runs: dict[str, list] = {peer: [] for peer in PEERS}
        for round_index in range(a.repeat):
            order = list(PEERS)
            random.Random(round_index).shuffle(order)
            for peer in order:
                runs[peer].append(run_ranks(hf_workers.load_round, a.ranks, peer, path, a.gib, timeout_s=1800,
                                            collective_timeout_s=900))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    floor = runs["raw"][0]
    for peer, rounds in runs.items():
        for per_rank in rounds:
            for r, got in enumerate(per_rank):
                if abs(got["fingerprint"] - floor[r]["fingerprint"]) > 1e-6 * max(1.0, abs(floor[r]["fingerprint"])):
                    raise SystemExit(f"{peer} loaded other values than the floor on rank {r}")
    results = {"gib": a.gib, "ranks": a.ranks, "nbytes": nbytes, "shards": shards, "peers": {}}
    for peer, rounds in runs.items():
        best = min(rounds, key=lambda per_rank: max(x["span_s"] for x in per_rank))
        results["peers"][peer] = {"time_s": max(x["span_s"] for x in best),
                                  "read_bytes_per_rank": [x["read_bytes"] for x in best],
                                  "local_bytes_per_rank": [x["local_bytes"] for x in best],
                                  "peak_rss_delta_mb_per_rank": [round(x["peak_rss_delta_mb"]) for x in best],
                                  "cpu_s_per_rank": [round(x["cpu_s"], 3) for x in best]}
    for line in report(results):
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


def report(results: dict) -> list[str]:
    floor = results["peers"]["raw"]["time_s"]
    lines = [f"Hugging Face load: {results['nbytes'] / (1 << 30):.2f} GiB in {results['shards']} shards into FSDP2 at "
             f"{results['ranks']} ranks (slowest rank, best of the rounds)",
             f"  {'peer':<16} {'time s':>8} {'floor/time':>10} {'read MiB per rank':>22} {'peak RSS MiB per rank':>24}"]
    for peer, r in results["peers"].items():
        reads = "/".join("-" if b is None else f"{b / (1 << 20):.0f}" for b in r["read_bytes_per_rank"])
        rss = "/".join(str(m) for m in r["peak_rss_delta_mb_per_rank"])
        lines.append(f"  {peer:<16} {r['time_s']:>8.3f} {floor / r['time_s']:>10.2f} {reads:>22} {rss:>24}")
    local = "/".join(f"{b / (1 << 20):.0f}" for b in results["peers"]["raw"]["local_bytes_per_rank"])
    lines.append(f"  each rank holds {local} MiB of the model")
    return lines


if __name__ == "__main__":
    main(sys.argv[1:])
