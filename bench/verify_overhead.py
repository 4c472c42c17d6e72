"""Verified load vs unverified load of the same checkpoint (issue: verified within 10%).

python bench/verify_overhead.py [--gib 2] [--dir /tmp] [--repeat 3]
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

import distckpt


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--dir", default=None)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args(argv)
    os.environ.setdefault("DISTCKPT_FSYNC", "0")
    root = tempfile.mkdtemp(dir=a.dir, prefix="distckpt-bench-")
    try:
        n = int(a.gib * (1 << 30) / 4)
        per = (64 << 20) // 4 if n > (64 << 20) else n
        sizes = [per] * (n // per) + ([n % per] if n % per else [])
        sd = {f"t{i}": torch.randn(s) for i, s in enumerate(sizes)}
        path = os.path.join(root, "ck")
        distckpt.save(sd, checkpoint_id=path)
        dest = {k: torch.empty_like(v) for k, v in sd.items()}
        times = {True: [], False: []}
        for _ in range(a.repeat):
            for verify in (False, True):
                t0 = time.perf_counter()
                distckpt.load(dest, storage_reader=distckpt.FileSystemReader(path, verify_checksums=verify))
                times[verify].append(time.perf_counter() - t0)
        gb = n * 4 / 1e9
        u, v = statistics.median(times[False]), statistics.median(times[True])
        print(f"state {gb:.2f} GB in {len(sizes)} tensors, warm page cache, {a.repeat} runs (median)")
        print(f"unverified load: {u:.3f} s ({gb / u:.2f} GB/s)")
        print(f"verified load:   {v:.3f} s ({gb / v:.2f} GB/s)")
        print(f"verified / unverified: {v / u:.3f}x")
        t0 = time.perf_counter()
        distckpt.verify(path)
        t = time.perf_counter() - t0
        print(f"distckpt.verify: {t:.3f} s ({gb / t:.2f} GB/s)")
        return v / u
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
