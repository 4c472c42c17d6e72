"""Saves and loads on an object store, side by side with DCP and the raw client, in one run: ``gs://`` against
fake-gcs-server on loopback (a Go build of the GCS JSON API; tests/storage/gcs_server.py starts it).

    python -m bench.object_stores --mib 1024 --ranks 2 --repeat 3
    python -m bench.object_stores --mib 16 --repeat 1 --json out.json     # a smoke run

Peers, alternating each round, slowest rank of each operation, best of ``--repeat`` rounds:
  distckpt  distckpt.save / load with checkpoint_id="gs://bucket/..." (google-cloud-storage)
  dcp       torch.distributed.checkpoint through fsspec's gcsfs (FsspecWriter / FsspecReader), where gcsfs is installed
  raw       the floor: each rank's tensor bytes as one object each, uploaded and downloaded whole by the same client
            with as many threads as distckpt's write streams (DISTCKPT_OBJECT_WRITE_STREAMS); no format, checksum or metadata

The emulator keeps objects in its memory and runs on the same cores as the ranks, so the figures are the client's
and the format's costs on this machine, not a network's: see docs/performance.md for what they say and do not.
"""

from __future__ import annotations

import argparse
import importlib.util
import json

from distckpt.testing import run_ranks

from . import object_store_workers
from .measure import describe_machine, machine_state


def main(argv=None) -> dict:
    from tests.storage.gcs_server import gcs_server, new_bucket

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=1024, help="the state's size, all ranks together")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tensors", type=int, default=16, help="tensors per rank")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    peers = ["distckpt", "raw"] + (["dcp"] if importlib.util.find_spec("gcsfs") is not None else [])
    machine = {"start": machine_state("/tmp")}
    with gcs_server():
        from google.cloud import storage

        bucket = new_bucket(storage.Client())
        got = run_ranks(object_store_workers.rounds, args.ranks, bucket, args.mib << 20, args.tensors, args.repeat, peers,
                        timeout_s=3600, collective_timeout_s=600)[0]
    machine["end"] = machine_state("/tmp")
    best = {peer: {op: min(times) for op, times in ops.items()} for peer, ops in got.items()}
    print(f"\n{args.mib} MiB on gs:// (fake-gcs-server on loopback), {args.ranks} ranks, slowest rank, best of {args.repeat}")
    print(f"{'peer':10}{'save s':>9}{'raw/save':>10}{'load s':>9}{'raw/load':>10}")
    for peer, row in best.items():
        print(f"{peer:10}{row['save']:9.3f}{best['raw']['save'] / row['save']:10.2f}{row['load']:9.3f}"
              f"{best['raw']['load'] / row['load']:10.2f}")
    if "dcp" not in peers:
        print("dcp: not run (pip install gcsfs)")
    print(describe_machine(machine["start"]), "(at the start)")
    out = {"mib": args.mib, "ranks": args.ranks, "best": best, "rounds": got, "machine": machine}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
