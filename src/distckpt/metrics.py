"""Prometheus metrics and OpenTelemetry spans from distckpt's events (:mod:`distckpt.events`).

    from prometheus_client import start_http_server
    from distckpt.metrics import PrometheusMetrics

    distckpt.observe(PrometheusMetrics())   # into prometheus_client's default registry
    start_http_server(9000)                 # the trainer's own exporter, if it has none yet

Metrics (labels ``operation``: save, async_save, load, retention, compaction; ``phase``: plan, write, read, stage,
total; ``outcome``: ok or the class of the error):

- ``distckpt_phase_seconds`` (histogram): how long each phase took;
- ``distckpt_operations_total`` (counter, by operation and outcome): operations ended;
- ``distckpt_bytes_total`` (counter, by operation): bytes this process wrote or read (an async save's are counted
  under ``save``, the operation its background runs);
- ``distckpt_retries_total`` (counter, by operation): requests a store retried (S3's that botocore retried and
  that then got an answer; gs://, az://: every retry);
- ``distckpt_blocked_seconds`` (gauge, by operation): how long the newest async save blocked its caller;
- ``distckpt_last_step`` (gauge, by operation): the newest step an operation of a CheckpointManager ended well;
- ``distckpt_last_success_timestamp_seconds`` (gauge, by operation): when that was.

Needs ``prometheus_client`` (``pip install 'distckpt[metrics]'``).

:class:`OpenTelemetrySpans` makes a span per phase (``distckpt.save.write``...), timed as the phase ran, with the
event's fields as attributes, through the tracer provider of the application (``opentelemetry-api``,
``pip install 'distckpt[tracing]'``; an SDK and an exporter are the application's choice).
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Optional

from .events import Event
from .extras import import_or_explain

__all__ = ["PrometheusMetrics", "OpenTelemetrySpans"]

# seconds from a small checkpoint's plan to a large one's whole save
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class PrometheusMetrics:
    """A callback for :func:`distckpt.observe` that keeps the metrics above in ``registry`` (default:
    prometheus_client's), with ``namespace`` before each name (default ``distckpt``). Two of them on one registry
    and namespace share its metrics; metrics that cannot all be registered (a name taken) leave none registered."""

    def __init__(self, registry: Optional[Any] = None, namespace: str = "distckpt") -> None:
        prometheus = import_or_explain("prometheus_client", "Prometheus metrics", "metrics", "prometheus_client")
        registry = prometheus.REGISTRY if registry is None else registry
        with _LOCK:
            shared = _REGISTERED.setdefault(registry, {})
            if namespace not in shared:
                shared[namespace] = _register(prometheus, registry, namespace)
            (self.phase_seconds, self.operations, self.bytes, self.retries, self.blocked, self.last_step,
             self.last_success) = shared[namespace]

    def __call__(self, event: Event) -> None:
        outcome = event.error or "ok"
        self.phase_seconds.labels(event.operation, event.phase, outcome).observe(event.seconds)
        if event.phase != "total":  # the phases that move bytes; a "total" counts its phases' bytes again
            if event.bytes:
                self.bytes.labels(event.operation).inc(event.bytes)
            if event.retries:
                self.retries.labels(event.operation).inc(event.retries)
            return
        self.operations.labels(event.operation, outcome).inc()
        if event.blocked_seconds is not None:
            self.blocked.labels(event.operation).set(event.blocked_seconds)
        if event.error is None:
            self.last_success.labels(event.operation).set(time.time())
            if event.step is not None:
                self.last_step.labels(event.operation).set(event.step)


_LOCK = threading.Lock()
_REGISTERED: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()  # registry -> namespace -> metrics


def _register(prometheus: Any, registry: Any, namespace: str) -> tuple:
    """The metrics, made unregistered, then registered together: all of them, or (a name taken) none."""
    made = (
        prometheus.Histogram("phase_seconds", "Seconds each phase of a checkpoint operation took",
                             ["operation", "phase", "outcome"], namespace=namespace, buckets=_BUCKETS, registry=None),
        prometheus.Counter("operations", "Checkpoint operations ended", ["operation", "outcome"], namespace=namespace,
                           registry=None),
        prometheus.Counter("bytes", "Bytes this process wrote or read", ["operation"], namespace=namespace, registry=None),
        prometheus.Counter("retries", "Requests a store retried", ["operation"], namespace=namespace, registry=None),
        prometheus.Gauge("blocked_seconds", "Seconds the newest async save blocked its caller", ["operation"],
                         namespace=namespace, registry=None),
        prometheus.Gauge("last_step", "The newest step an operation ended well", ["operation"], namespace=namespace,
                         registry=None),
        prometheus.Gauge("last_success_timestamp_seconds", "When an operation last ended well", ["operation"],
                         namespace=namespace, registry=None),
    )
    done: list = []
    try:
        for collector in made:
            registry.register(collector)
            done.append(collector)
    except BaseException:
        for collector in done:
            registry.unregister(collector)
        raise
    return made


class OpenTelemetrySpans:
    """A callback for :func:`distckpt.observe` that records each phase as an OpenTelemetry span of ``tracer_provider``
    (default: the global one)."""

    def __init__(self, tracer_provider: Optional[Any] = None) -> None:
        self.trace = import_or_explain("opentelemetry.trace", "OpenTelemetry spans", "tracing", "opentelemetry-api")
        self.tracer = self.trace.get_tracer("distckpt", tracer_provider=tracer_provider)

    def __call__(self, event: Event) -> None:
        start = int(event.started_at * 1e9)
        attributes = {"distckpt.operation": event.operation, "distckpt.phase": event.phase, "distckpt.rank": event.rank,
                      "distckpt.bytes": event.bytes, "distckpt.files": event.files, "distckpt.retries": event.retries}
        for key in ("step", "checkpoint_id", "blocked_seconds", "tier", "error"):
            value = getattr(event, key)
            if value is not None:
                attributes[f"distckpt.{key}"] = value
        span = self.tracer.start_span(f"distckpt.{event.operation}.{event.phase}", start_time=start, attributes=attributes)
        if event.error is not None:
            span.set_status(self.trace.Status(self.trace.StatusCode.ERROR, event.error))
        span.end(end_time=start + int(event.seconds * 1e9))
