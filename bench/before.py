"""The same benchmark rows measured on another revision of distckpt, in the same run: before and after.

``bench.run --before REV`` checks REV out into a temporary git worktree and runs the bench code of that
revision in child processes whose imports resolve there (``PYTHONPATH`` and the working directory), in
turn with this revision's rounds, so that both see the same machine state: the reshard tables and the
tmpfs tables (distckpt's rows of REV beside this revision's). It is for a change whose effect is smaller
than the drift between two runs of the bench (docs/performance.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

# run inside the worktree: its bench and its distckpt. argv: the worktree, then a JSON list of calls, each
# [worker function name, ranks, arguments]; prints the last call's per-rank results
_DRIVER = """
import json, os, sys
import distckpt
from distckpt.testing import run_ranks
from bench import workers
assert os.path.realpath(distckpt.__file__).startswith(os.path.realpath(sys.argv[1])), distckpt.__file__
env = {k: v for k, v in os.environ.items() if k.startswith("DISTCKPT_") or k == "OMP_NUM_THREADS"}
if __name__ == "__main__":
    for name, ranks, args in json.loads(sys.argv[2]):
        rows = run_ranks(getattr(workers, name), ranks, *args, env=env, timeout_s=3600)
    print("ROWS " + json.dumps(rows))
"""


class Revision:
    """A git worktree of ``rev`` of the repository holding this file, removed on :meth:`close`."""

    def __init__(self, rev: str) -> None:
        self.repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.rev = rev
        self.root = tempfile.mkdtemp(prefix="distckpt-before-")
        os.rmdir(self.root)
        subprocess.run(["git", "-C", self.repo, "worktree", "add", "--detach", self.root, rev], check=True,
                       capture_output=True)
        self.short = subprocess.run(["git", "-C", self.root, "rev-parse", "--short", "HEAD"], check=True,
                                    capture_output=True, text=True).stdout.strip()

    def run(self, calls: list, env: dict) -> list:
        """Each rank's result of the last of ``calls`` ([worker name, ranks, arguments]) at this revision."""
        child_env = dict(os.environ) | env | {"PYTHONPATH": os.path.join(self.root, "src") + os.pathsep + self.root}
        out = subprocess.run([sys.executable, "-c", _DRIVER, self.root, json.dumps(calls)], cwd=self.root, env=child_env,
                             capture_output=True, text=True, timeout=3 * 3600)
        lines = [line for line in out.stdout.splitlines() if line.startswith("ROWS ")]
        if out.returncode or not lines:
            raise RuntimeError(f"the bench at {self.rev} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
        return json.loads(lines[-1][5:])

    def reshard_rows(self, total: int, location: str, ranks: int, repeat: int, env: dict) -> list[dict]:
        """Each rank's reshard rows (``workers.reshard_load``) at this revision, loading the checkpoints this
        revision's bench saved under ``location``: the same files. On this VM the speed of reading a tmpfs file
        depends on the memory its pages landed in; both revisions loading files of their own measured the
        files (0.27 against 0.30 s for either revision's code on two copies of one checkpoint), not the code."""
        return self.run([["reshard_load", ranks, [total, location, 2, repeat]]], env)

    def peers_rows(self, ranks: int, total: int, location: str, cold: bool, repeat: int, env: dict) -> list[dict]:
        """Each rank's rows of ``workers.peers_round`` at this revision."""
        return self.run([["peers_round", ranks, [total, location, cold, repeat]]], env)

    def close(self) -> None:
        subprocess.run(["git", "-C", self.repo, "worktree", "remove", "--force", self.root], capture_output=True)
