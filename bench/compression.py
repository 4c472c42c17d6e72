"""compression="zstd" (byte-grouped zstd chunks) on a real model's bf16 weights, beside the raw disk floor, distckpt
uncompressed and DCP's own ``_extensions=[ZStandard()]``.

    python -m bench.compression --gib 0.5 [--dir /tmp] [--repeat 3] [--throttle-mbps 400]

The state is a GPT-2-style model (``transformers.GPT2Model``) built from its config, its weights drawn by its own
initializer (``model.init_weights()``), cast to bf16; ``--gib`` picks the depth. One rank. Each round saves with
every variant in a random order (fsync on), then loads each cold (``bench.measure.drop_cache``); the table gives
the best round of each (docs/performance.md: the noise only adds time) and the median. Variants:

- ``raw``: the tensors' bytes written to one file with ``pwrite`` + fsync, read back with ``preadv``: the disk;
- ``distckpt``: ``FileSystemWriter(path)``, stored as it is;
- ``distckpt-zstd``: ``FileSystemWriter(path, compression="zstd")`` (level 1);
- ``dcp-zstd``: torch.distributed.checkpoint's ``FileSystemWriter(path, _extensions=[ZStandard()])``, loaded with
  ``dcp.load`` (skipped, with the reason, where this torch lacks it).

GB/s are the state's bytes over the wall time, so a variant that stores fewer bytes can beat the disk. With
``--throttle-mbps`` the checkpoints live on a device limited to that speed (``bench.throttle``): saves on one
throttled for writes, loads on one throttled for reads, as a slower disk than this VM's would be.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import statistics
import tempfile

import numpy as np
import torch
import zstandard

from .measure import best, drop_cache, measure, warm_memory

VARIANTS = ("raw", "distckpt", "distckpt-zstd", "dcp-zstd")


def model_state(gib: float) -> dict:
    """A GPT-2-style model's weights as its initializer draws them, in bf16, about ``gib`` GiB (at least 2 layers)."""
    from transformers import GPT2Config, GPT2Model

    width = 1024 if gib >= 0.25 else 256
    vocab = 50257 if gib >= 0.25 else 4096
    per_layer = 12 * width * width + 13 * width
    layers = max(2, int((gib * (1 << 30) / 2 - (vocab + 1024) * width) / per_layer))
    torch.manual_seed(0)
    config = GPT2Config(n_embd=width, n_layer=layers, n_head=max(1, width // 64), vocab_size=vocab, n_positions=1024)
    model = GPT2Model(config)
    model.init_weights()
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
            if v.is_floating_point()}


def plane_ratios(state: dict) -> list[float]:
    """Stored over raw bytes of each byte plane of the bf16 weights, zstd level 1 in 1 MiB pieces (the codec's)."""
    stored, raw = [0, 0], [0, 0]
    c = zstandard.ZstdCompressor(level=1)
    for t in state.values():
        grid = t.view(torch.uint8).numpy().reshape(-1, 2)
        for p in range(2):
            plane = np.ascontiguousarray(grid[:, p])
            for i in range(0, len(plane), 1 << 20):
                piece = plane[i:i + (1 << 20)]
                stored[p] += min(len(piece), len(c.compress(piece)))
                raw[p] += len(piece)
    return [s / r for s, r in zip(stored, raw)]


class _Raw:
    def save(self, path: str, state: dict) -> None:
        os.makedirs(path)
        fd = os.open(os.path.join(path, "raw"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            at = 0
            for t in state.values():
                view = memoryview(t.view(torch.uint8).numpy()).cast("B")
                while view:
                    n = os.pwrite(fd, view, at)
                    view, at = view[n:], at + n
            os.fsync(fd)
        finally:
            os.close(fd)

    def load(self, path: str, into: dict) -> None:
        fd = os.open(os.path.join(path, "raw"), os.O_RDONLY)
        try:
            at = 0
            for t in into.values():
                at += os.preadv(fd, [memoryview(t.view(torch.uint8).numpy()).cast("B")], at)
        finally:
            os.close(fd)


def _dcp_zstd():
    """DCP's writer with its zstd extension, or the reason it does not run here."""
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._extension import ZStandard
    except ImportError as exc:
        return None, f"torch {torch.__version__} has no DCP ZStandard extension ({exc})"
    if not ZStandard.is_available():
        return None, "DCP's ZStandard needs the zstandard package"
    return (dcp, ZStandard), None


def _save(variant: str, path: str, state: dict) -> None:
    import distckpt

    if variant == "raw":
        _Raw().save(path, state)
    elif variant in ("distckpt", "distckpt-zstd"):
        writer = distckpt.FileSystemWriter(path, sync_files=True, compression="zstd" if variant == "distckpt-zstd" else None)
        distckpt.save(state, storage_writer=writer)
    else:
        (dcp, ZStandard), _ = _dcp_zstd()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=True, _extensions=[ZStandard()]))


def _load(variant: str, path: str, into: dict) -> None:
    import distckpt

    if variant == "raw":
        _Raw().load(path, into)
    elif variant in ("distckpt", "distckpt-zstd"):
        distckpt.load(into, checkpoint_id=path)
    else:
        (dcp, _), _ = _dcp_zstd()
        dcp.load(into, storage_reader=dcp.FileSystemReader(path))


def _stored_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


@contextlib.contextmanager
def _device(mbps: float, directory: str, size: int, kind: str):
    """A directory on a device throttled to ``mbps`` for ``kind`` ("write" or "read"), or a plain one."""
    if not mbps:
        path = tempfile.mkdtemp(dir=directory, prefix=f"distckpt-bench-zstd-{kind}-")
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)
        return
    from .throttle import throttled_reads, throttled_writes

    directory = tempfile.mkdtemp(dir=directory, prefix=f"distckpt-bench-zstd-{kind}-")  # one loop device in each
    try:
        with (throttled_writes if kind == "write" else throttled_reads)(mbps, directory, size) as path:
            yield path
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _copy_tree(src: str, dst: str) -> None:
    shutil.copytree(src, dst)
    for r, _, fs in os.walk(dst):
        for f in fs:
            fd = os.open(os.path.join(r, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=0.5)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: the temporary directory)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--throttle-mbps", type=float, default=0.0, help="a device limited to this many MB/s (root, loop device)")
    p.add_argument("--only", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    a = p.parse_args(argv)
    state = model_state(a.gib)
    nbytes = sum(t.nbytes for t in state.values())
    skipped = {}
    variants = [v for v in VARIANTS if v in a.only]
    if "dcp-zstd" in variants and _dcp_zstd()[1]:
        skipped["dcp-zstd"] = _dcp_zstd()[1]
        variants.remove("dcp-zstd")
    directory = a.dir or tempfile.gettempdir()
    warm_memory(2 * nbytes / (1 << 30))
    samples: dict[str, list] = {f"{v}|{op}": [] for v in variants for op in ("save", "load")}
    stored: dict[str, int] = {}
    ratios = plane_ratios(state)
    size = 6 * nbytes + (256 << 20)
    with _device(a.throttle_mbps, directory, size, "write") as wroot, _device(a.throttle_mbps, directory, size, "read") as rroot:
        for r in range(a.repeat):
            order = random.Random(r).sample(variants, len(variants))
            for v in order:  # saves alternate, on the write device
                path = os.path.join(wroot, v)
                shutil.rmtree(path, ignore_errors=True)
                samples[f"{v}|save"].append(measure(lambda: _save(v, path, state), nbytes))
                stored[v] = _stored_bytes(path)
            for v in order:  # loads alternate, cold, on the read device
                path = os.path.join(rroot, v)
                if r == 0 or a.throttle_mbps:
                    shutil.rmtree(path, ignore_errors=True)
                    _copy_tree(os.path.join(wroot, v), path)
                drop_cache(path)
                into = {k: torch.empty_like(t) for k, t in state.items()}
                samples[f"{v}|load"].append(measure(lambda: _load(v, path, into), nbytes))
                assert all(torch.equal(into[k].view(torch.uint8), t.view(torch.uint8)) for k, t in state.items()), v
    where = f"a device throttled to {a.throttle_mbps:g} MB/s" if a.throttle_mbps else f"{directory} (this VM's disk)"
    print(f"compression: GPT-2-style model, {len(state)} bf16 tensors, {nbytes / (1 << 30):.3f} GiB, 1 rank, on {where}; "
          f"best (median) of {a.repeat} rounds, fsync on, cold loads")
    print(f"byte planes of the bf16 weights, zstd level 1 in 1 MiB pieces: low byte {ratios[0]:.3f}, high byte {ratios[1]:.3f} "
          "of their raw size")
    print(f"{'variant':<15} {'stored MB':>10} {'of raw':>7} {'save s':>16} {'GB/s':>6} {'load s':>16} {'GB/s':>6}")
    results: dict = {"gib": nbytes / (1 << 30), "repeat": a.repeat, "throttle_mbps": a.throttle_mbps, "planes": ratios,
                     "stored": stored, "times": {}, "skipped": skipped}
    for v in variants:
        row = []
        for op in ("save", "load"):
            s = samples[f"{v}|{op}"]
            b, med = best(s), statistics.median(x.wall_s for x in s)
            results["times"][f"{v}|{op}"] = b.as_dict() | {"median_s": med}
            row.append(f"{b.wall_s:>7.3f} ({med:>6.3f}) {b.gbps:>6.2f}")
        print(f"{v:<15} {stored[v] / 1e6:>10.1f} {stored[v] / nbytes:>7.3f} {row[0]} {row[1]}")
    for v, why in skipped.items():
        print(f"{v:<15} skipped: {why}")
    return results


if __name__ == "__main__":
    main()
