"""Leftovers of a save that crashed, as a killed process leaves them: a staging area and a lease
whose holder process no longer runs."""

from __future__ import annotations

import json
import subprocess
import sys

from distckpt.backends.leases import holder


def dead_holder_record() -> bytes:
    """A lease record of this host naming a process that has exited."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    record = holder()
    record["pid"] = int(child.stdout)  # exited: its start time is gone with it (or another process's, if reused)
    return json.dumps(record).encode()


def leave_crashed_save(store, save_id: str):
    """Make ``store``'s staging area of ``save_id`` exist, as a save killed mid-way leaves it; return it."""
    store.put_lease(save_id, dead_holder_record())
    staging = store.staging(save_id)
    staging.prepare()
    return staging
