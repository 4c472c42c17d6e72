"""torch_checkpointing's save and load: its own filesystem backend against distckpt's, beside the raw floor.

    python -m bench.torch_checkpointing --gib 1 [--dir /tmp] [--repeat 5]

One rank, torch_checkpointing's synchronous CheckpointManager (its default ``<item>_<rank>.pt`` torch.save
layout), the state a dict of float32 tensors of 64 MiB. Each round saves with every variant in a random
order, then loads each cold (page cache dropped, as ``bench.measure.drop_cache`` does); the table gives the
best round of each (docs/performance.md: the noise only adds time) and the median. Variants:

- ``tc-fs``: ``LocalFileSystemStorageConfig(use_direct_io=False)``, as torch_checkpointing's own tests
  configure it (no fsync). Its default, ``use_direct_io=True``, fails the save on this VM's ext4 (the last,
  unaligned write of a file opened with O_DIRECT raises EINVAL at close); ``--tc-direct-io`` tries it;
- ``distckpt``: ``DistckptStorageConfig()`` (CRC-32C per 1 MiB block, fsync of files and renames);
- ``distckpt-nosync``: the same without fsync (what ``tc-fs`` guarantees);
- ``raw``: the tensors' bytes written to one file with ``pwrite`` + fsync and read back with ``preadv``.

Then one bit of each checkpoint's data file is flipped, in the middle of the file, and each is loaded
again: the last table says what each noticed.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile

import torch

from .measure import best, drop_cache, measure


def _state(gib: float) -> dict:
    n = max(1, int(gib * (1 << 30) / 4))
    per = min(n, (64 << 20) // 4)
    sizes = [per] * (n // per) + ([n % per] if n % per else [])
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(s, generator=g) for i, s in enumerate(sizes)}


TC_DIRECT_IO = [False]


def _manager(variant: str):
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    from distckpt.integrations.torch_checkpointing import DistckptStorageConfig

    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = {"tc-fs": LocalFileSystemStorageConfig(use_direct_io=TC_DIRECT_IO[0]), "distckpt": DistckptStorageConfig(),
                             "distckpt-nosync": DistckptStorageConfig(sync=False)}[variant]
    return config.build()


class _Raw:
    """The floor: the same tensor bytes, one file, no format."""

    def save(self, path: str, state: dict) -> None:
        os.makedirs(path)
        fd = os.open(os.path.join(path, "model_0.pt"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            at = 0
            for t in state.values():
                view = memoryview(t.numpy()).cast("B")
                while view:
                    n = os.pwrite(fd, view, at)
                    view, at = view[n:], at + n
            os.fsync(fd)
        finally:
            os.close(fd)

    def load(self, path: str, into: dict) -> dict:
        fd = os.open(os.path.join(path, "model_0.pt"), os.O_RDONLY)
        try:
            at = 0
            for t in into.values():
                view = memoryview(t.numpy()).cast("B")
                got = os.preadv(fd, [view], at)
                at += got
        finally:
            os.close(fd)
        return into


def _save(variant: str, path: str, state: dict) -> None:
    if variant == "raw":
        _Raw().save(path, state)
        return
    m = _manager(variant)
    try:
        m.save(path, {"model": state})
    finally:
        m.close()


def _load(variant: str, path: str, like: dict) -> dict:
    into = {k: torch.empty_like(v) for k, v in like.items()}
    if variant == "raw":
        return _Raw().load(path, into)
    m = _manager(variant)
    try:
        return m.load(path, into={"model": into})["model"]
    finally:
        m.close()


def _flip(path: str) -> int:
    victim = os.path.join(path, "model_0.pt")
    size = os.path.getsize(victim)
    at = size // 2 + 12345
    fd = os.open(victim, os.O_RDWR)
    try:
        b = os.pread(fd, 1, at)
        os.pwrite(fd, bytes([b[0] ^ 0x04]), at)
        os.fsync(fd)
    finally:
        os.close(fd)
    return at


def _detects(variant: str, path: str, state: dict) -> str:
    try:
        out = _load(variant, path, state)
    except Exception as exc:  # noqa: BLE001 - what each one raises is the answer
        text = str(exc).splitlines()[0] if str(exc) else ""
        return f"raised {type(exc).__name__}: {text[:300]}"
    wrong = sum(int((out[k] != v).sum()) for k, v in state.items() if not torch.equal(out[k].nan_to_num(), v.nan_to_num()))
    return "loaded the flipped bit silently: 1 element wrong" if wrong == 1 else (
        f"loaded silently: {wrong} elements wrong" if wrong else "loaded correct bytes")


VARIANTS = ("tc-fs", "distckpt", "distckpt-nosync", "raw")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: the temporary directory)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--tc-direct-io", action="store_true", help="tc-fs with its default use_direct_io=True")
    a = p.parse_args(argv)
    TC_DIRECT_IO[0] = a.tc_direct_io
    state = _state(a.gib)
    nbytes = sum(t.numel() * 4 for t in state.values())
    root = tempfile.mkdtemp(dir=a.dir, prefix="distckpt-bench-tc-")
    samples: dict[str, list] = {f"{v}|{op}": [] for v in VARIANTS for op in ("save", "load")}
    try:
        for r in range(a.repeat):
            order = random.Random(r).sample(VARIANTS, len(VARIANTS))
            for v in order:
                path = os.path.join(root, v, "step_1")
                shutil.rmtree(os.path.join(root, v), ignore_errors=True)
                os.makedirs(os.path.join(root, v))
                samples[f"{v}|save"].append(measure(lambda: _save(v, path, state), nbytes))
            for v in order:
                path = os.path.join(root, v, "step_1")
                drop_cache(os.path.join(root, v))
                out = {}
                samples[f"{v}|load"].append(measure(lambda: out.update(_load(v, path, state)), nbytes))
                assert all(torch.equal(out[k], t) for k, t in state.items()), f"{v} loaded other bytes"
        print(f"torch_checkpointing {nbytes / (1 << 30):.2f} GiB in {len(state)} tensors, 1 rank, in {root}; "
              f"best (median) of {a.repeat} rounds, cold loads")
        print(f"{'variant':<16} {'save s':>16} {'GB/s':>6} {'load s':>16} {'GB/s':>6}")
        results: dict = {"gib": a.gib, "repeat": a.repeat, "times": {}, "bit_flip": {}}
        for v in VARIANTS:
            row = []
            for op in ("save", "load"):
                s = samples[f"{v}|{op}"]
                b, med = best(s), statistics.median(x.wall_s for x in s)
                results["times"][f"{v}|{op}"] = b.as_dict() | {"median_s": med}
                row.append(f"{b.wall_s:>7.3f} ({med:>6.3f}) {b.gbps:>6.2f}")
            print(f"{v:<16} {row[0]} {row[1]}")
        print("one bit flipped in the middle of each data file (model_0.pt), then loaded:")
        for v in VARIANTS:
            path = os.path.join(root, v, "step_1")
            at = _flip(path)
            results["bit_flip"][v] = _detects(v, path, state)
            print(f"  {v:<16} byte {at}: {results['bit_flip'][v]}")
        return results
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
