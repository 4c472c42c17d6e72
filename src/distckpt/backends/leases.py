"""Leases on saves in flight: how a cleaner tells a live save's staging area from a crashed one.

The coordinator of a save takes a lease before any byte of the save is
written, and gives it back once the save has committed or been discarded.
The lease records who holds it (host, boot, pid namespace, pid and the
process's start time) and is renewed while the save runs. A cleaner removes
a staging area only when its save is proven dead:

- its lease names a process on this very host (same boot, same pid
  namespace) that no longer runs: a pid reused since then has another start
  time, so it does not count as the holder;
- or its lease names this very process, which no longer holds it (the save
  ended, but giving the lease back failed: the store was unreachable);
- or its lease names a process elsewhere and has not been renewed for
  ``knobs.lease_stale_s()`` seconds;
- or it has no lease at all (a save of an older distckpt, or one whose
  non-coordinator rank outlived its coordinator) and nothing in it changed
  for that long.

Everything else is left alone, however old: a hung trainer keeps its lease.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from typing import Any, Optional

from .. import knobs, process_state
from ..engine.blobs import BlobStore
from ..format.json_text import parse_json


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode("ascii", "replace").strip()
    except OSError:
        return ""


def _start_time(pid: int) -> Optional[str]:
    """The start time of process ``pid`` in clock ticks since boot, or None if it does not exist."""
    raw = _read(f"/proc/{pid}/stat")
    if not raw:
        return None
    fields = raw.rsplit(")", 1)[-1].split()  # the command name may hold spaces and parentheses
    return fields[19] if len(fields) > 19 else None


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


_incarnation = secrets.token_hex(8)  # tells this process from an earlier one of the same pid and start time


def holder() -> dict[str, Any]:
    """This process, as a lease records it."""
    return {"host": socket.gethostname(), "boot_id": _read("/proc/sys/kernel/random/boot_id"), "pid_ns": _pid_namespace(),
            "pid": os.getpid(), "start": _start_time(os.getpid()), "incarnation": _incarnation, "since": time.time()}


def holder_is_dead(record: bytes, age_s: Optional[float]) -> bool:
    """Whether the holder of the lease ``record``, last renewed ``age_s`` seconds ago, is proven dead."""
    try:
        who = parse_json(record, "a lease record")
        if not isinstance(who, dict):
            raise ValueError
    except (ValueError, UnicodeDecodeError):
        who = {}
    here = holder()
    same_host = bool(who.get("boot_id")) and all(who.get(k) == here[k] for k in ("host", "boot_id", "pid_ns"))
    pid = who.get("pid")
    if same_host and type(pid) is int and pid > 0:
        if pid == here["pid"]:
            return who.get("incarnation") != _incarnation
        start = _start_time(pid)
        return start is None or start != who.get("start")
    return age_s is not None and age_s > knobs.lease_stale_s()


def is_holder_record(record: bytes) -> bool:
    """Whether ``record`` is a lease record as :func:`holder` writes it (not something else found at a lease's name)."""
    try:
        who = parse_json(record, "a lease record")
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(who, dict) and type(who.get("pid")) is int and isinstance(who.get("host"), str)


def save_is_dead(store: "BlobStore", save_id: str, staging_age_s: Optional[float]) -> bool:
    """Whether the save ``save_id`` of ``store`` is proven dead (see the module text).

    ``staging_age_s`` is how long ago its staging area last changed (None: unknown).
    """
    lease = store.read_lease(save_id)
    if lease is None:
        return staging_age_s is not None and staging_age_s > knobs.lease_stale_s()
    return lease_is_dead(save_id, *lease)


def lease_is_dead(save_id: str, record: bytes, age_s: Optional[float]) -> bool:
    """Whether the holder of the lease on ``save_id`` (its ``record``, renewed ``age_s`` seconds ago) is proven dead."""
    if _is_mine(record):  # this process: alive exactly while it still holds the lease
        return not _renewer.holds(save_id)
    return holder_is_dead(record, age_s)


def _is_mine(record: bytes) -> bool:
    try:
        who = parse_json(record, "a lease record")
    except (ValueError, UnicodeDecodeError):
        return False
    here = holder()
    return isinstance(who, dict) and all(who.get(k) == here[k] for k in ("host", "boot_id", "pid_ns", "pid", "incarnation"))


class Lease:
    """The lease of this process on save ``save_id`` of ``store``; renewed in the background until released."""

    def __init__(self, store: "BlobStore", save_id: str):
        self.store = store
        self.save_id = save_id
        # held before the record exists: a reader in another thread of this process finds the record only while
        # this process holds it (a record of this process's that it does not hold is a dead holder's)
        _renewer.add(self)
        try:
            store.put_lease(save_id, json.dumps(holder()).encode())
        except BaseException:
            _renewer.discard(self)
            raise

    def renew(self) -> None:
        self.store.renew_lease(self.save_id)

    def abandon(self) -> None:
        """Stop renewing, and leave the record: what the holder left is then a dead holder's to every cleaner
        (this process's too), as after a crash."""
        _renewer.discard(self)

    def release(self) -> None:
        """Give the lease back (idempotent); call only once the staging area is committed or removed."""
        if _renewer.discard(self):
            self.store.drop_lease(self.save_id)


class _Renewer:
    """One daemon thread renewing every lease this process holds."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held: set[Lease] = set()
        self.wake = threading.Event()
        self.thread: Optional[threading.Thread] = None

    def add(self, lease: Lease) -> None:
        with self.lock:
            self.held.add(lease)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="distckpt-leases", daemon=True)
                self.thread.start()

    def holds(self, save_id: str) -> bool:
        with self.lock:
            return any(lease.save_id == save_id for lease in self.held)

    def discard(self, lease: Lease) -> bool:
        with self.lock:
            if lease not in self.held:
                return False
            self.held.discard(lease)
            return True

    def _run(self) -> None:
        while True:
            self.wake.wait(knobs.lease_renew_s())
            with self.lock:
                leases = list(self.held)
            for lease in leases:
                try:
                    lease.renew()
                except Exception:  # noqa: BLE001 - a failed renewal is retried; the lease lives until stale
                    pass

    def after_fork(self) -> None:
        # a forked child holds none of its parent's leases, and has no renewal thread
        self.lock = threading.Lock()
        self.held = set()
        self.thread = None


_renewer = _Renewer()


def _new_incarnation() -> None:
    global _incarnation
    _incarnation = secrets.token_hex(8)


def simulate_process_death() -> None:
    """For crash tests that stop a save in-process: from now on this process is a new one, and
    the leases it held are those of a process that died (left in place, never renewed)."""
    _new_incarnation()
    _renewer.after_fork()


@process_state.on_fork_child
def _fresh_leases_in_child() -> None:
    _new_incarnation()  # a forked child is a process of its own, holding none of its parent's leases
    _renewer.after_fork()
