"""What planners and storage layers declare they support, so that save and load may take a fast path.

A fast path replaces some of the protocol's calls by cheaper work that has the
same outcome. It is taken only where every class involved declares so; nothing
is inferred from which methods a subclass left alone.

**Storage layers** declare with a class attribute ``capabilities``, a frozenset
of the names below. A subclass inherits them: one that wraps ``write_data`` or
``finish`` (logging, metrics) keeps the fast path, one that changes what a
declared step does sets ``capabilities`` to what still holds.

**Planners' global steps** declare on the method itself, with the decorators
below: the declaration describes one method's behaviour, so a subclass that
overrides that method gets the protocol's path unless its override declares
the same (decorate it to keep the fast path, for example around a wrapper that
only logs and calls ``super()``).
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

__all__ = [
    "COLUMNAR_COMMIT",
    "SHARED_VERIFICATION",
    "SHARED_READS",
    "OVERWRITE",
    "WRITES_WHILE_STAGING",
    "supports",
    "plans_on_columns",
    "keeps_plans",
    "resolves_columns",
    "declares",
    "resolves_in_bulk",
]

F = TypeVar("F", bound=Callable[..., Any])

COLUMNAR_COMMIT = "columnar-commit"
"""A StorageWriter whose ``prepare_global_plan`` gives each rank its storage data without reading the plans'
items (it may be called with empty plans), and whose ``finish`` takes a save planned on columns: the
:class:`~distckpt.planning.columnar.PlannedMetadata` of the plan with each rank's
:class:`~distckpt.item_columns.ResultColumns`; it commits and returns the committed Metadata."""

SHARED_VERIFICATION = "shared-verification"
"""A StorageReader that shares checksum work between the ranks of a load: chunks another rank of the same load
verifies whole, this rank reads only in part without checking their checksums. The load sequence calls its
``partly_read_chunks(plan)`` (every rank), ``assign_verifiers(tables)`` (the coordinator) and
``accept_verifiers(chunks, mask)`` (every rank), the steps of
:class:`distckpt.engine.shared_verification.SharedVerification`, which such a reader inherits."""

SHARED_READS = "shared-reads"
"""A StorageReader that reads each stored chunk several ranks of a load need once, on one of them, which sends it
to the others. Where its ``shares_reads()`` is true, the load sequence calls its ``may_share_reads(plan, held_alone)``
(every rank, for one vote), and where any rank may share, ``read_chunks(plan)`` (every rank),
``assign_readers(tables)`` (the coordinator) and ``accept_readers(chunks, payload, peers)`` (every rank), the steps
of :class:`distckpt.engine.shared_reads.SharedReads`, which such a reader inherits; its ``read_data`` then takes
part in the exchange of every rank (failed or not)."""

OVERWRITE = "overwrite"
"""A StorageWriter with an ``overwrite`` attribute (None: the DISTCKPT_OVERWRITE setting; or a bool) that a
save's ``overwrite=`` argument sets, on a copy of a writer the caller gave."""

WRITES_WHILE_STAGING = "writes-while-staging"
"""A StorageWriter whose ``write_data`` reads the state's tensor bytes only through distckpt's write engine, and
passes its ``staging_fill`` attribute (:class:`distckpt.engine.filling.Filling`, or None) to it: the engine waits
for each staging buffer another process is still filling before it reads it, and for the whole fill before it
reports the write. An async save from a writer process hands such a writer its save before the copy into staging
ends; any other writer gets it once the copy is done. A subclass that reads tensor bytes itself must not keep it."""

_COLUMNAR = "_distckpt_plans_on_columns"
_KEEPS = "_distckpt_keeps_plans"
_RESOLVES = "_distckpt_resolves_columns"
_RESOLVE_STEPS = {"save": ("resolve_data", "lookup_object", "transform_object"),
                  "load": ("resolve_tensor", "lookup_tensor", "transform_tensor", "commit_tensor")}


def supports(storage: Any, capability: str) -> bool:
    """Whether ``storage`` (a writer or reader) declares ``capability``."""
    return capability in getattr(storage, "capabilities", ())


def plans_on_columns(method: F) -> F:
    """Declare that a SavePlanner's ``create_global_plan`` is the default one (dedup of replicas, balance,
    metadata from the plans), so that the coordinator may do the same work on columns with the planner's
    ``create_global_plan_columns``."""
    setattr(method, _COLUMNAR, True)
    return method


def keeps_plans(method: F) -> F:
    """Declare that a global planning step (a LoadPlanner's ``create_global_plan``, a StorageReader's
    ``prepare_global_plan``) returns every rank's plan unchanged, so that plans need not travel."""
    setattr(method, _KEEPS, True)
    return method


def resolves_columns(method: F) -> F:
    """Declare that a SavePlanner's ``resolve_data`` (and the ``lookup_object`` and ``transform_object`` it
    calls) return, for each item of a plan whose items are intact :class:`~distckpt.item_columns.WriteColumns`,
    that item's ``data`` column (a tensor detached, a value's bytes in a BytesIO), so that the writer may read
    the column instead of calling it per item. All three methods must carry the declaration.

    On a LoadPlanner, on ``resolve_tensor``, ``lookup_tensor``, ``transform_tensor`` and ``commit_tensor``:
    for each column item of intact :class:`~distckpt.item_columns.ReadColumns`, ``resolve_tensor`` returns its
    ``dest`` column and ``commit_tensor`` does nothing, so that the reader may fill ``dest`` directly."""
    setattr(method, _RESOLVES, True)
    return method


def declares(obj: Any, method: str, decorator: Callable) -> bool:
    """Whether the ``method`` that ``obj`` would call carries the declaration ``decorator`` makes."""
    mark = {plans_on_columns: _COLUMNAR, keeps_plans: _KEEPS, resolves_columns: _RESOLVES}[decorator]
    return bool(getattr(getattr(type(obj), method, None), mark, False))


def resolves_in_bulk(planner: Any, direction: str = "save") -> bool:
    """Whether ``planner`` declares :func:`resolves_columns` on every step of resolving an item's data
    (``direction``: "save" or "load")."""
    return all(declares(planner, m, resolves_columns) for m in _RESOLVE_STEPS[direction])
