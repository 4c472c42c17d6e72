"""Hostile review of the events surface (b28b09b..1a627d1): distckpt.observe, the Prometheus and OpenTelemetry
callbacks, and `distckpt steps --watch`. Each test fails on the code it was written against, for the reason in its
docstring."""

from __future__ import annotations

import os
import threading
import uuid

import pytest
import torch
from click.testing import CliRunner

import distckpt
from distckpt.cli import main
from distckpt.testing import run_ranks


def _state(n: int = 4096, salt: float = 0.0) -> dict:
    return {"w": torch.arange(n, dtype=torch.float32) + salt}


# ---------------------------------------------------------------- async saves


def test_a_cancelled_async_save_that_then_fails_is_not_reported_as_a_success(tmp_path):
    """handle.cancel() on a queued save: it succeeded (the handle was a plain pending Future) and events.when_done's
    callback took a cancelled future for a success, though the save still ran in the background and failed, its
    failure lost. Now a save the ranks agreed to refuses cancel(), and its failure is on the handle and the event."""
    got: list = []
    gate = threading.Event()
    (tmp_path / "blocker").write_text("a file where the checkpoint's parent directory should be")
    with distckpt.observe(got.append):
        first = distckpt.async_save(_state(), checkpoint_id=str(tmp_path / "first"), no_dist=True, max_in_flight=2,
                                    on_commit=lambda md: gate.wait(60))
        second = distckpt.async_save(_state(), checkpoint_id=str(tmp_path / "blocker" / "ck"), no_dist=True,
                                     max_in_flight=2)
        try:
            cancelled = second.cancel()
        finally:
            gate.set()
        first.result(timeout=120)
        distckpt.async_save(_state(), checkpoint_id=str(tmp_path / "third"), no_dist=True).result(timeout=120)
    assert not cancelled  # a save the ranks agreed to is not cancelled: its outcome reaches the handle
    with pytest.raises(distckpt.CheckpointError):
        second.result(timeout=60)
    saves = [e for e in got if e.checkpoint_id == str(tmp_path / "blocker" / "ck")]
    assert any(e.error for e in saves if e.operation == "save"), saves  # it did run, and failed
    total = next(e for e in saves if (e.operation, e.phase) == ("async_save", "total"))
    assert total.error is not None, f"a cancelled save that never committed was reported as a success: {total}"


def test_an_async_save_that_fails_while_staging_counts_as_a_failed_operation(tmp_path):
    """An async save refused while staging emits only its "stage" event (the "total" is registered by when_done only
    after staging succeeded, async_saving.py:330-334), so distckpt_operations_total{operation="async_save",
    outcome!="ok"} (the alert docs/operating.md recommends) never sees it."""
    prometheus = pytest.importorskip("prometheus_client")
    from distckpt.metrics import PrometheusMetrics

    registry = prometheus.CollectorRegistry()
    with distckpt.observe(PrometheusMetrics(registry)):
        with pytest.raises(distckpt.CheckpointError):
            distckpt.async_save(_state(), checkpoint_id=f"hf://{tmp_path}/out", no_dist=True)  # refused: no config
    failed = registry.get_sample_value("distckpt_operations_total",
                                       {"operation": "async_save", "outcome": "CheckpointError"})
    assert failed == 1, "a failed async save is not counted among the operations that ended with an error"


def test_a_writer_process_async_save_reports_its_bytes(tmp_path):
    """async_checkpointer_type="process" runs the plan and write in the writer process, whose events go nowhere:
    the trainer sees only async_save stage/total with bytes=0, and distckpt_bytes_total{operation="save"} stays 0
    (docs/operating.md: "an async save's bytes count under save"; async_saving.py _hand_to_writer)."""
    got: list = []
    n = 1 << 16
    with distckpt.observe(got.append):
        handle = distckpt.async_save(_state(n), checkpoint_id=str(tmp_path / "p"), no_dist=True,
                                     async_checkpointer_type="process")
        handle.result(timeout=120)
    moved = sum(e.bytes for e in got if e.phase != "total")
    assert moved >= n * 4, [(e.operation, e.phase, e.bytes) for e in got]


# ---------------------------------------------------------------- retries, bytes, attribution


def test_a_retry_is_counted_once_in_prometheus_while_the_next_async_save_waits(tmp_path):
    """Retries are one process-wide counter read as a difference by every open phase (events.py add_retry / phase):
    the next async save's "stage" (waiting for room) overlaps the previous save's requests, so two S3 retries show
    as distckpt_retries_total 2 under save plus 2 under async_save."""
    prometheus = pytest.importorskip("prometheus_client")
    pytest.importorskip("moto")
    import boto3

    from distckpt.metrics import PrometheusMetrics
    from distckpt.testing.fault_proxy import FaultProxy, Rule
    from tests.storage.s3_server import new_bucket, s3_server

    registry = prometheus.CollectorRegistry()
    with s3_server() as endpoint:
        bucket = new_bucket(boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1"))
        with FaultProxy(endpoint, timeout_s=30) as proxy:
            saved = os.environ["AWS_ENDPOINT_URL_S3"]
            os.environ["AWS_ENDPOINT_URL_S3"] = proxy.url
            try:
                rule = proxy.add(Rule("status", status=503, method="PUT", times=2))
                with distckpt.observe(PrometheusMetrics(registry)):
                    first = distckpt.async_save(_state(1 << 16), no_dist=True,
                                                checkpoint_id=f"s3://{bucket}/{uuid.uuid4().hex[:8]}/a")
                    second = distckpt.async_save(_state(1 << 16), no_dist=True,
                                                 checkpoint_id=f"s3://{bucket}/{uuid.uuid4().hex[:8]}/b")
                    first.result(timeout=120)
                    second.result(timeout=120)
            finally:
                os.environ["AWS_ENDPOINT_URL_S3"] = saved
    assert rule.fired == 2
    counted = sum(registry.get_sample_value("distckpt_retries_total", {"operation": op}) or 0
                  for op in ("save", "async_save", "load"))
    assert counted == 2, f"2 retried requests counted as {counted}"


def test_a_callback_that_saves_does_not_add_its_bytes_to_the_save_it_watches(tmp_path):
    """Callbacks run while the enclosing phases are still in _OPEN (only the ending phase is popped, events.py:150),
    so a save made from a callback adds its bytes to the outer save's "total" (and its span)."""
    got: list = []
    once = []

    def callback(event):
        got.append(event)
        if (event.operation, event.phase) == ("save", "write") and not once:
            once.append(1)
            distckpt.save({"big": torch.ones(1 << 18)}, checkpoint_id=str(tmp_path / "inner"), no_dist=True)

    with distckpt.observe(callback):
        distckpt.save({"w": torch.ones(16)}, checkpoint_id=str(tmp_path / "outer"), no_dist=True)
    outer = {e.phase: e for e in got if e.checkpoint_id == str(tmp_path / "outer")}
    assert outer["total"].bytes == outer["write"].bytes, \
        f"the outer save's total counts the inner save's bytes: {outer['total'].bytes} vs {outer['write'].bytes}"


# ---------------------------------------------------------------- OpenTelemetry / Prometheus


def _restore_parts(rank, world_size, root):
    os.environ["DISTCKPT_NODE_ID"] = "node0"
    got: list = []
    with distckpt.observe(got.append):
        mgr = distckpt.TieredCheckpointManager(os.path.join(root, "durable"), local=os.path.join(root, "node0"),
                                               replicas=0, persist_every=0)
        mgr.save(1, _state(1 << 18))
        mgr.wait()
        mgr.persist(1)
        mgr.restore({"w": torch.zeros(1 << 18)})
        mgr.close()
    return [(e.phase, e.started_at, e.seconds) for e in got if e.operation == "restore" and e.phase != "total"]


def test_the_parts_of_a_restore_are_timed_as_they_ran(tmp_path):
    """events.report stamps each restore part started_at = now - seconds at the end of the restore
    (events.py:181), so every part's span ends at the same instant and they overlap (verify seems to start
    before agree); OpenTelemetrySpans promises spans "timed as the phase ran"."""
    [parts] = run_ranks(_restore_parts, 1, str(tmp_path))
    assert len(parts) >= 3, parts
    ordered = sorted(parts, key=lambda p: p[1])
    for (a, start_a, sec_a), (b, start_b, _) in zip(ordered, ordered[1:]):
        assert start_b >= start_a + sec_a - 1e-3, f"restore parts {a} and {b} overlap: {ordered}"


def test_prometheus_metrics_that_fail_to_register_leave_nothing_registered():
    """PrometheusMetrics registers its collectors one by one (metrics.py:50-63): one that collides raises after the
    earlier ones were registered, so even once the clash is removed, a second try fails on the leftovers."""
    prometheus = pytest.importorskip("prometheus_client")
    from distckpt.metrics import PrometheusMetrics

    registry = prometheus.CollectorRegistry()
    clash = prometheus.Counter("distckpt_bytes", "the application's own", registry=registry)
    with pytest.raises(ValueError):
        PrometheusMetrics(registry)
    registry.unregister(clash)
    PrometheusMetrics(registry)  # raises "Duplicated timeseries ... distckpt_phase_seconds" on the current code


# ---------------------------------------------------------------- distckpt steps --watch


def _watch(*args):
    return CliRunner().invoke(main, ["steps", *args, "--watch"])


def _run(root):
    mgr = distckpt.CheckpointManager(str(root), no_dist=True)
    mgr.save(1, _state(16))
    mgr.save(2, _state(16, 1.0))
    return mgr


def test_watch_a_root_that_is_a_file_says_error_instead_of_a_traceback(tmp_path):
    """The watch catches only CheckpointError (cli.py:375): a root that is (or becomes, mid-watch) a file raises a
    raw NotADirectoryError out of the listing and kills the watch, though it promises "a store that fails one
    listing is said, and the next is tried"."""
    root = tmp_path / "afile"
    root.write_text("not a run")
    result = _watch(str(root), "--count", "1")
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "error" in result.output


def test_watch_refuses_a_nan_interval(tmp_path):
    """--interval is FloatRange(min=0.1) (cli.py:319): nan passes the bound (nan < 0.1 is False) and time.sleep(nan)
    raises ValueError after the first listing (inf and 1e300 raise OverflowError the same way)."""
    result = _watch(str(tmp_path), "--interval", "nan", "--count", "2")
    assert result.exit_code == 2 and not isinstance(result.exception, ValueError), repr(result.exception)


def test_watch_of_a_checkpoint_exits_3_as_steps_does(tmp_path):
    """`steps` given a step exits 3 naming the run; `steps --watch` (which skips that check, cli.py:332) lists
    "no committed steps yet" for ever, watching the wrong path."""
    mgr = _run(tmp_path / "run")
    result = _watch(mgr.path(1), "--count", "1")
    assert result.exit_code == 3, result.output


def test_watch_of_a_missing_root_says_so(tmp_path):
    """`steps` on a missing root exits NOT_FOUND; `steps --watch` (a typo in the root) says "no committed steps
    yet" and exits 0, for ever."""
    result = _watch(str(tmp_path / "no-such-run"), "--count", "1")
    assert result.exit_code != 0 or "error" in result.output, result.output


def test_watch_with_a_count_exits_1_when_a_step_is_damaged(tmp_path):
    """`steps` exits 1 when a step is damaged (its docstring); `steps --watch --count N` always returns 0
    (cli.py:389-390), so a script polling with --count 1 cannot tell."""
    mgr = _run(tmp_path / "run")
    with open(os.path.join(mgr.path(2), "metadata.json"), "w") as f:
        f.write("{garbage")
    result = _watch(str(tmp_path / "run"), "--count", "1", "--json")
    assert "damaged" in result.output
    assert result.exit_code == 1, result.output
