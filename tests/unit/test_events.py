"""distckpt.observe: one event per phase of every save, load, async save, retention and compaction, and the
Prometheus metrics built on them (distckpt/events.py, distckpt/metrics.py)."""

from __future__ import annotations

import pytest
import torch

import distckpt
from distckpt import events
from distckpt.testing import run_ranks


def state(salt: float = 0.0) -> dict:
    return {"w": torch.arange(4096, dtype=torch.float32) + salt, "b": torch.ones(64) * salt, "step": 3}


@pytest.fixture
def seen():
    got: list = []
    with distckpt.observe(got.append):
        yield got


def phases(got: list, operation: str) -> dict:
    return {e.phase: e for e in got if e.operation == operation}


def test_a_save_and_a_load_each_report_their_phases_bytes_and_checkpoint(tmp_path, seen):
    path = str(tmp_path / "ck")
    distckpt.save(state(), checkpoint_id=path, no_dist=True)
    out = {"w": torch.zeros(4096), "b": torch.zeros(64), "step": 0}
    distckpt.load(out, checkpoint_id=path, no_dist=True)
    save, load = phases(seen, "save"), phases(seen, "load")
    assert list(save) == ["plan", "write", "total"] and list(load) == ["plan", "read", "total"]
    stored = (4096 + 64) * 4
    assert stored <= save["write"].bytes == save["total"].bytes < stored + 4096, save
    assert stored <= load["read"].bytes == load["total"].bytes < stored + 4096, load
    for event in [*save.values(), *load.values()]:
        assert event.checkpoint_id == path and event.rank == 0 and event.error is None and event.step is None
        assert 0 <= event.seconds
    assert save["total"].seconds >= save["write"].seconds


def test_a_failed_save_reports_its_error_class(tmp_path, seen):
    path = str(tmp_path / "ck")
    distckpt.save(state(), checkpoint_id=path, no_dist=True)
    seen.clear()
    with pytest.raises(distckpt.CheckpointError):
        distckpt.save(state(1.0), checkpoint_id=path, no_dist=True)  # committed already, and no overwrite
    assert phases(seen, "save")["total"].error == "CheckpointError"


def test_a_callback_that_raises_never_fails_the_save(tmp_path, caplog):
    def broken(event):
        raise RuntimeError("the monitoring system is down")

    with distckpt.observe(broken):
        distckpt.save(state(), checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert "an event callback raised" in caplog.text
    assert distckpt.verify(str(tmp_path / "ck")).ok


def test_nothing_is_timed_once_the_last_callback_is_gone(tmp_path):
    got: list = []
    observation = distckpt.observe(got.append)
    observation.close()
    assert not events.observing()
    distckpt.save(state(), checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert got == []
    with pytest.raises(TypeError):
        distckpt.observe("not a callable")


def test_a_manager_names_the_step_of_saves_loads_async_saves_retention_and_compaction(tmp_path, seen):
    mgr = distckpt.CheckpointManager(str(tmp_path / "run"), keep_last=2, incremental=True, no_dist=True)
    mgr.save(1, state())
    mgr.save(2, state())  # references step 1's unchanged chunks
    handle = mgr.async_save(3, state(1.0))
    handle.result(timeout=120)
    mgr.load({"w": torch.zeros(4096), "b": torch.zeros(64), "step": 0}, step=3)
    mgr.compact(2)
    steps = {(e.operation, e.phase): e.step for e in seen}
    assert steps[("load", "total")] == 3 and steps[("compaction", "total")] == 2
    saves = [e for e in seen if e.operation == "save" and e.phase == "write"]
    assert [e.step for e in saves] == [1, 2, 3]  # the async save's background too
    async_phases = phases(seen, "async_save")
    assert set(async_phases) == {"stage", "total"} and async_phases["total"].step == 3
    assert async_phases["stage"].bytes == 0  # the background's writes count in its own phases, not the staging's
    total = async_phases["total"]
    assert total.blocked_seconds is not None and 0 <= total.blocked_seconds <= total.seconds
    retention = phases(seen, "retention")["total"]
    assert retention.files == 1 and retention.step == 3  # step 1 went after step 3's commit
    compaction = phases(seen, "compaction")
    assert compaction["copy"].bytes > 0 and compaction["copy"].files >= 1, compaction


def test_retries_of_any_thread_count_in_the_phases_open_meanwhile(tmp_path, seen):
    import threading

    with events.phase("save", "write"):
        worker = threading.Thread(target=events.add_retry)
        worker.start()
        worker.join()
        events.add_retry()
    assert phases(seen, "save")["write"].retries == 2


def test_prometheus_metrics_count_operations_bytes_and_the_last_step(tmp_path):
    prometheus = pytest.importorskip("prometheus_client")
    from distckpt.metrics import PrometheusMetrics

    registry = prometheus.CollectorRegistry()
    with distckpt.observe(PrometheusMetrics(registry)):
        mgr = distckpt.CheckpointManager(str(tmp_path / "run"), no_dist=True)
        mgr.save(7, state())
        mgr.load({"w": torch.zeros(4096), "b": torch.zeros(64), "step": 0})
        with pytest.raises(distckpt.CheckpointError):
            distckpt.save(state(), checkpoint_id=mgr.path(7), no_dist=True)

    def value(name, **labels):
        return registry.get_sample_value(name, labels)

    assert value("distckpt_operations_total", operation="save", outcome="ok") == 1
    assert value("distckpt_operations_total", operation="save", outcome="CheckpointError") == 1
    assert value("distckpt_operations_total", operation="load", outcome="ok") == 1
    assert value("distckpt_bytes_total", operation="save") >= (4096 + 64) * 4
    assert value("distckpt_bytes_total", operation="load") >= (4096 + 64) * 4
    assert value("distckpt_last_step", operation="save") == 7 and value("distckpt_last_step", operation="load") == 7
    assert value("distckpt_phase_seconds_count", operation="save", phase="write", outcome="ok") == 1
    text = prometheus.generate_latest(registry).decode()
    assert 'distckpt_phase_seconds_bucket{le="0.005",operation="save",outcome="ok",phase="plan"}' in text


def _two_ranks_observed(rank: int, world_size: int, root: str) -> list:
    got: list = []
    with distckpt.observe(got.append):
        distckpt.save({f"w{rank}": torch.full((256,), float(rank))}, checkpoint_id=f"{root}/ck")  # a key of its own
    return sorted((e.operation, e.phase, e.rank, e.bytes > 0) for e in got)


def test_each_rank_reports_its_own_phases(tmp_path):
    out = run_ranks(_two_ranks_observed, 2, str(tmp_path))
    for rank, got in enumerate(out):
        assert got == sorted([("save", p, rank, p != "plan") for p in ("plan", "write", "total")]), (rank, got)


def test_opentelemetry_spans_one_per_phase_timed_as_it_ran(tmp_path):
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from distckpt.metrics import OpenTelemetrySpans

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    path = str(tmp_path / "ck")
    with distckpt.observe(OpenTelemetrySpans(provider)):
        distckpt.save(state(), checkpoint_id=path, no_dist=True)
        with pytest.raises(distckpt.CheckpointError):
            distckpt.save(state(), checkpoint_id=path, no_dist=True)
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans[:3]] == ["distckpt.save.plan", "distckpt.save.write", "distckpt.save.total"]
    plan, write, total = spans[:3]
    assert total.start_time <= plan.start_time <= plan.end_time <= write.start_time <= write.end_time <= total.end_time
    assert write.attributes["distckpt.bytes"] >= (4096 + 64) * 4 and write.attributes["distckpt.checkpoint_id"] == path
    failed = spans[-1]
    assert failed.name == "distckpt.save.total" and not failed.status.is_ok
    assert failed.attributes["distckpt.error"] == "CheckpointError"
