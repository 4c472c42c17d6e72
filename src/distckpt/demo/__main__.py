"""python -m distckpt.demo: train, checkpoint, crash, resume, reshard, and check every bit."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch

from ..testing import RankError, run_ranks
from .run import checkpoint_dir, latest_step, phase_gather, phase_train


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m distckpt.demo", description=__doc__)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--crash-after", type=int, default=17)
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    args = p.parse_args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="distckpt-demo-")
    if os.path.exists(root):
        shutil.rmtree(root)
    os.makedirs(root)
    ws = 2
    say = lambda *a: print(*a, flush=True)
    say(f"distckpt demo: FSDP2 transformer, AdamW, {ws} ranks over gloo; checkpoints in {root}")

    say(f"\n[1/5] reference: {args.steps} steps, uninterrupted, no checkpoints")
    t0 = time.perf_counter()
    ref = run_ranks(phase_train, ws, root + "/unused", 1, args.steps, 0, None, False, timeout_s=600)[0]["losses"]
    ref = {int(k): v for k, v in ref.items()}
    say(f"      done in {time.perf_counter() - t0:.1f}s; loss {ref[1]:.4f} -> {ref[args.steps]:.4f}")

    say(f"\n[2/5] the same run, checkpointing every {args.every} steps, killed after step {args.crash_after}")
    crashlog = os.path.join(root, "crash.json")
    try:
        run_ranks(phase_train, ws, root, 1, args.steps, args.every, args.crash_after, False, timeout_s=600,
                  env={"DISTCKPT_DEMO_CRASHLOG": crashlog})
        say("      expected the ranks to die, but they finished")
        return 1
    except RankError as exc:
        codes = sorted({t.split("exit code ")[1].split(" ")[0] for t in exc.errors.values() if "exit code" in t})
        say(f"      both ranks died (exit codes {codes}), as planned")
    crashed = json.load(open(crashlog))
    for step, secs in crashed["saves"]:
        path = checkpoint_dir(root, step)
        say(f"      saved step {step}: {_size(path) / 1e6:.2f} MB in {secs * 1000:.0f} ms")
    resume_from = latest_step(root)
    say(f"      latest committed checkpoint: step {resume_from}")

    say(f"\n[3/5] resume on {ws} new ranks from step {resume_from} and train to step {args.steps}")
    log = run_ranks(phase_train, ws, root, 1, args.steps, 0, None, True, timeout_s=600)[0]
    for step, secs in log["loads"]:
        say(f"      loaded step {step} in {secs * 1000:.0f} ms")
    resumed = {int(k): v for k, v in log["losses"].items()}
    ok = True
    say("      step  uninterrupted   crashed+resumed")
    for step in range(1, args.steps + 1):
        got = resumed.get(step, crashed["losses"].get(str(step)))
        mark = "" if got == ref[step] else "   MISMATCH"
        ok &= got == ref[step]
        src = "resumed" if step in resumed else "before crash"
        say(f"      {step:4d}  {ref[step]:.10f}  {got:.10f}  ({src}){mark}")
    say("      the loss curve continues exactly" if ok else "      LOSS CURVE DIFFERS")

    ckpt = checkpoint_dir(root, resume_from)
    say(f"\n[4/5] reshard: load step {resume_from} (saved at {ws} ranks) at 1, 2 and 3 ranks")
    full = {}
    for n, sharded in ((1, False), (2, True), (3, True)):
        res, secs = run_ranks(phase_gather, n, ckpt, sharded, timeout_s=600)[0]
        full[n] = res
        kind = "plain tensors" if not sharded else f"FSDP2 DTensors sharded {n} ways"
        say(f"      {n} rank(s), {kind}: {len(res)} tensors loaded in {secs * 1000:.0f} ms")

    say("\n[5/5] compare every tensor bit for bit")
    base = full[2]
    for n in (1, 3):
        diff = [k for k in base if k not in full[n] or not _same_bits(base[k], full[n][k])]
        nbytes = sum(v.numel() * v.element_size() for v in full[n].values())
        if diff:
            ok = False
            say(f"      {n} rank(s): {len(diff)} tensors differ, e.g. {diff[:3]}")
        else:
            say(f"      {n} rank(s) == 2 ranks: {len(base)} tensors, {nbytes / 1e6:.2f} MB, identical")
    say("\nOK" if ok else "\nFAILED")
    return 0 if ok else 1


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return a.numel() == 0 or torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


if __name__ == "__main__":
    sys.exit(main())
