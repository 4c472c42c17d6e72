"""A deleter and an incremental save of one run, each stalled at its worst moment while the other runs whole: no
committed step loses a byte (distckpt/backends/run_guard.py). The deleter here is a second manager on the run: in
a thread of this process, and once in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import uuid

import pytest

import distckpt
from distckpt.backends import run_guard
from distckpt.backends.leases import simulate_process_death
from distckpt.backends.schemes import store_for
from distckpt.engine.references import UNKNOWN, committed_files
from distckpt.faults import Fault, inject
from distckpt.run_references import RunFiles

from .test_run_lifecycle_hostile import assert_loads, state


@pytest.fixture(params=["disk", "memory"])
def root(request, tmp_path):
    if request.param == "disk":
        yield str(tmp_path / "run")
    else:
        yield f"memory://guard-{uuid.uuid4().hex[:8]}"


def references(path: str) -> dict:
    _, files = committed_files(store_for(path))
    assert files is not None and files is not UNKNOWN and files.save_id, path
    return files.references


def stored_names(root: str) -> set:
    """Every file or object under the run, by its path below the root."""
    if "://" not in root:
        return {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}
    store = store_for(root)
    return {o.key for o in store.objects.list(store.prefix + "/")}


def test_a_deleter_stalled_between_its_mark_and_its_deletes_makes_the_save_write_everything(root, monkeypatch):
    """A second manager's ``delete(2)`` reads what the kept steps reference, then stalls; meanwhile an incremental
    save of step 3, whose unchanged chunks are step 2's, runs whole. It sees the deleter's record and writes every
    chunk, so when the deleter goes on and removes step 2, step 3 still loads."""
    mgr = distckpt.CheckpointManager(root, incremental=True, no_dist=True)
    mgr.save(1, state(1))
    mgr.save(2, state(2, salt=1.0))
    marked, go = threading.Event(), threading.Event()
    real_delete = RunFiles.delete

    def stalled_delete(self, name, keep):
        marked.set()
        assert go.wait(30)
        real_delete(self, name, keep)

    deleter = distckpt.CheckpointManager(root, no_dist=True)
    monkeypatch.setattr(deleter._files, "delete", stalled_delete.__get__(deleter._files))
    errors = []
    thread = threading.Thread(target=lambda: _run(errors, deleter.delete, 2))
    thread.start()
    try:
        assert marked.wait(30)
        mgr.save(3, state(3, salt=1.0))
    finally:
        go.set()
        thread.join(30)
    assert not errors, errors
    assert references(mgr.path(3)) == {}, "written whole while a deleter was at work"
    assert mgr.all_steps() == [1, 3]
    assert_loads(mgr.path(3), state(3, salt=1.0))
    mgr.save(4, state(4, salt=1.0))  # no deleter now: the save references step 3 again
    assert references(mgr.path(4))
    assert_loads(mgr.path(4), state(4, salt=1.0))


def test_a_deleter_that_runs_while_a_referencing_save_is_in_flight_keeps_everything_until_the_next_sweep(root):
    """``delete(2)`` runs whole while the save of step 3 that references step 2 is between its check and its
    commit: the deleter sees the save's record and retires step 2 keeping every file, step 3 commits and loads, and
    the next retention with no save in flight removes what no kept step references."""
    mgr = distckpt.CheckpointManager(root, incremental=True, no_dist=True)
    mgr.save(1, state(1))
    mgr.save(2, state(2, salt=1.0))
    other = distckpt.CheckpointManager(root, no_dist=True)
    with inject(Fault("call", kinds=("rename",), callback=lambda kind, what: other.delete(2), once=True)):
        mgr.save(3, state(3, salt=1.0))
    assert references(mgr.path(3)), "step 3 references step 2's files"
    assert mgr.all_steps() == [1, 3]
    assert_loads(mgr.path(3), state(3, salt=1.0))
    before = stored_names(root)
    mgr.delete(1)
    mgr.remove_stale_temporaries()
    assert_loads(mgr.path(3), state(3, salt=1.0))
    after = stored_names(root)
    assert len(after) < len(before) - 1, "what step 2 held beyond step 3's references went at the next sweep"
    assert not [n for n in after if run_guard.RUN_RECORDS.encode().hex() in n or "/.distckpt-run/" in n], after


def test_a_deleter_that_publishes_no_record_is_still_caught_at_the_commit(tmp_path, monkeypatch):
    """A deleter of a release before the run's records (here: one whose record is not published) deletes the
    referenced step after the save's check: the commit's second check withdraws the step and the save fails typed."""
    root = str(tmp_path / "run")
    mgr = distckpt.CheckpointManager(root, incremental=True, no_dist=True)
    mgr.save(1, state(1))
    mgr.save(2, state(2, salt=1.0))
    other = distckpt.CheckpointManager(root, no_dist=True)

    def old_release_delete(kind, what):
        with monkeypatch.context() as m:
            m.setattr(run_guard.Deleting, "savers_live", lambda self: False)
            other.delete(2)

    with inject(Fault("call", kinds=("rename",), callback=old_release_delete, once=True)):
        with pytest.raises(distckpt.CorruptCheckpointError, match="withdrawn"):
            mgr.save(3, state(3, salt=1.0))
    assert mgr.all_steps() == [1]
    mgr.save(4, state(4, salt=1.0))
    assert_loads(mgr.path(4), state(4, salt=1.0))


_STALLED_DELETER = textwrap.dedent("""
    import os, sys, time
    import distckpt
    from distckpt.run_references import RunFiles
    root, marked, go = sys.argv[1:4]
    real = RunFiles.delete
    def stalled(self, name, keep):
        open(marked, "w").close()
        for _ in range(600):
            if os.path.exists(go):
                break
            time.sleep(0.05)
        real(self, name, keep)
    RunFiles.delete = stalled
    distckpt.CheckpointManager(root, no_dist=True).delete(2)
""")


@pytest.mark.slow
def test_a_deleter_in_another_process_stalled_after_its_mark_costs_no_step(tmp_path):
    """The same race with the deleter in a process of its own (its record is another live process's lease)."""
    import time

    root, marked, go = str(tmp_path / "run"), str(tmp_path / "marked"), str(tmp_path / "go")
    mgr = distckpt.CheckpointManager(root, incremental=True, no_dist=True)
    mgr.save(1, state(1))
    mgr.save(2, state(2, salt=1.0))
    proc = subprocess.Popen([sys.executable, "-c", _STALLED_DELETER, root, marked, go])
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(marked):
            assert proc.poll() is None and time.monotonic() < deadline, "the deleter never reached its deletes"
            time.sleep(0.05)
        mgr.save(3, state(3, salt=1.0))
    finally:
        open(go, "w").close()
        assert proc.wait(60) == 0
    assert references(mgr.path(3)) == {}
    assert mgr.all_steps() == [1, 3]
    assert_loads(mgr.path(3), state(3, salt=1.0))


def test_a_dead_deleters_record_does_not_stop_references_and_is_dropped(tmp_path):
    """A deleter killed mid-way leaves its record; it names a dead process, so the next save references as usual
    and drops the record."""
    root = str(tmp_path / "run")
    mgr = distckpt.CheckpointManager(root, incremental=True, no_dist=True)
    mgr.save(1, state(1))
    records = run_guard.records_store(store_for(root))
    run_guard.deleting(store_for(root)).__enter__()  # the deleter's record is published, then its process dies
    simulate_process_death()
    assert [t for t in records.lease_ids() if t.startswith(run_guard.DELETE)]
    mgr.save(2, state(2))
    assert references(mgr.path(2))
    assert records.lease_ids() == []


def _run(errors: list, fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)
