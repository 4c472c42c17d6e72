"""save(): the protocol's save call sequence over the coordinator."""

from __future__ import annotations

import os
import warnings
from dataclasses import replace
from typing import Any, Optional, Union

from . import events
from ._sequence import call_set_up, prepare, storage_by_position
from .capabilities import COLUMNAR_COMMIT, declares, plans_on_columns, supports
from .distributed import Coordinator, Wire
from .errors import CheckpointError
from .format.codec import EncodedMetadata, encode_metadata, lazy_metadata
from .gc_pause import gc_paused
from .item_columns import PlanColumns, ResultColumns
from .metadata import STATE_DICT_TYPE, Metadata
from .planner import SavePlan, SavePlanner
from .planning import DefaultSavePlanner
from .planning.columnar import ColumnarPlan, Declined, PlannedMetadata
from .planning.plan_cache import NO_CACHE_MESSAGE, PlanCache
from .storage import StorageWriter
from .wire.columns import encode_keep, local_plan_columns
from .wire.save_messages import decode_plan, decode_reply, decode_results, encode_plan, encode_reply, encode_results, result_columns

__all__ = ["save", "save_state_dict"]


@storage_by_position("storage_writer")
def save(
    state_dict: STATE_DICT_TYPE,
    *,
    checkpoint_id: Union[str, os.PathLike, None] = None,
    storage_writer: Optional[StorageWriter] = None,
    planner: Optional[SavePlanner] = None,
    process_group: Any = None,
    coordinator_rank: int = 0,
    no_dist: bool = False,
    overwrite: Optional[bool] = None,
) -> Metadata:
    """Save ``state_dict`` as one checkpoint, collectively over the ranks of ``process_group``.

    Every rank calls this with its own state dict: plain tensors (taken as
    replicas across ranks), DTensors (each rank holds its shards), non-tensor
    values, and Stateful objects (saved through ``state_dict()``). The storage
    is chosen from ``checkpoint_id`` when ``storage_writer`` is not given: a
    directory path, ``s3://bucket/prefix``, or ``memory://name``. Returns the checkpoint's metadata on
    every rank. Any failure on any rank raises a CheckpointError on every rank,
    and nothing is committed. ``no_dist=True`` saves this process's state
    alone, without collectives, even where a process group is initialised.
    ``save(state_dict, storage_writer)`` (DCP's older form) works, with a
    FutureWarning.

    A committed checkpoint at the same place is replaced only with
    ``overwrite=True`` (this call's choice, over the storage writer's), or
    where ``DISTCKPT_OVERWRITE=1`` is set; the old checkpoint stays whole
    until the new one commits.
    """
    coord = Coordinator(process_group, coordinator_rank, no_dist=no_dist)
    coord.begin("save", checkpoint_id)
    coord.arrive("save")
    with events.context(checkpoint_id=events.named(checkpoint_id), rank=coord.rank), events.phase("save", "total"):
        ready = prepare("writer", checkpoint_id, storage_writer, planner, DefaultSavePlanner, coord.rank, state_dict,
                        overwrite)
        with gc_paused():
            return run_save(ready.plain, ready.storage, ready.planner, coord, failure=ready.failure)


def save_state_dict(
    state_dict: STATE_DICT_TYPE,
    storage_writer: StorageWriter,
    process_group: Any = None,
    coordinator_rank: int = 0,
    no_dist: bool = False,
    planner: Optional[SavePlanner] = None,
) -> Metadata:
    """DCP's deprecated name and argument order for :func:`save` (kept so code written for it runs unchanged)."""
    warnings.warn("save_state_dict is deprecated; use distckpt.save(state_dict, storage_writer=...)", FutureWarning,
                  stacklevel=2)
    return save(state_dict, storage_writer=storage_writer, process_group=process_group,
                coordinator_rank=coordinator_rank, no_dist=no_dist, planner=planner)


def run_save(state_dict: STATE_DICT_TYPE, writer: Optional[StorageWriter], planner: Optional[SavePlanner],
             coord: Coordinator, failure: Optional[BaseException] = None) -> Metadata:
    """The save sequence: plan locally, plan globally, write, commit.

    ``failure`` is what went wrong on this rank before the sequence (taking
    the state, staging it): the rank reports it in the first collective, so
    every rank raises for this save and the next save starts in step.

    With a planner that has a ``plan_cache`` (``enable_plan_caching``; reuse
    the same planner object across saves), a rank whose local plan is
    unchanged sends only the protocol's ``usable=False`` marker, the
    coordinator reuses its cached global plan and metadata, and replies with
    just the new storage data: a repeated save moves a constant number of
    bytes per rank in planning.

    Where the planner's ``create_global_plan`` declares ``plans_on_columns``
    and the writer declares ``COLUMNAR_COMMIT`` (:mod:`distckpt.capabilities`),
    plans travel as columns (``wire/columns.py``): the coordinator plans
    on arrays, replies with a bit per item, and the writer commits the
    metadata document built straight from the ranks' column write results.
    The outcome is the same as the object path's, which runs for everything
    else.
    """
    return _Save(state_dict, writer, planner, coord, failure).run()


class _Save:
    """One save's steps and what they hand each other (each method is one step of the sequence)."""

    def __init__(self, state_dict: STATE_DICT_TYPE, writer: Optional[StorageWriter], planner: Optional[SavePlanner],
                 coord: Coordinator, failure: Optional[BaseException]) -> None:
        self.state_dict, self.writer, self.planner, self.coord, self.failure = state_dict, writer, planner, coord, failure
        self.cache: Optional[PlanCache] = planner.plan_cache if isinstance(planner, SavePlanner) else None
        self.columnar = declares(planner, "create_global_plan", plans_on_columns) and supports(writer, COLUMNAR_COMMIT)
        self.local_plan: Optional[SavePlan] = None
        self.fast: Optional[ColumnarPlan] = None  # coordinator: set when global planning ran on columns
        self.object_metadata: Optional[Metadata] = None  # coordinator: set when it ran on objects
        self.via_keep = False  # this rank's central plan came as a keep mask over its local plan
        self.written: Optional[SavePlan] = None

    def run(self) -> Metadata:
        try:
            with events.phase("save", "plan"):
                central_plan = self.coord.reduce_scatter("save planning", self.local_step, self.global_step,
                                                         Wire(self.enc_plan, decode_plan), Wire(encode_reply, self.dec_reply))
        except CheckpointError:
            self.discard()  # the coordinator may have taken the save's lease already
            raise
        if isinstance(central_plan, bytes):  # one process: the reply did not travel, nor was it decoded
            central_plan = self.dec_reply(central_plan)
        central_plan = self.cached_central(central_plan)
        try:
            with events.phase("save", "write"):  # the write on every rank, and the commit on the coordinator
                return self.coord.all_reduce("save write", lambda: self.write_step(central_plan), self.finish_step,
                                             Wire(lambda r: encode_results(r, central_plan,
                                                                           self.via_keep and self.written is central_plan),
                                                  decode_results),
                                             Wire(_enc_metadata, lambda b: lazy_metadata(b, "metadata from the coordinator")))
        except CheckpointError:
            # every rank has left write_data by now: the coordinator removes the uncommitted files
            self.discard()
            raise

    # ------------------------------------------------------------ planning

    def local_step(self) -> SavePlan:
        if self.failure is not None:
            raise self.failure
        coord, writer = self.coord, self.writer
        self.planner.set_up_planner(self.state_dict, writer.storage_meta(), coord.is_coordinator)
        call_set_up(writer.set_up_storage_writer, coord.is_coordinator, rank=coord.rank, world_size=coord.world_size)
        plan = self.local_plan = writer.prepare_local_plan(self.planner.create_local_plan())
        if self.cache is not None:
            if self.cache.local == plan:
                return SavePlan([], usable=False)
            self.cache.local, self.cache.central = plan, None
        return plan

    def global_step(self, all_plans: list) -> list:
        if self.columnar and not self.coord.use_dist:  # the plan did not travel: take its columns as a rank's would come
            all_plans = [self.in_columns(p) if isinstance(p, SavePlan) and p.usable else p for p in all_plans]
        if self.columnar and self.cache is not None:
            marks = _unchanged(all_plans)
            if not all(marks):
                self.cache.columnar = None  # the cached columnar plan serves only when no rank changed
            all_plans = self.cache.all_cols = self.cache.resolve(self.cache.all_cols, all_plans, marks)
        replies = self.columnar_step(all_plans) if self.columnar else None
        if replies is not None:
            return replies
        if self.cache is not None:
            self.cache.columnar = None  # the object path re-plans from the resolved plans
        all_plans = [p.to_plan() if isinstance(p, PlanColumns) else p for p in all_plans]
        if self.cache is None:
            all_plans, self.object_metadata = self.planner.create_global_plan(all_plans)
            return self.writer.prepare_global_plan(all_plans)
        return self.cached_object_step(all_plans)

    def columnar_step(self, all_plans: list) -> Optional[list[bytes]]:
        """Global planning on columns: one keep mask per rank, or None to plan on objects."""
        if not all_plans or not all(isinstance(p, PlanColumns) for p in all_plans):
            return None
        try:
            reuse = self.cache.columnar if self.cache is not None else None
            plan = reuse if reuse is not None else self.planner.create_global_plan_columns(all_plans)
        except Declined:
            return None  # the object path decides, and names what is wrong
        self.fast = plan
        if self.cache is not None:
            self.cache.columnar = plan
        storage = self.writer.prepare_global_plan([SavePlan([]) for _ in all_plans])
        return [encode_keep(keep, s.storage_data) for keep, s in zip(plan.keep, storage)]

    def cached_object_step(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        """Global planning on objects with the plan cache: unchanged ranks get only their new storage data."""
        cache = self.cache
        marks = [not p.usable for p in all_plans]
        cache.all_local = cache.resolve(cache.all_local, all_plans, marks)
        if not (all(marks) and cache.global_plans is not None):
            cache.global_plans, cache.metadata = self.planner.create_global_plan(cache.all_local)
        # a fresh shell: the writer's finish fills in storage data and storage meta
        self.object_metadata = replace(cache.metadata, storage_data=None, storage_meta=None)
        final = self.writer.prepare_global_plan(cache.global_plans)
        sent = cache.sent if cache.sent is not None and len(cache.sent) == len(final) else [None] * len(final)
        # "unchanged" only to a rank that sent "unchanged": one whose local plan changed dropped its cached central
        # plan (its items hold the new state dict's tensors), even where its part of the global plan is the same
        replies = [SavePlan([], storage_data=plan.storage_data, usable=False)
                   if marks[i] and sent[i] == replace(plan, storage_data=None) else plan for i, plan in enumerate(final)]
        cache.sent = [replace(p, storage_data=None) for p in final]
        return replies

    def cached_central(self, central_plan: SavePlan) -> SavePlan:
        """The central plan, with the coordinator's "unchanged" reply resolved from this rank's cache."""
        if self.cache is None:
            return central_plan
        if central_plan.usable:
            self.cache.central = replace(central_plan, storage_data=None)
            return central_plan
        if self.cache.central is None:
            raise CheckpointError(f"the coordinator sent a cached plan this rank does not have; {NO_CACHE_MESSAGE}")
        return replace(self.cache.central, storage_data=central_plan.storage_data)

    def in_columns(self, p: SavePlan):
        """A plan of this process as the coordinator would receive it from a rank."""
        local = local_plan_columns(p)
        return local if local is not None else decode_plan(self.enc_plan(p))

    def enc_plan(self, p: SavePlan) -> bytes:
        return encode_plan(p, self.columnar)

    def dec_reply(self, b: bytes) -> SavePlan:
        plan, self.via_keep = decode_reply(b, self.local_plan)
        return plan

    # ------------------------------------------------------------ writing and commit

    def write_step(self, central_plan: SavePlan):
        final_plan = self.planner.finish_plan(central_plan)
        results = self.writer.write_data(final_plan, self.planner).wait()
        self.written = final_plan
        return results

    def finish_step(self, all_results: list) -> Metadata:
        """Commit: the writer returns the committed metadata (one written for the protocol returns None)."""
        metadata = self.object_metadata
        if self.fast is not None:
            all_results = [result_columns(r) for r in all_results]
            if all(isinstance(r, ResultColumns) for r in all_results):
                metadata = PlannedMetadata(self.fast)
            else:
                all_results = [_as_results(self.fast, rank, r) for rank, r in enumerate(all_results)]
                metadata = self.planner.metadata
        committed = self.writer.finish(metadata=metadata, results=all_results)
        return metadata if committed is None else committed

    def discard(self) -> None:
        discard = self.writer.discard_incomplete if isinstance(self.writer, StorageWriter) else None
        if self.coord.is_coordinator and discard is not None:
            discard()


def _unchanged(plans: list) -> list[bool]:
    return [isinstance(p, SavePlan) and not p.usable for p in plans]


def _enc_metadata(m: Metadata) -> bytes:
    if isinstance(m, EncodedMetadata) and m.document is not None:
        return m.document
    return encode_metadata(m)


def _as_results(plan: ColumnarPlan, rank: int, results):
    """A rank's write results as objects (when another rank sent them in the general form)."""
    if not isinstance(results, ResultColumns):
        return results
    items = [it for it, k in zip(plan.all_cols[rank].to_plan().items, plan.keep[rank].tolist()) if k]
    return results.to_results(items)
