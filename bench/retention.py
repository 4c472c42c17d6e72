"""What retention costs as a run grows: a run of full saves and one of incremental saves, retention after each save,
the time of each retention (``CheckpointManager.apply_retention``: the mark phase over every kept step's document,
the deletion or retirement of the steps it drops, the sweep of retired files), here and, with ``--before REV``,
on the code of another revision in the same sitting.

    python -m bench.retention                       # 100 steps of each kind, keep_last=50, under $TMPDIR
    python -m bench.retention --steps 10 --keep 4   # a smoke run
    python -m bench.retention --before e461a9c      # beside the code of e461a9c (a git worktree)

Each step's state has ``--tensors`` tensors of 16 KiB and one that changes at every step; the incremental run
references the unchanged ones, so from step ``keep + 1`` on each retention retires a step whose files later steps
reference, and the sweep prunes what they no longer do. Rows: the median, 90th percentile and largest time of a
retention over the steps that dropped a step, and the total. No raw floor applies: retention moves no data; its
cost is reading documents (about ``keep`` of them per retention; parsed once per version, docs/format.md 6) and
listing and renaming files.

The script imports nothing of the bench package, so that it runs as it is against another revision's distckpt.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def run(kind: str, root: str, steps: int, keep: int, tensors: int) -> dict:
    import torch

    import distckpt

    times: list = []

    class Timed(distckpt.CheckpointManager):
        def apply_retention(self):
            begun = time.perf_counter()
            try:
                return super().apply_retention()
            finally:
                times.append(time.perf_counter() - begun)

    mgr = Timed(root, keep_last=keep, incremental=kind == "incremental", no_dist=True)
    frozen = {f"layers.{i}.weight": torch.full((4096,), float(i)) for i in range(tensors)}
    for step in range(1, steps + 1):
        mgr.save(step, {**frozen, "head": torch.full((4096,), float(step)), "step": step})
    assert mgr.all_steps() == list(range(max(1, steps - keep + 1), steps + 1)), mgr.all_steps()
    out = {k: torch.zeros_like(v) for k, v in frozen.items()} | {"head": torch.zeros(4096), "step": -1}
    mgr.load(out, step=steps - keep + 1)  # the oldest kept step, whose every unchanged chunk was referenced
    assert out["step"] == steps - keep + 1 and all(torch.equal(out[k], v) for k, v in frozen.items())
    dropping = sorted(times[keep:]) or sorted(times)
    return {"kind": kind, "distckpt": os.path.dirname(distckpt.__file__), "retentions": len(times),
            "median_ms": 1e3 * statistics.median(dropping), "p90_ms": 1e3 * dropping[int(0.9 * (len(dropping) - 1))],
            "max_ms": 1e3 * dropping[-1], "total_s": sum(times)}


def _child(args: argparse.Namespace, kind: str, root: str, pythonpath: str = "") -> dict:
    env = dict(os.environ, DISTCKPT_PROGRESS="off")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", kind, "--root", root, "--steps", str(args.steps),
                          "--keep", str(args.keep), "--tensors", str(args.tensors)],
                         env=env, capture_output=True, text=True, timeout=3600, cwd=tempfile.gettempdir())
    rows = [line for line in out.stdout.splitlines() if line.startswith("ROW ")]
    if out.returncode or not rows:
        raise RuntimeError(f"retention bench ({kind}) failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(rows[-1][4:])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--keep", type=int, default=50, help="keep_last of both runs")
    ap.add_argument("--tensors", type=int, default=32, help="unchanged tensors in each step's state")
    ap.add_argument("--dir", default=None, help="where the runs go (default: $TMPDIR)")
    ap.add_argument("--before", default=None, help="also run the code of this git revision, in turn with this one")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--root", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print("ROW " + json.dumps(run(args.one, args.root, args.steps, args.keep, args.tensors)), flush=True)
        return {}
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    revisions = [("this", os.path.join(here, "src"))]
    before = None
    if args.before:
        from bench.before import Revision  # only here: the script itself runs against another revision's distckpt

        before = Revision(args.before)
        revisions.append((args.before, os.path.join(before.root, "src")))
    rows = []
    base = tempfile.mkdtemp(prefix="distckpt-bench-retention-", dir=args.dir)
    try:
        for kind in ("full", "incremental"):
            for name, src in revisions:  # in turn, in the same sitting
                row = _child(args, kind, os.path.join(base, f"{kind}-{len(rows)}"), src)
                assert os.path.realpath(row["distckpt"]).startswith(os.path.realpath(src)), row["distckpt"]
                rows.append({**row, "revision": name})
    finally:
        shutil.rmtree(base, ignore_errors=True)
        if before is not None:
            before.close()
    print(f"retention after each of {args.steps} saves, keep_last={args.keep}, {args.tensors + 1} tensors a step "
          "(times of the retentions that dropped a step)")
    print(f"{'run':<12} {'revision':<10} {'median ms':>10} {'p90 ms':>9} {'max ms':>9} {'total s':>8}")
    for r in rows:
        print(f"{r['kind']:<12} {r['revision']:<10} {r['median_ms']:>10.2f} {r['p90_ms']:>9.2f} {r['max_ms']:>9.2f} "
              f"{r['total_s']:>8.2f}")
    result = {"steps": args.steps, "keep": args.keep, "tensors": args.tensors, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
