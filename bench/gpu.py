"""Checkpointing a state that lives in GPU memory: distckpt beside DCP, torch.save and safetensors.

    python -m bench.gpu --gib 4 --dir /dev/shm --dir /tmp     # on a machine with a CUDA device

For each location it measures, best of ``--repeat``:
- the floors: one copy of the state into preallocated pinned host buffers (device to host)
  and back (host to device);
- sync save from GPU memory and warm load into preallocated GPU tensors, for every peer;
- async save (distckpt and DCP): how long training is blocked, the time to the commit,
  and how much slower a GPU-bound training loop runs while the save is written.
Ratios are peer time / distckpt time: above 1 means distckpt is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import Future
from datetime import timedelta

import torch
import torch.distributed as dist

from . import workers
from .measure import Sample, best, measure
from .states import nbytes


def gpt_like_cuda(total_bytes: int) -> dict[str, torch.Tensor]:
    """Transformer-shaped bf16 weights of about ``total_bytes``, made on the device."""
    d = 2048 if total_bytes >= (1 << 30) else 256
    shapes = {"attn.qkv.weight": (3 * d, d), "attn.proj.weight": (d, d), "mlp.up.weight": (4 * d, d),
              "mlp.down.weight": (d, 4 * d), "ln1.weight": (d,), "ln2.weight": (d,)}
    per_layer = sum(torch.Size(s).numel() for s in shapes.values()) * 2
    g = torch.Generator(device="cuda").manual_seed(0)
    sd = {"embed.weight": torch.randn(1024, d, generator=g, device="cuda", dtype=torch.bfloat16)}
    for i in range(max(1, total_bytes // per_layer)):
        for name, shape in shapes.items():
            sd[f"layers.{i}.{name}"] = torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    return sd


def _synced(fn):
    def run():
        fn()
        torch.cuda.synchronize()
    return run


def floors(sd: dict, repeat: int) -> dict:
    size = nbytes(sd)
    host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in sd.items()}
    d2h = best([measure(_synced(lambda: [host[k].copy_(v, non_blocking=True) for k, v in sd.items()]), size)
                for _ in range(repeat)])
    h2d = best([measure(_synced(lambda: [sd[k].copy_(host[k], non_blocking=True) for k in sd]), size)
                for _ in range(repeat)])
    pageable = best([measure(_synced(lambda: [v.cpu() for v in sd.values()]), size) for _ in range(repeat)])
    return {"pinned|d2h": d2h.as_dict(), "pinned|h2d": h2d.as_dict(), "pageable|d2h": pageable.as_dict()}


def _train_steps(n: int) -> float:
    """Seconds for ``n`` steps of a GPU-bound loop with a little host work per step, like training."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        for _ in range(8):
            a = (a @ b) * 1e-3
        a.sum().item()  # one host sync per step, like a loss read-out
    return time.perf_counter() - t0


# The CPU tables' "raw" row moves host memory; from GPU memory the floors are the pinned copies above.
SYNC_PEERS = tuple(p for p in workers.PEERS if p != "raw")


def peers(sd: dict, location: str, repeat: int) -> dict:
    size = nbytes(sd)
    out = {}
    for peer in SYNC_PEERS:
        path = os.path.join(location, f"cuda-{peer}")
        saves, loads = [], []
        dest = {k: torch.zeros_like(v) for k, v in sd.items()}
        for _ in range(repeat):
            shutil.rmtree(path, ignore_errors=True)
            os.sync()
            saves.append(measure(_synced(lambda: workers._save(peer, sd, sd, path, 0)), size))
            if peer in ("torch.save", "safetensors"):  # load straight onto the device, as users do
                loads.append(measure(_synced(lambda: _load_to_device(peer, dest, path)), size))
            else:
                loads.append(measure(_synced(lambda: workers._load(peer, dest, dest, path, 0)), size))
            assert all(torch.equal(dest[k], sd[k]) for k in list(sd)[:3]), f"{peer} loaded other bytes"
        out[f"{peer}|save"] = best(saves).as_dict()
        out[f"{peer}|load"] = best(loads).as_dict()
        shutil.rmtree(path, ignore_errors=True)
    return out


def _load_to_device(peer: str, dest: dict, path: str) -> None:
    if peer == "torch.save":
        got = torch.load(os.path.join(path, "rank0.pt"), weights_only=True, map_location="cuda")
    else:
        from safetensors.torch import load_file

        got = load_file(os.path.join(path, "rank0.safetensors"), device="cuda")
    for k, v in got.items():
        dest[k].copy_(v)


def _async_save(peer: str, sd: dict, path: str, stagers: dict) -> Future:
    if peer == "distckpt":
        import distckpt

        return distckpt.async_save(sd, checkpoint_id=path).committed
    import torch.distributed.checkpoint as dcp

    if peer == "dcp":  # its defaults
        return dcp.async_save(sd, checkpoint_id=path)
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    # DCP tuned: pinned staging buffers kept across saves, as distckpt keeps its own
    stager = stagers.setdefault(peer, BlockingAsyncStager(cache_staged_state_dict=True))
    return dcp.async_save(sd, checkpoint_id=path, async_stager=stager)


ASYNC_PEERS = ("distckpt", "dcp", "dcp-cached")


def async_saves(sd: dict, location: str, repeat: int, steps: int) -> dict:
    """Blocking time, time to commit, and the training slowdown while the save is written."""
    size = nbytes(sd)
    out = {}
    alone = min(_train_steps(steps) for _ in range(2))
    out["train|alone"] = {"wall_s": alone}
    stagers: dict = {}
    for peer in ASYNC_PEERS:
        path = os.path.join(location, f"cuda-async-{peer}")
        blocks, totals, slowdowns = [], [], []
        for i in range(repeat + 1):  # the first save sets up buffers and groups; the rest are steady state
            shutil.rmtree(path, ignore_errors=True)
            os.sync()
            futures, done = [], []
            t0 = time.perf_counter()
            blocking = measure(lambda: futures.append(_async_save(peer, sd, path, stagers)), size)
            futures[0].add_done_callback(lambda _: done.append(time.perf_counter()))
            train = _train_steps(steps)  # training goes on while the save is written
            futures[0].result()
            if i:
                blocks.append(blocking)
                totals.append(Sample(done[0] - t0, 0.0, 0.0, size))
                slowdowns.append(train / alone)
        out[f"{peer}|async blocking"] = best(blocks).as_dict()
        out[f"{peer}|async total"] = best(totals).as_dict()
        out[f"{peer}|train slowdown"] = {"ratio": min(slowdowns)}
        shutil.rmtree(path, ignore_errors=True)
    return out


def _row(name: str, s: dict, base: dict | None) -> str:
    ratio = f"{s['wall_s'] / base['wall_s']:6.2f}x" if base else "      "
    return f"  {name:28s} {s['wall_s']:8.3f} s {s.get('gbps', 0):7.2f} GB/s  {ratio}"


def report(results: dict) -> list[str]:
    lines = []
    for where, r in results.items():
        if where in ("state_bytes", "device"):
            continue
        lines.append(f"{where}  (time, GB/s, time vs distckpt)")
        for key, s in r.items():
            if "wall_s" not in s:
                lines.append(f"  {key:28s} {s['ratio']:8.3f} x training time alone")
                continue
            peer, op = key.split("|")
            base = r.get(f"distckpt|{op}") if peer != "distckpt" and f"distckpt|{op}" in r else None
            lines.append(_row(key, s, base))
    return lines


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--dir", action="append", help="where to write (repeatable); default /dev/shm and a temp dir")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--train-steps", type=int, default=300, help="steps of the GPU loop run during each async save")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench.gpu needs a CUDA device")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1,
                            timeout=timedelta(minutes=10))
    sd = gpt_like_cuda(int(args.gib * (1 << 30)))
    results = {"device": torch.cuda.get_device_name(), "state_bytes": nbytes(sd),
               "floors": floors(sd, args.repeat)}
    for location in args.dir or ["/dev/shm", tempfile.gettempdir()]:
        work = tempfile.mkdtemp(prefix="distckpt-bench-", dir=location)
        try:
            results[f"{location}: sync"] = peers(sd, work, args.repeat)
            results[f"{location}: async"] = async_saves(sd, work, args.repeat, args.train_steps)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print("\n".join(report({k: v for k, v in results.items() if k.startswith(location) or k == "floors"})), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()
    return results


def _port() -> int:
    from distckpt.testing.multiprocess import free_port

    return free_port()


if __name__ == "__main__":
    main()
