"""One hook at fork (distckpt.process_state): a forked child starts with fresh locks, no leases of its parent's, and
no saves in flight, whichever lock a parent's thread held at the fork; the resets run in import order."""

from __future__ import annotations

import ast
import os
import pathlib

import pytest

import distckpt
from distckpt import async_saving, distributed, process_state, staging
from distckpt.backends import direct_io, leases, s3_objects, write_paths
from tests.forking import run_in_fork

pytestmark = pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="no fork here")


def _locks() -> dict:
    return {
        "distributed": distributed._op_lock,
        "s3_objects": s3_objects._CLIENTS_LOCK,
        "write_paths": write_paths.PATHS.lock,
        "direct_io": direct_io._FLUSHERS_LOCK,
        "leases": leases._renewer.lock,
        "staging": staging._STATE.lock,
        "async_saving": async_saving._STATE.lock,
    }


def _fresh_in_child(parent_incarnation: str, parent_ids: dict) -> dict:
    """What the child finds: each lock free and a new object, the lease state its own."""
    locks = _locks()
    free = {name: lock.acquire(blocking=False) for name, lock in locks.items()}
    for name, got in free.items():
        if got:
            locks[name].release()
    return {
        "free": free,
        "new": {name: id(lock) != parent_ids[name] for name, lock in locks.items()},
        "incarnation": leases._incarnation != parent_incarnation,
        "leases": (leases._renewer.held, leases._renewer.thread),
        "saves": (async_saving._STATE.in_flight, async_saving._STATE.executor, staging._STATE.free_pools),
    }


def test_a_child_forked_while_every_lock_is_held_starts_fresh():
    locks = _locks()
    for lock in locks.values():
        assert lock.acquire(timeout=10)  # as if a parent's thread held each one at the fork
    try:
        seen = run_in_fork(_fresh_in_child, leases._incarnation, {name: id(lock) for name, lock in locks.items()},
                           hang="a forked child blocked on a lock its parent held")
    finally:
        for lock in locks.values():
            lock.release()
    assert isinstance(seen, dict), seen
    assert seen["free"] == dict.fromkeys(locks, True)
    assert seen["new"] == dict.fromkeys(locks, True)
    assert seen["incarnation"], "the child reused its parent's lease identity"
    assert seen["leases"] == (set(), None)
    assert seen["saves"] == ([], None, [])


def test_resets_are_registered_once_each_in_import_order():
    names = process_state.fork_resets()
    assert len(names) == len(set(names))
    expected = ["distckpt.distributed._fresh_lock_in_child", "distckpt.backends.direct_io._fresh_state_in_child",
                "distckpt.backends.leases._fresh_leases_in_child", "distckpt.backends.s3_objects._fresh_lock_in_child",
                "distckpt.backends.write_paths.WritePaths.reset", "distckpt.staging._fresh_pools_in_child",
                "distckpt.async_saving._fresh_state_in_child"]
    assert set(expected) <= set(names)
    # a module's reset runs after those of the modules it imports
    assert names.index("distckpt.distributed._fresh_lock_in_child") < names.index("distckpt.async_saving._fresh_state_in_child")
    assert names.index("distckpt.staging._fresh_pools_in_child") < names.index("distckpt.async_saving._fresh_state_in_child")


def test_a_failing_reset_does_not_keep_the_others_from_running(monkeypatch):
    ran = []
    monkeypatch.setattr(process_state, "_RESETS", [lambda: ran.append(1), lambda: 1 / 0, lambda: ran.append(3)])
    with pytest.raises(ZeroDivisionError):
        process_state._after_fork_in_child()
    assert ran == [1, 3]


def test_only_process_state_registers_at_fork():
    src = pathlib.Path(distckpt.__file__).parent
    callers = sorted(str(path.relative_to(src)) for path in src.rglob("*.py")
                     if any(isinstance(node, ast.Attribute) and node.attr == "register_at_fork"
                            for node in ast.walk(ast.parse(path.read_text()))))
    assert callers == ["process_state.py"], callers
