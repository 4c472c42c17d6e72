"""distckpt's benchmark suite: distckpt, torch.distributed.checkpoint, torch.save and safetensors,
side by side in one run, with ratios to distckpt.

    python -m bench.run                 # 2 GiB state, disk and tmpfs, 1 and 2 ranks
    python -m bench.run --gib 0.01 --small 500 --planning-ranks 16   # a smoke run

Ratios are peer time / distckpt time: above 1 means distckpt is faster. The
``raw`` row is the floor of each table: the same bytes moved with positioned
vectored I/O from as many threads as distckpt uses, one file each, with no format, checksum
or metadata. A target that asks for less time than ``raw`` cannot be met on
that machine by any checkpoint format.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time

import torch

from distckpt.testing import run_ranks

from . import planning_scale, targets, throttle, workers
from .before import Revision

TABLES = ("disk", "tmpfs", "small", "tiny", "reshard", "async", "planning")
from .measure import describe_machine, drop_cache, machine_state, warm_memory


def disk_baselines(location: str, nbytes: int) -> dict:
    """Raw sequential write+fsync and cold read bandwidth of ``location``; memcpy bandwidth."""
    path = os.path.join(location, "raw.bin")
    block = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8).numpy().tobytes()
    n = max(1, nbytes // len(block))
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for _ in range(n):
        os.write(fd, block)
    os.fsync(fd)
    os.close(fd)
    write = n * len(block) / (time.perf_counter() - t0) / 1e9
    drop_cache(location if os.path.isfile(path) else path)
    buf = bytearray(len(block))
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    while os.readv(fd, [buf]):
        pass
    os.close(fd)
    read = n * len(block) / (time.perf_counter() - t0) / 1e9
    os.remove(path)
    src = torch.empty(min(nbytes, 1 << 30), dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src).fill_(0)
    t0 = time.perf_counter()
    dst.copy_(src)
    memcpy = src.numel() / (time.perf_counter() - t0) / 1e9
    return {"write_fsync_gbps": write, "read_cold_gbps": read, "memcpy_gbps": memcpy}


def table(title: str, rows: dict, base_peer: str = "distckpt") -> list[str]:
    width = max([12] + [len(key.split("|")[0]) + 2 for key in rows])
    out = [f"\n{title}", f"{'peer':<{width}}{'op':<10}{'time s':>9}{'GB/s':>8}{'CPU s/GB':>10}{'peak RSS MB':>13}{'time vs distckpt':>18}"]
    for key, s in rows.items():
        peer, op = key.split("|")
        base = rows.get(f"{base_peer}|{op}")
        ratio = f"{s['wall_s'] / base['wall_s']:.2f}x" if base and peer != base_peer else ""
        out.append(f"{peer:<{width}}{op:<10}{s['wall_s']:9.3f}{s['gbps']:8.2f}{s['cpu_s_per_gb']:10.2f}{s['peak_rss_delta_mb']:13.0f}{ratio:>18}")
    return out


def _merge(per_rank: list[dict]) -> dict:
    """Slowest rank's time, summed CPU, largest RSS."""
    out = {}
    for key in per_rank[0]:
        samples = [r[key] for r in per_rank]
        worst = max(samples, key=lambda s: s["wall_s"])
        cpu = sum(s["cpu_s"] for s in samples)
        nbytes = sum(s["nbytes"] for s in samples)
        out[key] = worst | {"cpu_s": cpu, "nbytes": nbytes, "gbps": nbytes / worst["wall_s"] / 1e9,
                            "cpu_s_per_gb": cpu / (nbytes / 1e9), "peak_rss_delta_mb": max(s["peak_rss_delta_mb"] for s in samples)}
    return out


def _fastest(rounds: list[dict]) -> dict:
    """Each row's fastest run over ``rounds`` (dicts of merged rows), in first-seen order."""
    out: dict = {}
    for rows in rounds:
        for key, sample in rows.items():
            if key not in out or sample["wall_s"] < out[key]["wall_s"]:
                out[key] = sample
    return out


def async_table(results: dict, lines: list, total: int, disk: str, repeat: int, env: dict) -> None:
    rows = run_ranks(workers.async_round, 1, total, disk, repeat, env=env, timeout_s=3600)[0]
    train = rows.pop("train")
    results["async"] = rows | {"train": train}
    block = table("async_save on disk, 1 rank (blocking vs one in-memory copy; total vs sync save)", rows, base_peer="distckpt")
    print("\n".join(block), flush=True)
    lines += block
    print(f"  blocking / memcpy: {rows['async|blocking']['wall_s'] / rows['memcpy|copy']['wall_s']:.2f}x;"
          f" total / sync save: {rows['async|total']['wall_s'] / rows['distckpt|save']['wall_s']:.2f}x"
          # staging copies every byte once before the write starts, so with no overlap the total is at least copy + save
          f" (copy + save: {1 + rows['memcpy|copy']['wall_s'] / rows['distckpt|save']['wall_s']:.2f}x)", flush=True)
    print(f"  training on every core while the write runs: {train['during_steps_per_s'] / train['alone_steps_per_s']:.0%}"
          f" of its speed alone; the save took {train['write_s']:.2f} s "
          f"(DISTCKPT_ASYNC_NICE={os.environ.get('DISTCKPT_ASYNC_NICE', 10)})", flush=True)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=2.0, help="size of the GPT-like state")
    p.add_argument("--small", type=int, default=20000, help="count of small tensors")
    p.add_argument("--tiny", type=int, default=200000, help="count of tiny tensors (0: skip)")
    p.add_argument("--disk-dir", default=None,
                   help="a directory on the disk to measure (default: a temporary one under the current directory)")
    p.add_argument("--tmpfs-dir", default="/dev/shm")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--planning-ranks", type=int, nargs="+", default=[512])
    p.add_argument("--repeat", type=int, default=3, help="runs of each measurement; the fastest is reported "
                   "(single runs here vary 2-3x with page-cache and host memory state; see bench/measure.py best())")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--throttle-mbps", type=float, nargs="+", default=[],
                   help="also run the disk tables with writes limited to each of these MB/s (bench/throttle.py; needs root)")
    p.add_argument("--only", nargs="+", choices=TABLES, default=None, metavar="TABLE",
                   help=f"run only these tables ({', '.join(TABLES)}; default: all)")
    p.add_argument("--before", default=None, metavar="REV",
                   help="also run the tmpfs and reshard tables on git revision REV, in turn with this one (bench/before.py)")
    p.add_argument("--warm-gib", type=float, default=None, help="memory to touch first (default: 4x the state, at most 60%% of RAM)")
    a = p.parse_args(argv)
    total = int(a.gib * (1 << 30))
    if a.warm_gib is None:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
        a.warm_gib = min(4 * a.gib + 1, 0.6 * ram)
    disk = tempfile.mkdtemp(prefix="distckpt-bench-", dir=a.disk_dir or os.getcwd())
    tmpfs = tempfile.mkdtemp(prefix="distckpt-bench-", dir=a.tmpfs_dir)
    env = {"DISTCKPT_FSYNC": "1", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // max(a.ranks)))}
    results: dict = {"config": vars(a), "machine": {"start": machine_state(disk, tmpfs)}}
    lines = [f"distckpt benchmark: {total / 2**30:.2f} GiB GPT-like state, {a.small} small tensors, torch {torch.__version__}, "
             f"{os.cpu_count()} CPUs", describe_machine(results["machine"]["start"])]
    print(lines[-1], flush=True)
    before = Revision(a.before) if a.before else None
    try:
        warm_memory(a.warm_gib)
        want = set(a.only or TABLES)
        runs = [disk_baselines(disk, total) for _ in range(a.repeat)] if "disk" in want else [disk_baselines(disk, 1 << 26)]
        base = {k: max(r[k] for r in runs) for k in runs[0]}
        results["baselines"] = base
        lines.append(f"raw disk: write+fsync {base['write_fsync_gbps']:.2f} GB/s, cold read {base['read_cold_gbps']:.2f} GB/s; "
                     f"memcpy {base['memcpy_gbps']:.2f} GB/s")
        print(lines[-1], flush=True)
        for loc_name, loc, cold in (("disk", disk, True), ("tmpfs", tmpfs, False)):
            for n in a.ranks if loc_name in want else ():
                if before is None or cold:
                    rows = _merge(run_ranks(workers.peers_round, n, total, loc, cold, a.repeat, env=env, timeout_s=3600))
                else:  # this revision and the other in turn, twice
                    rounds = []
                    for _ in range(2):
                        rounds.append(_merge(run_ranks(workers.peers_round, n, total, loc, cold, a.repeat, env=env, timeout_s=3600)))
                        old = _merge(before.peers_rows(n, total, loc, cold, a.repeat, env))
                        rounds.append({f"distckpt@{before.short}|{op}": old[f"distckpt|{op}"] for op in ("save", "load")})
                    rows = _fastest(rounds)
                results[f"{loc_name}/{n}"] = rows
                block = table(f"{loc_name}, {n} rank(s){', cold-cache loads' if cold else ', warm loads'}", rows)
                print("\n".join(block), flush=True)
                lines += block
        for mbps in a.throttle_mbps:
            with throttle.throttled_writes(mbps, disk, total) as slow:
                for n in a.ranks:
                    rows = _merge(run_ranks(workers.peers_round, n, total, slow, True, a.repeat, env=env, timeout_s=3600))
                    results[f"disk@{mbps:g}MBps/{n}"] = rows
                    block = table(f"disk throttled to {mbps:g} MB/s, {n} rank(s), cold-cache loads", rows)
                    print("\n".join(block), flush=True)
                    lines += block
        for key, count, tiny, what in (("small", a.small, False, "small tensors (1-64 KiB)"),
                                       ("tiny", a.tiny, True, "tiny tensors (64 B-4 KiB)")):
            if not count or key not in want:
                continue
            rows = run_ranks(workers.small_round, 1, count, tmpfs, a.repeat, tiny, env=env, timeout_s=3600)[0]
            results[key] = rows
            block = table(f"{count} {what}, tmpfs, 1 rank", rows)
            print("\n".join(block), flush=True)
            lines += block
        if "reshard" in want:
            run_ranks(workers.reshard_save, 2, total, tmpfs, env=env, timeout_s=3600)
        for n in (1, 2) if "reshard" in want else ():
            if before is None:
                rows = _merge(run_ranks(workers.reshard_load, n, total, tmpfs, 2, a.repeat, env=env, timeout_s=3600))
            else:  # this revision and the other in turn, twice, on the same files; the first load of a process pays
                # for warming it
                rounds = []
                for _ in range(2):
                    rounds.append(_merge(run_ranks(workers.reshard_load, n, total, tmpfs, 2, a.repeat, env=env, timeout_s=3600)))
                    old = _merge(before.reshard_rows(total, tmpfs, n, a.repeat, env))
                    rounds.append({f"distckpt@{before.short}|load": old["distckpt|load"]})
                rows = _fastest(rounds)
            results[f"reshard/{n}"] = rows
            block = table(f"reshard: saved at 2 ranks (Shard(0)), loaded at {n} rank(s){' as Shard(1)' if n > 1 else ''}, tmpfs", rows)
            print("\n".join(block), flush=True)
            lines += block
        if "async" in want:
            async_table(results, lines, total, disk, a.repeat, env)
        if "planning" in want:
            print("\nplanning at scale (coordinator path, simulated):", flush=True)
            results["planning"] = planning_scale.main(["--ranks", *map(str, a.planning_ranks), "--repeat", str(a.repeat)])
        checked = targets.evaluate(results)
        results["targets"] = [dataclasses.asdict(t) | {"met": t.met} for t in checked]
        print("\n".join(targets.report(checked)), flush=True)
    finally:
        results["machine"]["end"] = machine_state(disk, tmpfs)
        print(describe_machine(results["machine"]["end"]), flush=True)
        if before is not None:
            before.close()
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(tmpfs, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
