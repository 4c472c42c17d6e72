"""Hostile review of the run's records (distckpt/backends/run_guard.py): deleters and referencing saves of one run
that exclude each other with records in the run's root. Each test fails on the code it was written against, for the
reason its text gives: a committed step that loses bytes, a save that fails where the records should have kept it,
or a record that outlives its holder's failure and so grows the run's disk (or its saves) without bound."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest

import distckpt
from distckpt.backends import blob_storage, objects, run_guard
from distckpt.backends.schemes import store_for
from distckpt.faults import Fault, inject

from .test_run_guard import references
from .test_run_lifecycle_hostile import assert_loads, state

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORD_MARK = ".distckpt-lease-" + run_guard.RUN_RECORDS.encode().hex() + "-"


@pytest.fixture(params=["disk", "memory"])
def root(request, tmp_path):
    if request.param == "disk":
        yield str(tmp_path / "run")
    else:
        yield f"memory://guard-hostile-{uuid.uuid4().hex[:8]}"


def records_on_disk(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith(RECORD_MARK))


def data_files(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
                  if f.endswith(".safetensors"))


# ---------------------------------------------------------------------------------------------------------------
# A deleter reads its mark, and only then looks for live savers: a save that was past its own look (it saw no
# deleter) and commits, dropping its record, between the two is in neither. manager.py _kept (and the names read
# before the record), objects.py/fs_runs.py _drop_replaced.


def test_a_save_that_commits_between_a_deleters_mark_and_its_look_for_savers_keeps_its_references(root):
    """An incremental save of step 3 (references step 2) has published its record and found no deleter; at its
    commit, another manager's ``delete(2)`` publishes its record and reads its mark (step 3 is not committed yet),
    then stalls; step 3 commits and drops its record; the deleter goes on, finds no live saver, and deletes every
    file of step 2, which committed step 3 references. Step 3 must still load."""
    mgr = distckpt.CheckpointManager(root, incremental=True, no_dist=True)
    mgr.save(1, state(1))
    mgr.save(2, state(2, salt=1.0))
    deleter = distckpt.CheckpointManager(root, no_dist=True)
    marked, go = threading.Event(), threading.Event()
    real_kept_files = deleter._files.kept_files

    def stalled_mark(names):
        kept = real_kept_files(names)  # the mark is read: a stall (a GC pause, a slow listing) here
        marked.set()
        assert go.wait(30)
        return kept

    deleter._files.kept_files = stalled_mark
    errors: list = []

    _save_3_with_a_deleter_started_at_its_commit(mgr, errors, marked, go, deleter.delete, 2)
    assert not errors, errors
    assert references(mgr.path(3)), "step 3 references step 2 (the save saw no deleter)"
    assert mgr.all_steps() == [1, 3]
    assert_loads(mgr.path(3), state(3, salt=1.0))  # fails: step 2's data file, which step 3 references, is gone


def test_an_overwrite_whose_drop_stalls_after_its_mark_costs_no_step_committed_meanwhile(monkeypatch):
    """The same hole in the drop of the save an overwrite replaced (objects.py ``_drop_replaced``): step 2 is saved
    again with ``overwrite=True`` while step 3, which references step 2's first save, commits between the drop's
    mark and its look for savers. The drop deletes the replaced save's objects; step 3 must still load."""
    root = f"memory://guard-hostile-{uuid.uuid4().hex[:8]}"
    mgr = distckpt.CheckpointManager(root, incremental=True, no_dist=True)
    mgr.save(1, state(1))
    mgr.save(2, state(2, salt=1.0))
    marked, go = threading.Event(), threading.Event()
    real_mark = objects.referenced_by_siblings

    def stalled_mark(*args, **kwargs):
        keep = real_mark(*args, **kwargs)
        marked.set()
        assert go.wait(30)
        return keep

    monkeypatch.setattr(objects, "referenced_by_siblings", stalled_mark)
    errors: list = []

    def overwrite():
        distckpt.save(state(2, salt=5.0), checkpoint_id=mgr.path(2), overwrite=True, no_dist=True)

    _save_3_with_a_deleter_started_at_its_commit(mgr, errors, marked, go, overwrite)
    assert not errors, errors
    assert references(mgr.path(3))
    assert_loads(mgr.path(2), state(2, salt=5.0))
    assert_loads(mgr.path(3), state(3, salt=1.0))  # fails: the replaced save's objects are deleted


# ---------------------------------------------------------------------------------------------------------------
# The base an incremental save references is chosen (and checked) by the manager before the save publishes its
# record: a deleter that runs whole in between is seen by nobody, and the save fails at its commit.


def test_a_deleter_that_runs_whole_while_a_save_plans_does_not_fail_the_save(root, monkeypatch):
    """``delete(2)`` by another manager runs from start to end after the manager of the run chose step 2 as the
    base of its save of step 3, and before that save published its record (the planning of a save, a collective
    across ranks that waits on the slowest, lies in between). The deleter found no saver and deleted step 2 as it
    may; the save must then reference nothing that is gone (write every chunk), not fail."""
    mgr = distckpt.CheckpointManager(root, incremental=True, no_dist=True)
    mgr.save(1, state(1))
    mgr.save(2, state(2, salt=1.0))
    other = distckpt.CheckpointManager(root, no_dist=True)
    real_referencing = blob_storage.referencing

    def after_a_whole_deleter(run):
        other.delete(2)
        return real_referencing(run)

    monkeypatch.setattr(blob_storage, "referencing", after_a_whole_deleter)
    mgr.save(3, state(3, salt=1.0))  # fails: CorruptCheckpointError, "... is gone; nothing was committed"
    assert mgr.all_steps() == [1, 3]
    assert_loads(mgr.path(3), state(3, salt=1.0))


# ---------------------------------------------------------------------------------------------------------------
# A deleter cut short by an error abandons its record (run_guard.deleting): it stays in the root, and names a
# process that goes on running. Retention's errors are caught and logged (CheckpointManager._retain_after_commit),
# so the process does go on.

_FAILING_DELETER = textwrap.dedent("""
    import os, sys, time
    import distckpt
    from distckpt.faults import Fault, inject
    root, done, go = sys.argv[1:4]
    mgr = distckpt.CheckpointManager(root, no_dist=True)
    with inject(Fault("eio", kinds=("rename",), once=True)):
        try:
            mgr.delete(1)
        except OSError:
            pass  # an evaluator that logs its failed delete and carries on
    open(done, "w").close()
    for _ in range(1200):
        if os.path.exists(go):
            break
        time.sleep(0.05)
""")


def test_a_deleter_that_failed_in_a_live_process_does_not_stop_the_runs_references(tmp_path):
    """A second process's ``delete(1)`` fails (EIO at its rename) and the process carries on. The run's next
    incremental save must reference step 2 as usual: no deleter is at work. The record the failed deleter
    abandoned names a live process on this host, so every save of every other process writes every chunk for as
    long as that process lives."""
    root, done, go = str(tmp_path / "run"), str(tmp_path / "done"), str(tmp_path / "go")
    mgr = distckpt.CheckpointManager(root, incremental=True, no_dist=True)
    mgr.save(1, state(1))
    mgr.save(2, state(2, salt=1.0))
    proc = subprocess.Popen([sys.executable, "-c", _FAILING_DELETER, root, done, go],
                            env={**os.environ, "PYTHONPATH": os.path.join(REPO, "src")})
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(done):
            assert proc.poll() is None and time.monotonic() < deadline, "the deleter process never got there"
            time.sleep(0.05)
        assert mgr.all_steps() == [1, 2], "the failed delete removed nothing"
        mgr.save(3, state(3, salt=1.0))
    finally:
        open(go, "w").close()
        assert proc.wait(60) == 0
    assert references(mgr.path(3)), "no deleter was at work: step 3 references step 2 (fails: written whole)"


def test_failed_deleters_leave_no_records_piling_up_in_the_run(tmp_path):
    """Four retentions that each fail (EIO at a rename) in a run of plain saves: each leaves its record in the run's
    root, and nothing but a restart's cleanup ever drops them (a successful retention does not; a run with no
    incremental save never looks at deleters' records). A failure must not grow the run's root."""
    root = str(tmp_path / "run")
    mgr = distckpt.CheckpointManager(root, no_dist=True)
    retention = distckpt.CheckpointManager(root, no_dist=True, keep_last=1, cleanup=False)
    mgr.save(1, state(1))
    for step in range(2, 6):
        mgr.save(step, state(step))
        with inject(Fault("eio", kinds=("rename",))):
            with pytest.raises(distckpt.StorageIOError):
                retention.apply_retention()
    assert retention.apply_retention() == [1, 2, 3, 4]
    assert records_on_disk(root) == []  # fails: four abandoned delete records


# ---------------------------------------------------------------------------------------------------------------
# A full disk: the record's file is created, its bytes are not written.

_FULL_DISK_RETENTION = textwrap.dedent("""
    import resource, signal, sys
    import distckpt
    from distckpt.manager import CheckpointManager  # imports (torch's too) done before the disk is full
    import distckpt.run_references, distckpt.backends.run_guard
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    # from here on no file of this process grows by a byte, as on a disk whose blocks are all taken: a file can
    # be created, renamed and removed, not written
    print(CheckpointManager(sys.argv[1], keep_last=1, no_dist=True, cleanup=False).apply_retention())
""")


def _retention_on_a_full_disk(root: str) -> None:
    mgr = distckpt.CheckpointManager(root, no_dist=True)
    for step in (1, 2, 3):
        mgr.save(step, state(step))
    out = subprocess.run([sys.executable, "-c", _FULL_DISK_RETENTION, root], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": os.path.join(REPO, "src")})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[1,", "2]"], out


def test_retention_on_a_full_disk_frees_the_steps_it_reports_deleted(tmp_path):
    """A run of plain (not incremental) saves fills its disk; retention (keep_last=1) then cannot write its record
    and, answering "a saver may be live", retires steps 1 and 2 keeping every file while it reports them deleted.
    Nothing is freed, so the next save fails too, and no retention follows a failed save: the trainer cannot get
    out of the full disk by itself. Retention of what nothing references must free it."""
    root = str(tmp_path / "run")
    _retention_on_a_full_disk(root)
    left = [name for name in data_files(root) if not name.startswith("step-0000000003")]
    assert left == [], left  # fails: both retired steps kept their data files


def test_a_record_that_could_not_be_written_leaves_no_file_behind(tmp_path):
    """The same full disk: the deleter's record file was created, its JSON could not be written. The empty file is
    "not distckpt's" to every reader, so no cleanup ever removes it, even once the disk has room again: one more
    file in the run's root per record that a full disk cut short."""
    root = str(tmp_path / "run")
    _retention_on_a_full_disk(root)
    distckpt.CheckpointManager(root, no_dist=True).remove_stale_temporaries()  # the disk has room again
    assert records_on_disk(root) == []  # fails: the empty delete record stays for good


# ---------------------------------------------------------------------------------------------------------------
# A save that published its record and then fails to look for deleters (an S3 LIST that fails) never drops the
# record: run_guard.referencing raises before BlobStorageWriter keeps it, so discard_incomplete cannot release it,
# and the lease renewer keeps it fresh for the rest of the process's life.


@pytest.fixture(scope="module")
def s3_endpoint():
    pytest.importorskip("moto")
    pytest.importorskip("boto3")
    from tests.storage.s3_server import s3_server

    with s3_server() as url:
        yield url


def test_a_failed_look_for_deleters_leaves_no_live_record_behind(s3_endpoint, monkeypatch):
    """One LIST of the run's records fails (503 past the retries) while the save of step 2 looks for live deleters.
    The save writes every chunk (as if a deleter were at work), and its record goes with it: had it stayed, renewed for
    as long as the trainer runs, every deleter of the run would keep every file from then on (here ``delete(1)`` of a
    step nothing references would leave its data in place)."""
    import boto3

    from distckpt.testing.fault_proxy import FaultProxy, Rule
    from tests.storage.s3_server import new_bucket

    bucket = new_bucket(boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1"))
    with FaultProxy(s3_endpoint, timeout_s=30) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
        monkeypatch.setenv("DISTCKPT_S3_MAX_ATTEMPTS", "2")
        root = f"s3://{bucket}/run-{uuid.uuid4().hex[:8]}"
        mgr = distckpt.CheckpointManager(root, incremental=True)
        mgr.save(1, state(1))
        proxy.add(Rule("status", method="GET", query=r"prefix=[^&]*distckpt-run%2Fleases", times=2, status=503))
        mgr.save(2, state(2, salt=1.0))
        proxy.clear()
        assert references(mgr.path(2)) == {}, "written whole: no deleter was seen to be absent"
        mgr.save(3, state(3, salt=1.0))
        records = run_guard.records_store(store_for(root))
        assert records.lease_ids() == [], "the failed save's record is dropped with the save"  # fails
        distckpt.CheckpointManager(root).delete(1)
        client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
        prefix = root.split("/", 3)[3] + "/step-0000000001/"
        assert client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("KeyCount", 0) == 0


def _save_3_with_a_deleter_started_at_its_commit(mgr, errors: list, marked: threading.Event, go: threading.Event,
                                                 fn, *args) -> None:
    """``mgr.save(3, ...)``; at its commit, ``fn(*args)`` starts in a thread and runs until it has read its mark
    (``marked``) and stalls until ``go``; it goes on once the save has committed."""
    threads: list = []

    def at_commit(kind, what):
        thread = threading.Thread(target=_run, args=(errors, fn, *args))
        threads.append(thread)
        thread.start()
        _wait_for(marked, thread)

    try:
        with inject(Fault("call", kinds=("rename",), callback=at_commit, once=True)):
            mgr.save(3, state(3, salt=1.0))
    finally:
        go.set()
        for thread in threads:
            thread.join(30)


def _wait_for(marked: threading.Event, thread: threading.Thread) -> None:
    """Until the deleter has read its mark (and stalls), or has ended without reading one (it kept everything)."""
    deadline = time.monotonic() + 30
    while not marked.wait(0.05) and thread.is_alive():
        assert time.monotonic() < deadline, "the deleter neither read its mark nor ended"


def _run(errors: list, fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)
