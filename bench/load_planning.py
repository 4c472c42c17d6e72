"""Planning a load at thousands of ranks, simulated: what a rank does before its first read and what the coordinator
does between, for one rank in the middle of the world (the others do the same work on their own tables).

    python -m bench.load_planning --ranks 16 256 1024 4096 --keys 10000 --sharded-keys 250

Two states, each loaded at the world size it was saved at:
  replicated  ``--keys`` plain tensors (16 x 64 float32): every rank needs every chunk, so every rank lists every
              chunk and the coordinator assigns each to one reader (shared reads)
  mixed       planning_scale.py's state: ``--sharded-keys`` DTensors sharded (Shard(0)) over the world plus as many
              replicated tensors, its metadata built by distckpt's save coordinator at that world size

Timed, best of ``--repeat``: the metadata parse (every rank), the rank's local plan (the default load planner, on
torch's fake process group of that size for the DTensors), its table of chunks another rank may need, the
coordinator's assignment over every rank's table (``assign_readers``: decoding the tables and ``plan_shares``; in
both states every rank's table is the same, so the coordinator is given ``ranks`` copies of the middle rank's: it
receives one, from the first rank holding it, and the others' digests in the vote), and the rank's decoding of its
answer. ``rank s`` is the sum of the rank's own steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

_WORKER = "bench.load_planning"


def _best(fn, repeat: int):
    best, out = None, None
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        out = fn()
        took = time.perf_counter() - t0
        best = took if best is None else min(best, took)
    return best, out


def _rank_and_coordinator(world: int, path: str, state: dict, alone_from_planner: bool, repeat: int) -> dict:
    """Every step of one middle rank, and the coordinator's, on the checkpoint at ``path``."""
    import gc
    from types import SimpleNamespace

    import distckpt
    from distckpt.engine.shared_plan import Shares
    from distckpt.planning import DefaultLoadPlanner

    rank = world // 2
    gc.disable()  # as distckpt.load runs
    reader = distckpt.FileSystemReader(path, shared_reads=True)
    parse_s, md = _best(reader.read_metadata, repeat)
    planner = DefaultLoadPlanner()

    def local_plan():
        planner.set_up_planner(state, md, False)
        return planner.create_local_plan()

    plan_s, plan = _best(local_plan, repeat)
    reader.set_up_storage_reader(md, False)
    alone = planner.keys_held_alone() if alone_from_planner else set()
    table_s, (chunks, table) = _best(lambda: reader.read_chunks(plan, alone), repeat)
    assign_s, payloads = _best(lambda: reader.assign_readers([table] * world), repeat)
    peers = SimpleNamespace(rank=rank, world_size=world)
    decode_s, shares = _best(lambda: Shares.decode(payloads[rank], chunks, peers), repeat)
    gc.enable()
    return {"ranks": world, "parse_s": parse_s, "local_plan_s": plan_s, "table_s": table_s, "assign_s": assign_s,
            "decode_s": decode_s, "rank_s": parse_s + plan_s + table_s + decode_s, "listed_chunks": len(chunks),
            # the ranks' tables are alike: the first rank of the class sends it, the others only its digest in the vote
            "table_bytes": len(table), "gathered_bytes": len(table), "payload_bytes": len(payloads[rank]),
            "scattered_bytes": sum(map(len, payloads)), "messages": len(shares.messages)}


def replicated(world: int, keys: int, path: str, repeat: int) -> dict:
    import torch

    state = {f"rep{i}": torch.zeros(16, 64) for i in range(keys)}
    return {"state": "replicated", "keys": keys, **_rank_and_coordinator(world, path, state, False, repeat)}


def save_replicated(keys: int, path: str) -> None:
    import torch

    import distckpt

    distckpt.save({f"rep{i}": torch.full((16, 64), float(i)) for i in range(keys)}, checkpoint_id=path)


def mixed_worker(world: int, items: int, path: str, repeat: int) -> dict:
    """In a fresh interpreter: torch's fake process group of ``world`` ranks, this process its middle rank."""
    from bench import planning_scale as ps

    _, state = ps.middle_rank_state(world, items)
    return {"state": "mixed", "keys": items, **_rank_and_coordinator(world, path, state, True, repeat)}


def mixed(world: int, sharded_keys: int, scratch: str, repeat: int) -> dict:
    """planning_scale.py's metadata for ``world`` ranks, written as a checkpoint whose data files are sparse files of
    their recorded sizes (the planning reads only the metadata), then mixed_worker on it."""
    from bench import planning_scale as ps
    from distckpt.format.codec import parse_metadata

    items = 2 * sharded_keys
    ps.distckpt_path(world, items)
    doc = ps.LAST_DOCUMENTS["distckpt"]
    path = os.path.join(scratch, f"mixed-{world}")
    os.makedirs(path)
    md = parse_metadata(doc, "bench")
    for name, info in md.storage_data.files.items():
        with open(os.path.join(path, name), "wb") as f:
            f.truncate(info.size)
    with open(os.path.join(path, "metadata.json"), "wb") as f:
        f.write(doc)
    code = ("import json, sys; from bench import load_planning as lp; "
            "print(json.dumps(lp.mixed_worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))))")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code, str(world), str(items), path, str(repeat)], capture_output=True,
                          text=True, cwd=here)
    if done.returncode != 0:
        raise RuntimeError(f"mixed planning at {world} ranks failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 256, 1024, 4096])
    p.add_argument("--keys", type=int, default=10000, help="replicated state: plain tensors")
    p.add_argument("--sharded-keys", type=int, default=250, help="mixed state: DTensors (and as many plain tensors)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args(argv)
    rows = []
    cols = ("parse_s", "local_plan_s", "table_s", "decode_s", "rank_s", "assign_s")
    print(f"{'state':>10} {'keys':>6} {'ranks':>6} " + " ".join(f"{c:>13}" for c in cols)
          + f" {'listed':>7} {'gathered MB':>12} {'scattered MB':>13}")
    with tempfile.TemporaryDirectory(prefix="distckpt-load-planning-") as scratch:
        rep_path = os.path.join(scratch, "replicated")
        save_replicated(a.keys, rep_path)
        for world in a.ranks:
            for row in (replicated(world, a.keys, rep_path, a.repeat), mixed(world, a.sharded_keys, scratch, a.repeat)):
                rows.append(row)
                print(f"{row['state']:>10} {row['keys']:>6} {world:>6} " + " ".join(f"{row[c]:13.4f}" for c in cols)
                      + f" {row['listed_chunks']:>7} {row['gathered_bytes'] / 1e6:12.1f} {row['scattered_bytes'] / 1e6:13.1f}",
                      flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
