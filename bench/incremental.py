"""Incremental saves of a frozen-base fine-tuning run (issue 49): the bytes each peer writes in 10 saves, and the time.

    python -m bench.incremental                     # 1 GiB state, 10 saves, 2 rounds, under $TMPDIR (a disk)
    python -m bench.incremental --gib 0.01 --repeat 1 --dir /dev/shm        # a smoke run

The state (``frozen_base_state``): a stack of ``--layers-per-10`` x k square fp32 linear layers, the first 90% of
them frozen (``requires_grad=False``, so AdamW keeps no state for them) and the top 10% trained with
``torch.optim.AdamW`` (exp_avg and exp_avg_sq beside each); the state a user saves is torch's
``get_state_dict(model, optimizer)``: ``{"model": ..., "optim": ...}``. Parameters are 90% frozen; the trainable
share of the *state* is 3 x 10% / (90% + 3 x 10%) = 25%. Between two saves, one real AdamW step on random gradients
changes the trainable parameters and their moments (and the step counters), and nothing else.

Peers, each saving the same 10 steps under a root of its own; within a round every step is saved by each peer
in an order shuffled per step, so that no peer always runs on a disk another peer just filled:

- ``incremental``: ``CheckpointManager(root, keep_last=2, incremental=True)``: a chunk whose bytes are unchanged
  since the previous committed step is not written again; the step references the earlier step's bytes;
- ``full``: ``CheckpointManager(root, keep_last=2)``: every byte, every step;
- ``dcp``: ``torch.distributed.checkpoint.save`` into a new directory per step, the third newest removed after
  each save (keep 2, as the managers);
- ``raw``: the floor of any incremental scheme: the first step's every tensor, then each step's trainable
  tensors only (parameters, moments, step counters), with ``pwrite`` and ``fsync`` into files of their own (the
  I/O of bench.workers' raw save), no format, no metadata.

Bytes written by a save: the sizes of the regular files under the peer's root after the save that were not
there before it (``os.scandir``, links not followed; a file is the same one while its inode, size and mtime are:
a rename, as retention makes, writes nothing). Time: each save's wall time; a round's time per step is the best
of the rounds (``--repeat``), as in bench/measure.py. Memory is touched first (``--warm-gib``). Held: the bytes
of the files under the root after the last save (what retention keeps).

After each round, every step a manager kept (``keep_last=2``: steps 9 and 10) is loaded into a blank state and
compared bit for bit with a CPU clone of the state taken when that step was saved; so are DCP's last two
directories. The run fails otherwise.

Target (issue 49): the incremental peer's total over the 10 saves <= 1.1 x (one full save + 9 x the trainable
state's bytes).
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Callable

import torch

from distckpt import CheckpointManager
from distckpt.planning.flatten import flatten_state_dict

from . import workers
from .measure import warm_memory

PEERS = ("incremental", "full", "dcp", "raw")
TARGET = 1.1


def incremental_supported() -> bool:
    """Whether this distckpt's CheckpointManager takes ``incremental`` (issue 49)."""
    return "incremental" in inspect.signature(CheckpointManager.__init__).parameters


# ---- the state

class FrozenBase(torch.nn.Module):
    """``layers`` square linear layers of width ``d``; all but the top ``trainable`` are frozen."""

    def __init__(self, d: int, layers: int, trainable: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d, bias=False) for _ in range(layers))
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                layer.weight.copy_(torch.randn(d, d, generator=g) / d**0.5)
                layer.weight.requires_grad_(i >= layers - trainable)


def shape_for(total_bytes: int) -> tuple[int, int]:
    """(width, layers): layers a multiple of 10 whose fp32 state (90% frozen weights, 10% weights with two AdamW
    moments: 12 layers' bytes per 10 layers) adds up to about ``total_bytes``."""
    for d in (2048, 1024, 512, 256, 128, 64):
        tens = round(total_bytes / (12 * d * d * 4))
        if tens >= 1:
            return d, 10 * tens
    return 64, 10


class Run:
    """A fine-tuning run: the model, its AdamW optimizer (state created), and the seeded gradients of each step."""

    def __init__(self, total_bytes: int, seed: int = 0):
        from distckpt.optim import init_optimizer_state

        d, layers = shape_for(total_bytes)
        self.model = FrozenBase(d, layers, layers // 10, seed)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-3, weight_decay=0.01)
        init_optimizer_state(self.optimizer)  # the moments exist from the first save on, as after a first step
        self.frozen = {f"model.{n}" for n, p in self.model.named_parameters() if not p.requires_grad}
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.width, self.layers = d, layers

    def step(self) -> None:
        """One real AdamW step on random gradients: the trainable weights, their moments and step counters change."""
        for p in self.params:
            p.grad = torch.randn(p.shape, generator=self.gen)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state(self) -> dict:
        """What a user saves: torch's ``get_state_dict`` (fully qualified names in the optimizer's state)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def tensors(self, state: dict) -> dict[str, torch.Tensor]:
        flat, _ = flatten_state_dict(state)
        return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}

    def trainable(self, state: dict) -> dict[str, torch.Tensor]:
        """Every tensor of the state but the frozen weights: what changes between two saves."""
        return {k: v for k, v in self.tensors(state).items() if k not in self.frozen}


def state_bytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def clone(state):
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: clone(v) for k, v in state.items()}
    if isinstance(state, list):
        return [clone(v) for v in state]
    return state


def blank(state):
    if isinstance(state, torch.Tensor):
        return torch.full_like(state, float("nan")) if state.is_floating_point() else torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: blank(v) for k, v in state.items()}
    if isinstance(state, list):
        return [blank(v) for v in state]
    return state


def bit_exact(got, want, where: str) -> None:
    if isinstance(want, torch.Tensor):
        same = got.dtype == want.dtype and got.shape == want.shape and torch.equal(
            got.contiguous().view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8))
        if not same:
            raise SystemExit(f"{where}: loaded bytes differ from the state saved")
    elif isinstance(want, dict):
        for k in want:
            bit_exact(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        for i, (g, w) in enumerate(zip(got, want)):
            bit_exact(g, w, f"{where}[{i}]")
    elif got != want:
        raise SystemExit(f"{where}: loaded {got!r}, saved {want!r}")


# ---- counting what a save writes

def files(root: str) -> dict[tuple, int]:
    """Every regular file under ``root`` (links not followed), as (device, inode, mtime, size) -> size."""
    out: dict[tuple, int] = {}
    stack = [root]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except FileNotFoundError:
            continue  # removed meanwhile (retention)
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                elif e.is_file(follow_symlinks=False):
                    st = e.stat(follow_symlinks=False)
                    out[(st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)] = st.st_size
            except FileNotFoundError:
                continue
    return out


def written(root: str, save: Callable[[], None]) -> tuple[int, float]:
    """(bytes of the files new under ``root`` after ``save()``, its wall time)."""
    before = files(root)
    t0 = time.perf_counter()
    save()
    wall = time.perf_counter() - t0
    return sum(size for key, size in files(root).items() if key not in before), wall


# ---- the peers

class Peer:
    def __init__(self, name: str, root: str, run: Run):
        self.name, self.root, self.run = name, root, run
        os.makedirs(root, exist_ok=True)
        if name in ("incremental", "full"):
            self.manager = CheckpointManager(root, keep_last=2, incremental=name == "incremental")

    def save(self, step: int, state: dict) -> None:
        if self.name in ("incremental", "full"):
            self.manager.save(step, state)
        elif self.name == "dcp":
            import torch.distributed.checkpoint as dcp

            dcp.save(state, checkpoint_id=os.path.join(self.root, f"step-{step}"))  # its FileSystemWriter fsyncs
            shutil.rmtree(os.path.join(self.root, f"step-{step - 2}"), ignore_errors=True)
        else:
            tensors = self.run.tensors(state) if step == 1 else self.run.trainable(state)
            workers._raw_io(tensors, os.path.join(self.root, f"step-{step}"), 0, write=True)
            if step > 3:  # the first step's files hold the frozen bytes: the floor keeps them and the newest 2
                shutil.rmtree(os.path.join(self.root, f"step-{step - 2}"), ignore_errors=True)

    def load(self, step: int, into: dict) -> None:
        if self.name in ("incremental", "full"):
            if self.manager.load(into, step=step) != step:
                raise SystemExit(f"{self.name}: load(step={step}) loaded another step")
        elif self.name == "dcp":
            import torch.distributed.checkpoint as dcp

            dcp.load(into, checkpoint_id=os.path.join(self.root, f"step-{step}"))

    def kept(self) -> list[int]:
        if self.name in ("incremental", "full"):
            return self.manager.all_steps()
        return sorted(int(n.split("-")[1]) for n in os.listdir(self.root) if n.startswith("step-"))


def one_round(work: str, total_bytes: int, saves: int, peers: tuple, order_seed: int) -> dict:
    """``saves`` steps of one run, each saved by every peer; returns bytes and times per peer and step."""
    run = Run(total_bytes)
    made = {name: Peer(name, os.path.join(work, name), run) for name in peers}
    rows: dict[str, dict] = {name: {"bytes": [], "s": []} for name in peers}
    clones: dict[int, dict] = {}
    rng = random.Random(order_seed)
    for step in range(1, saves + 1):
        if step > 1:
            run.step()
        state = run.state()
        clones[step] = clone(state)
        clones.pop(step - 2, None)  # the managers keep the newest 2
        order = list(peers)
        rng.shuffle(order)
        for name in order:
            nbytes, wall = written(made[name].root, lambda: made[name].save(step, state))
            rows[name]["bytes"].append(nbytes)
            rows[name]["s"].append(wall)
    for name in peers:
        rows[name]["held_bytes"] = sum(files(made[name].root).values())
    state = run.state()
    for name in peers:
        if name == "raw":
            continue
        kept = made[name].kept()
        if kept != [saves - 1, saves]:
            raise SystemExit(f"{name} kept steps {kept}, not the newest 2")
        for step in kept:
            into = blank(state)
            made[name].load(step, into)
            bit_exact(into, clones[step], f"{name} step {step}")
        rows[name]["checked_steps"] = kept
    tensors = run.tensors(state)
    return {"rows": rows, "state_bytes": state_bytes(tensors), "trainable_bytes": state_bytes(run.trainable(state)),
            "width": run.width, "layers": run.layers, "tensors": len(tensors)}


def _fs_type(path: str) -> str:
    try:
        return subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def summarize(rounds: list[dict], saves: int) -> dict:
    first = rounds[0]
    full_state, trainable = first["state_bytes"], first["trainable_bytes"]
    bound = full_state + (saves - 1) * trainable
    peers = {}
    for name in first["rows"]:
        per_round = [r["rows"][name] for r in rounds]
        totals = [sum(r["bytes"]) for r in per_round]
        best_s = [min(r["s"][i] for r in per_round) for i in range(saves)]
        peers[name] = {"bytes": per_round[0]["bytes"], "total_bytes": totals[0], "totals_per_round": totals,
                       "best_s_per_step": [round(s, 4) for s in best_s], "best_total_s": round(sum(best_s), 4),
                       "s_per_round": [round(sum(r["s"]), 4) for r in per_round],
                       "over_floor_bound": totals[0] / bound, "checked_steps": per_round[0].get("checked_steps", []),
                       "held_bytes": per_round[0]["held_bytes"]}
    results = {"state_bytes": full_state, "trainable_bytes": trainable, "trainable_share": trainable / full_state,
               "width": first["width"], "layers": first["layers"], "tensors": first["tensors"], "saves": saves,
               "bound_bytes": bound, "target": TARGET, "peers": peers}
    if "incremental" in peers:
        ratio = peers["incremental"]["over_floor_bound"]
        results["incremental_ratio"] = ratio
        results["met"] = ratio <= TARGET
    return results


def report(results: dict) -> list[str]:
    mib = 1 << 20
    lines = [f"state {results['state_bytes'] / mib:.1f} MiB ({results['layers']} layers of {results['width']}^2 fp32, "
             f"{results['tensors']} tensors), trainable {results['trainable_bytes'] / mib:.1f} MiB "
             f"({100 * results['trainable_share']:.1f}% of the state), {results['saves']} saves; "
             f"bound = one full save + {results['saves'] - 1} x trainable = {results['bound_bytes'] / mib:.1f} MiB",
             f"{'peer':12s} {'written MiB':>12s} {'/ bound':>8s} {'step 1 MiB':>11s} {'later MiB':>10s} "
             f"{'step 1 s':>9s} {'later s':>8s} {'10 saves s':>10s} {'s / raw':>8s} {'held MiB':>9s}"]
    raw_s = results["peers"].get("raw", {}).get("best_total_s")
    for name, p in results["peers"].items():
        later_b = p["bytes"][1:]
        later_s = p["best_s_per_step"][1:]
        mean_b = sum(later_b) / len(later_b) if later_b else 0.0
        mean_s = sum(later_s) / len(later_s) if later_s else 0.0
        vs_raw = f"{p['best_total_s'] / raw_s:8.2f}" if raw_s else f"{'':8s}"
        lines.append(f"{name:12s} {p['total_bytes'] / mib:12.1f} {p['over_floor_bound']:8.3f} {p['bytes'][0] / mib:11.1f} "
                     f"{mean_b / mib:10.2f} {p['best_s_per_step'][0]:9.3f} {mean_s:8.3f} {p['best_total_s']:10.3f} {vs_raw} "
                     f"{p['held_bytes'] / mib:9.1f}")
    lines.append("later: the mean of steps 2-10; times: each step's best of the rounds; held: the bytes under the root "
                 "after the last save")
    if "incremental_ratio" in results:
        verdict = "met" if results["met"] else "MISSED"
        lines.append(f"target (issue 49): incremental written / bound = {results['incremental_ratio']:.3f} <= {TARGET}: "
                     f"{verdict}")
    return lines


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0, help="size of the whole state (weights and AdamW moments), GiB")
    p.add_argument("--saves", type=int, default=10)
    p.add_argument("--repeat", type=int, default=2, help="rounds; each step's time is the best of them")
    p.add_argument("--dir", default=None, help="where the runs' roots are made (default: $TMPDIR, here a disk)")
    p.add_argument("--peers", nargs="+", choices=PEERS, default=None,
                   help="default: every peer (without incremental where this distckpt lacks it)")
    p.add_argument("--warm-gib", type=float, default=None, help="memory touched first (default: 2 x --gib)")
    p.add_argument("--json", default=None)
    p.add_argument("--txt", default=None, help="also write the command line, the machine's load and the table here")
    a = p.parse_args(argv)
    if a.saves < 3:
        p.error("--saves must be at least 3 (the managers keep 2)")
    peers = tuple(a.peers or (n for n in PEERS if n != "incremental" or incremental_supported()))
    if "incremental" in peers and not incremental_supported():
        raise SystemExit("this distckpt's CheckpointManager has no incremental parameter (issue 49)")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP in one process, as meant
    warm_memory(2 * a.gib if a.warm_gib is None else a.warm_gib)
    total_bytes = int(a.gib * (1 << 30))
    load_before = os.getloadavg()
    work = tempfile.mkdtemp(prefix="distckpt-bench-incremental-", dir=a.dir)
    fs = _fs_type(work)
    rounds = []
    try:
        for r in range(a.repeat):
            rounds.append(one_round(os.path.join(work, f"r{r}"), total_bytes, a.saves, peers, order_seed=r))
            shutil.rmtree(os.path.join(work, f"r{r}"), ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = summarize(rounds, a.saves) | {
        "gib": a.gib, "repeat": a.repeat, "dir": os.path.dirname(work), "fs": fs, "torch": torch.__version__,
        "fsync": os.environ.get("DISTCKPT_FSYNC", "1"), "loadavg_before": list(load_before),
        "loadavg_after": list(os.getloadavg()), "date": datetime.date.today().isoformat()}
    lines = report(results)
    print("\n".join(lines))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if a.txt:
        with open(a.txt, "w") as f:
            f.write(f"$ python -m bench.incremental {' '.join(sys.argv[1:] if argv is None else argv)}\n")
            f.write(f"{results['date']}, torch {results['torch']}, {os.cpu_count()} cores, {results['dir']} ({fs}), "
                    f"DISTCKPT_FSYNC={results['fsync']}, load average {load_before[0]:.2f} before, "
                    f"{results['loadavg_after'][0]:.2f} after\n\n")
            f.write("\n".join(lines) + "\n")
    return results


if __name__ == "__main__":
    main()
