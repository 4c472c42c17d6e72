"""save(): the protocol's save call sequence over the coordinator."""

from __future__ import annotations

import os
import warnings
from dataclasses import replace
from typing import Any, Optional, Union

from ._sequence import call_set_up, prepare, storage_by_position
from .backends.blob_storage import FILE_RESULT_PREFIX, BlobStorageWriter
from .distributed import Coordinator
from .errors import CheckpointError
from .format.codec import (
    decode_save_plan,
    decode_write_results,
    dumps,
    encode_metadata,
    encode_save_plan,
    encode_write_results,
    lazy_metadata,
    loads,
)
from .format.frames import frame_kind
from .gc_pause import gc_paused
from .metadata import STATE_DICT_TYPE, Metadata
from .planner import SavePlan, SavePlanner
from .planning import DefaultSavePlanner
from .planning.columnar import ColumnarPlan, Declined, metadata_document, plan_columns, to_metadata
from .planning.columns import (
    KEEP_MAGIC,
    PLAN_MAGIC,
    RESULTS_MAGIC,
    PlanColumns,
    ResultColumns,
    decode_keep,
    encode_keep,
    encode_plan_columns,
    encode_result_columns,
)
from .storage import StorageWriter

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
    """
    coord = Coordinator(process_group, coordinator_rank, no_dist=no_dist)
    coord.begin("save", checkpoint_id)
    ready = prepare("writer", checkpoint_id, storage_writer, planner, DefaultSavePlanner, coord.rank, state_dict)
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


def _plan_cache(planner: SavePlanner) -> Optional[dict]:
    if not getattr(planner, "enable_plan_caching", False):
        return None
    cache = getattr(planner, "_plan_cache", None)
    if cache is None:
        cache = {}
        planner._plan_cache = cache
    return cache


def _columnar_eligible(planner: SavePlanner, writer: StorageWriter) -> bool:
    """Whether this save may plan on columns: the default planner's global step and distckpt's writer, unmodified."""
    return (isinstance(planner, DefaultSavePlanner) and planner.dedup_replicated_tensors
            and type(planner).create_global_plan is DefaultSavePlanner.create_global_plan
            and isinstance(writer, BlobStorageWriter)
            and all(getattr(type(writer), m) is getattr(BlobStorageWriter, m) for m in ("prepare_global_plan", "write_data", "finish")))


def run_save(state_dict: STATE_DICT_TYPE, writer: Optional[StorageWriter], planner: Optional[SavePlanner],
             coord: Coordinator, failure: Optional[BaseException] = None) -> Metadata:
    """The save sequence: plan locally, plan globally, write, commit.

    ``failure`` is what went wrong on this rank before the sequence (taking
    the state, staging it): the rank reports it in the first collective, so
    every rank raises for this save and the next save starts in step.

    With a planner whose ``enable_plan_caching`` is set (reuse the same planner
    object across saves), a rank whose local plan is unchanged sends only the
    protocol's ``usable=False`` marker, the coordinator reuses its cached
    global plan and metadata, and replies with just the new storage data: a
    repeated save moves a constant number of bytes per rank in planning.

    With the default planner and distckpt's own writer, plans travel as
    columns (``planning/columns.py``): the coordinator plans on arrays,
    replies with a bit per item, and writes the metadata document straight
    from the ranks' column write results. The outcome is the same as the
    object path's, which runs for everything else.
    """
    global_metadata: list[Metadata] = []
    cache = _plan_cache(planner)
    columnar = coord.use_dist and _columnar_eligible(planner, writer)
    local_plan: list[SavePlan] = []
    fast: list[ColumnarPlan] = []  # coordinator: set when global planning ran on columns

    def local_step() -> SavePlan:
        if failure is not None:
            raise failure
        planner.set_up_planner(state_dict, writer.storage_meta(), coord.is_coordinator)
        call_set_up(writer.set_up_storage_writer, coord.is_coordinator, rank=coord.rank, world_size=coord.world_size)
        plan = writer.prepare_local_plan(planner.create_local_plan())
        local_plan.append(plan)
        if cache is not None:
            if cache.get("local") == plan:
                return SavePlan([], usable=False)
            cache["local"] = plan
            cache.pop("central", None)
        return plan

    def columnar_step(all_cols: list[PlanColumns], reuse: Optional[ColumnarPlan] = None) -> Optional[list[bytes]]:
        try:
            plan = reuse if reuse is not None else plan_columns(all_cols, planner.dedup_replicated_tensors)
        except Declined:
            return None  # the object path decides, and names what is wrong
        fast.append(plan)
        if cache is not None:
            cache["columnar"] = plan
        storage = writer.prepare_global_plan([SavePlan([]) for _ in all_cols])
        return [encode_keep(keep, s.storage_data) for keep, s in zip(plan.keep, storage)]

    def cached_columns(all_plans: list) -> list:
        """Plans with each rank's "unchanged" marker replaced by what it sent last time (columns or objects)."""
        previous = cache.get("all_cols")
        marked = [isinstance(p, SavePlan) and not p.usable for p in all_plans]
        if not any(marked):
            cache.pop("columnar", None)
            return all_plans
        if previous is None or len(previous) != len(all_plans):
            raise CheckpointError("a rank sent a cached save plan but the coordinator has no cache; "
                                  "pass the same planner object to every save, on every rank")
        if not all(marked):
            cache.pop("columnar", None)
        return [previous[i] if m else p for i, (p, m) in enumerate(zip(all_plans, marked))]

    def global_step(all_plans: list) -> list:
        if columnar and cache is not None:
            all_plans = cache["all_cols"] = cached_columns(all_plans)
            if all(isinstance(p, PlanColumns) for p in all_plans):
                replies = columnar_step(all_plans, cache.get("columnar"))
                if replies is not None:
                    return replies
            cache.pop("columnar", None)  # the object path below re-plans from the resolved plans
        elif all_plans and all(isinstance(p, PlanColumns) for p in all_plans):
            replies = columnar_step(all_plans)
            if replies is not None:
                return replies
        all_plans = [p.to_plan() if isinstance(p, PlanColumns) else p for p in all_plans]
        if cache is None:
            all_plans, metadata = planner.create_global_plan(all_plans)
            global_metadata.append(metadata)
            return writer.prepare_global_plan(all_plans)
        previous = cache.get("all_local")
        if any(not p.usable for p in all_plans) and (previous is None or len(previous) != len(all_plans)):
            raise CheckpointError("a rank sent a cached save plan but the coordinator has no cache; "
                                  "pass the same planner object to every save, on every rank")
        unchanged = all(not p.usable for p in all_plans)
        all_local = [previous[i] if not p.usable else p for i, p in enumerate(all_plans)]
        cache["all_local"] = all_local
        if not (unchanged and "global" in cache):
            plans, metadata = planner.create_global_plan(all_local)
            cache["global"], cache["metadata"] = plans, metadata
        metadata = cache["metadata"]
        # a fresh shell: the writer's finish fills in storage data and storage meta
        global_metadata.append(replace(metadata, storage_data=None, storage_meta=None))
        final = writer.prepare_global_plan(cache["global"])
        sent = cache.get("sent")
        replies = []
        for i, plan in enumerate(final):
            if sent is not None and len(sent) == len(final) and sent[i] == replace(plan, storage_data=None):
                replies.append(SavePlan([], storage_data=plan.storage_data, usable=False))
            else:
                replies.append(plan)
        cache["sent"] = [replace(p, storage_data=None) for p in final]
        return replies

    def enc_plan(p: SavePlan) -> bytes:
        raw = encode_plan_columns(p) if columnar and p.usable else None
        return raw if raw is not None else dumps(encode_save_plan(p))

    def dec_plan(b: bytes):
        if frame_kind(b) == PLAN_MAGIC:
            return PlanColumns.decode(b)
        return decode_save_plan(loads(b, "save plan"))

    via_keep: list[bool] = []

    def enc_reply(p) -> bytes:
        return p if isinstance(p, bytes) else dumps(encode_save_plan(p))

    def dec_reply(b: bytes) -> SavePlan:
        if frame_kind(b) == KEEP_MAGIC:
            via_keep.append(True)
            return decode_keep(b, local_plan[-1])
        return decode_save_plan(loads(b, "save plan"))

    try:
        central_plan = coord.reduce_scatter("save planning", local_step, global_step, enc_plan, dec_plan, enc_reply, dec_reply)
    except CheckpointError:
        _discard(writer, coord)  # the coordinator may have taken the save's lease already
        raise
    if cache is not None:
        if central_plan.usable:
            cache["central"] = replace(central_plan, storage_data=None)
        elif "central" in cache:
            central_plan = replace(cache["central"], storage_data=central_plan.storage_data)
        else:
            raise CheckpointError("the coordinator sent a cached plan this rank does not have; "
                                  "pass the same planner object to every save, on every rank")
    written: list[SavePlan] = []

    def write_step():
        final_plan = planner.finish_plan(central_plan)
        results = writer.write_data(final_plan, planner).wait()
        written.append(final_plan)
        return results

    def enc_results(results) -> bytes:
        if via_keep and written and written[0] is central_plan:
            raw = encode_result_columns(results, central_plan, FILE_RESULT_PREFIX)
            if raw is not None:
                return raw
        return dumps(encode_write_results(results))

    def dec_results(b: bytes):
        if frame_kind(b) == RESULTS_MAGIC:
            return ResultColumns.decode(b)
        return decode_write_results(loads(b, "write results"))

    def finish_step(all_results):
        if fast:
            plan = fast[0]
            if all(isinstance(r, ResultColumns) for r in all_results):
                doc = metadata_document(plan, all_results, writer.save_id, writer._checkpoint_id())
                writer.commit_document(doc)
                return doc
            all_results = [_as_results(plan, rank, r) for rank, r in enumerate(all_results)]
            global_metadata.append(to_metadata(plan))
        metadata = global_metadata[0]
        writer.finish(metadata=metadata, results=all_results)
        return metadata

    try:
        metadata = coord.all_reduce(
            "save write",
            write_step,
            finish_step,
            enc_results,
            dec_results,
            lambda m: m if isinstance(m, bytes) else encode_metadata(m),
            lambda b: lazy_metadata(b, "metadata from the coordinator"),
        )
    except CheckpointError:
        # every rank has left write_data by now: the coordinator removes the uncommitted files
        _discard(writer, coord)
        raise
    if fast:
        planner.metadata = metadata
    return metadata


def _discard(writer: StorageWriter, coord: Coordinator) -> None:
    discard = getattr(writer, "discard_incomplete", None) if writer is not None else None
    if coord.is_coordinator and discard is not None:
        discard()


def _as_results(plan: ColumnarPlan, rank: int, results):
    """A rank's write results as objects (when another rank sent them in the general form)."""
    if not isinstance(results, ResultColumns):
        return results
    items = [it for it, k in zip(plan.all_cols[rank].to_plan().items, plan.keep[rank].tolist()) if k]
    return results.to_results(items, FILE_RESULT_PREFIX)
