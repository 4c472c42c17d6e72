"""What observing costs: a save and a load of many small tensors with a callback registered (distckpt.observe, and
Prometheus metrics where prometheus_client is installed) against the same with none, in the same sitting.

    python -m bench.events_overhead                    # 20,000 tensors of 1 KiB, tmpfs if there is one
    python -m bench.events_overhead --tensors 500 --repeat 1 --json out.json   # a smoke run

Saves alternate (none, observed, observed, none, ...: neither always first) over ``--repeat`` rounds after a warm-up; the best of each is
reported, with the ratio (target: at most 1.01). No raw floor applies: the events add work, they move no bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import torch

import distckpt


def _callbacks() -> list:
    seen: list = []
    callbacks = [seen.append]
    try:
        import prometheus_client

        from distckpt.metrics import PrometheusMetrics

        callbacks.append(PrometheusMetrics(prometheus_client.CollectorRegistry()))
    except ImportError:
        pass
    return callbacks


def _round(state: dict, root: str, i: int, observed: bool) -> tuple[float, float]:
    observations = [distckpt.observe(cb) for cb in _callbacks()] if observed else []
    try:
        path = os.path.join(root, f"ck-{i}-{int(observed)}")
        begun = time.perf_counter()
        distckpt.save(state, checkpoint_id=path, no_dist=True)
        saved = time.perf_counter() - begun
        out = {k: torch.empty_like(v) for k, v in state.items()}
        begun = time.perf_counter()
        distckpt.load(out, checkpoint_id=path, no_dist=True)
        loaded = time.perf_counter() - begun
        shutil.rmtree(path)
        return saved, loaded
    finally:
        for observation in observations:
            observation.close()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--tensors", type=int, default=20_000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    os.environ.setdefault("DISTCKPT_FSYNC", "0")
    root = tempfile.mkdtemp(dir=a.dir, prefix="distckpt-bench-events-")
    try:
        state = {f"layers.{i}.weight": torch.randn(256) for i in range(a.tensors)}
        _round(state, root, -1, False)  # warm-up: memory touched, modules imported
        _round(state, root, -1, True)
        best = {False: [float("inf")] * 2, True: [float("inf")] * 2}
        for i in range(a.repeat):
            for observed in ((False, True) if i % 2 == 0 else (True, False)):  # neither arm always goes first
                times = _round(state, root, i, observed)
                best[observed] = [min(b, t) for b, t in zip(best[observed], times)]
        result = {"tensors": a.tensors, "repeat": a.repeat,
                  "save_s": {"none": best[False][0], "observed": best[True][0]},
                  "load_s": {"none": best[False][1], "observed": best[True][1]},
                  "save_ratio": best[True][0] / best[False][0], "load_ratio": best[True][1] / best[False][1]}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{a.tensors} tensors, best of {a.repeat}: save {result['save_s']['none']:.3f} s, observed "
          f"{result['save_s']['observed']:.3f} s ({result['save_ratio']:.3f}x); load {result['load_s']['none']:.3f} s, "
          f"observed {result['load_s']['observed']:.3f} s ({result['load_ratio']:.3f}x)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
