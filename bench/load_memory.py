"""Memory on load: the peak RSS a load adds above its destination tensors, on every load path, against
DISTCKPT_MEMORY_BUDGET_BYTES.

    python -m bench.load_memory --gib 2             # 2 GiB GPT-like state, S3 rows at 0.25 GiB
    python -m bench.load_memory --gib 0.004 --s3-gib 0.004   # a smoke run

Each layout is saved by fresh processes, then each row loads it in fresh processes (gloo ranks) into destinations
already allocated and touched. After a load of one small key (imports, clients, the process group's first
buffers) and a ``malloc_trim``, a rank resets its peak RSS (VmHWM, /proc/self/clear_refs) and reads VmRSS; the
row reports the largest peak above that level over the ranks, beside the budget and the bytes of destinations
each rank holds. Every load is checked value for value. Rows over the budget are marked; DCP's own load is the
peer, with no budget of its own.

Rows: distckpt's checkpoint saved at 2 ranks (Shard(0)) and loaded at 3 as Shard(1) and as Shard(0); a fully
replicated state saved at 1 rank and loaded at 4; the same state saved by DCP, loaded by distckpt (its DCP layout)
and by DCP itself; a Hugging Face directory and a ``torch.save`` file of it, loaded at 3 ranks as Shard(1) by each
rank reading its rows and by distckpt's and DCP's BroadcastingTorchSaveReader (rank 0 reads, then broadcasts);
distckpt's checkpoint on S3 (moto's server on loopback) at ``--s3-gib``, 2 -> 3. Shared reads are set on
(DISTCKPT_SHARED_READS=1) or off in each row: by default ranks of one node reading a file system do not share.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from typing import Iterator, Optional

from distckpt.testing import run_ranks

from . import load_memory_workers as w

# shared reads on and off, each row set explicitly: by default ("auto") ranks of one node reading a file system
# do not share, and these rows stand for ranks spread over nodes as much as for one
ON, OFF = {"DISTCKPT_SHARED_READS": "1"}, {"DISTCKPT_SHARED_READS": "0"}
# (row, layout saved, ranks saving, reader, ranks loading, destinations, extra environment of the load)
ROWS = (
    ("reshard 2->3 Shard(1)", "distckpt", 2, "distckpt", 3, "shard1", ON),
    ("  same, DISTCKPT_SHARED_READS=0", "distckpt", 2, "distckpt", 3, "shard1", OFF),
    ("reshard 2->3 Shard(0)", "distckpt", 2, "distckpt", 3, "shard0", ON),
    ("broadcast 1->4 replicated", "replicated", 1, "distckpt", 4, "full", ON),
    ("  same, DISTCKPT_SHARED_READS=0", "replicated", 1, "distckpt", 4, "full", OFF),
    ("DCP dir 2->3 Shard(1)", "dcp", 2, "distckpt", 3, "shard1", ON),
    ("  same, DISTCKPT_SHARED_READS=0", "dcp", 2, "distckpt", 3, "shard1", OFF),
    ("  DCP's own load (peer)", "dcp", 2, "dcp", 3, "shard1", {}),
    ("HF dir ->3 Shard(1)", "hf", 2, "distckpt", 3, "shard1", ON),
    ("  same, DISTCKPT_SHARED_READS=0", "hf", 2, "distckpt", 3, "shard1", OFF),
    ("torch.save file ->3 Shard(1)", "torch.save", 1, "distckpt", 3, "shard1", ON),
    ("  BroadcastingTorchSaveReader", "torch.save", 1, "distckpt-bcast", 3, "shard1", {}),
    # DCP's reader broadcasts torch.empty_like(destination): of a DTensor sharded unevenly it hangs, so plain ones
    ("  DCP's BroadcastingTorchSaveReader", "torch.save", 1, "dcp-bcast", 3, "full", {}),
    ("S3 reshard 2->3 Shard(1)", "s3", 2, "distckpt", 3, "shard1", ON),
    ("  same, DISTCKPT_SHARED_READS=0", "s3", 2, "distckpt", 3, "shard1", OFF),
)
LAYOUTS = ("distckpt", "replicated", "dcp", "hf", "torch.save", "s3")


@contextmanager
def s3_bucket() -> Iterator[tuple[str, dict]]:
    """moto's S3 server on loopback, in this process, and a fresh bucket; the environment ranks need to reach it."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL_S3": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1",
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    try:
        client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL_S3"], region_name="us-east-1",
                              aws_access_key_id="bench", aws_secret_access_key="bench")
        client.create_bucket(Bucket="load-memory")
        yield "s3://load-memory", env
    finally:
        server.stop()


def run(a: argparse.Namespace, work: str, s3: Optional[tuple[str, dict]]) -> list[dict]:
    budget = int(a.budget_mib * (1 << 20))
    env = {"DISTCKPT_MEMORY_BUDGET_BYTES": str(budget), "DISTCKPT_FSYNC": "0", "OMP_NUM_THREADS": "1"}
    if a.threads:
        env["DISTCKPT_IO_THREADS"] = str(a.threads)
    rows = []
    for layout in LAYOUTS:
        wanted = [r for r in ROWS if r[1] == layout and (not a.only or layout in a.only)]
        if not wanted or (layout == "s3" and s3 is None):
            continue
        size = int((a.s3_gib if layout == "s3" else a.gib) * (1 << 30))
        if layout == "s3":
            path, layout_env = f"{s3[0]}/ck", s3[1]
        else:
            path, layout_env = os.path.join(work, layout.replace(".", "_")) + (".pt" if layout == "torch.save" else ""), {}
        saving = wanted[0][2]
        run_ranks(w.save, saving, layout, size, path, env=env | layout_env, timeout_s=1200, collective_timeout_s=600)
        for name, _, _, reader, ranks, placement, extra in wanted:
            per_rank = run_ranks(w.load, ranks, reader, size, path, placement, env=env | layout_env | extra, timeout_s=1200,
                                 collective_timeout_s=600)
            worst = max(per_rank, key=lambda r: r["above_mib"])
            row = {"row": name, "reader": reader, "ranks": ranks, "state_bytes": size,
                   "dest_mib_per_rank": max(r["dest_bytes"] for r in per_rank) / (1 << 20),
                   "above_mib": worst["above_mib"], "above_mib_per_rank": [round(r["above_mib"], 1) for r in per_rank],
                   "budget_mib": a.budget_mib, "wall_s": max(r["wall_s"] for r in per_rank)}
            row["ratio"] = row["above_mib"] / a.budget_mib
            row["exceeds"] = reader.startswith("distckpt") and row["ratio"] > 1
            rows.append(row)
            print(format_row(row), flush=True)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.isfile(path):
            os.remove(path)
    return rows


HEADER = f"{'row':<36}{'ranks':>6}{'state MiB':>10}{'dest MiB/rank':>14}{'RSS above dests MiB':>21}{'/ budget':>9}{'time s':>8}"


def format_row(row: dict) -> str:
    flag = "  EXCEEDS" if row["exceeds"] else ("  (peer)" if not row["reader"].startswith("distckpt") else "")
    return (f"{row['row']:<36}{row['ranks']:>6}{row['state_bytes'] / (1 << 20):>10.0f}{row['dest_mib_per_rank']:>14.0f}"
            f"{row['above_mib']:>21.1f}{row['ratio']:>9.2f}{row['wall_s']:>8.2f}{flag}")


def report(rows: list[dict], a: argparse.Namespace) -> list[str]:
    lines = [f"memory on load: peak RSS above touched destinations, largest rank; budget {a.budget_mib:g} MiB "
             f"(DISTCKPT_MEMORY_BUDGET_BYTES), {a.threads or 'default'} I/O threads per rank", HEADER]
    lines += [format_row(r) for r in rows]
    over, parent = [], ""
    for r in rows:
        parent = parent if r["row"].startswith(" ") else r["row"]
        if r["exceeds"]:
            over.append(r["row"] if r["row"] == parent else f"{parent} ({r['row'].strip()})")
    lines.append(f"over the budget: {', '.join(over)}" if over else "every distckpt row within the budget")
    return lines


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=2.0, help="size of the GPT-like state")
    p.add_argument("--s3-gib", type=float, default=0.25, help="size of the state of the S3 row (moto is slow)")
    p.add_argument("--budget-mib", type=float, default=256.0, help="DISTCKPT_MEMORY_BUDGET_BYTES of every load, in MiB")
    p.add_argument("--threads", type=int, default=4, help="DISTCKPT_IO_THREADS of every rank (0: distckpt's default)")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory under /tmp)")
    p.add_argument("--only", nargs="+", choices=LAYOUTS, default=None, metavar="LAYOUT",
                   help=f"only the rows of these saved layouts ({', '.join(LAYOUTS)})")
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="distckpt-load-memory-", dir=a.dir)
    print(HEADER, flush=True)
    try:
        if a.only and "s3" not in a.only:
            rows = run(a, work, None)
        else:
            with s3_bucket() as s3:
                rows = run(a, work, s3)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = report(rows, a)
    print("\n" + "\n".join(lines), flush=True)
    results = {"config": vars(a), "rows": rows, "table": lines}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
