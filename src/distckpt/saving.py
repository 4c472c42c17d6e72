"""save(): the protocol's save call sequence over the coordinator."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Optional, Union

from ._sequence import call_set_up, gc_paused, pick_storage, split_stateful, tell_rank
from .distributed import Coordinator
from .errors import CheckpointError
from .format.codec import decode_save_plan, decode_write_results, dumps, encode_metadata, encode_save_plan, encode_write_results, loads, parse_metadata
from .metadata import STATE_DICT_TYPE, Metadata
from .planner import SavePlan, SavePlanner
from .planning import DefaultSavePlanner
from .storage import StorageWriter

__all__ = ["save"]


def save(
    state_dict: STATE_DICT_TYPE,
    *,
    checkpoint_id: Union[str, os.PathLike, None] = None,
    storage_writer: Optional[StorageWriter] = None,
    planner: Optional[SavePlanner] = None,
    process_group: Any = None,
    coordinator_rank: int = 0,
) -> Metadata:
    """Save ``state_dict`` as one checkpoint, collectively over the ranks of ``process_group``.

    Every rank calls this with its own state dict: plain tensors (taken as
    replicas across ranks), DTensors (each rank holds its shards), non-tensor
    values, and Stateful objects (saved through ``state_dict()``). The storage
    is chosen from ``checkpoint_id`` when ``storage_writer`` is not given: a
    directory path, or ``memory://name``. Returns the checkpoint's metadata on
    every rank. Any failure on any rank raises a CheckpointError on every rank,
    and nothing is committed.
    """
    coord = Coordinator(process_group, coordinator_rank)
    storage_writer = pick_storage("writer", checkpoint_id, storage_writer)
    planner = planner if planner is not None else DefaultSavePlanner()
    tell_rank(planner, coord.rank)
    plain, _ = split_stateful(state_dict)
    with gc_paused():
        return run_save(plain, storage_writer, planner, coord)


def _plan_cache(planner: SavePlanner) -> Optional[dict]:
    if not getattr(planner, "enable_plan_caching", False):
        return None
    cache = getattr(planner, "_plan_cache", None)
    if cache is None:
        cache = {}
        planner._plan_cache = cache
    return cache


def run_save(state_dict: STATE_DICT_TYPE, writer: StorageWriter, planner: SavePlanner, coord: Coordinator) -> Metadata:
    """The save sequence: plan locally, plan globally, write, commit.

    With a planner whose ``enable_plan_caching`` is set (reuse the same planner
    object across saves), a rank whose local plan is unchanged sends only the
    protocol's ``usable=False`` marker, the coordinator reuses its cached
    global plan and metadata, and replies with just the new storage data: a
    repeated save moves a constant number of bytes per rank in planning.
    """
    global_metadata: list[Metadata] = []
    cache = _plan_cache(planner)

    def local_step() -> SavePlan:
        planner.set_up_planner(state_dict, writer.storage_meta(), coord.is_coordinator)
        call_set_up(writer.set_up_storage_writer, coord.is_coordinator, rank=coord.rank, world_size=coord.world_size)
        plan = writer.prepare_local_plan(planner.create_local_plan())
        if cache is not None:
            if cache.get("local") == plan:
                return SavePlan([], usable=False)
            cache["local"] = plan
            cache.pop("central", None)
        return plan

    def global_step(all_plans: list[SavePlan]) -> list[SavePlan]:
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

    enc_plan = lambda p: dumps(encode_save_plan(p))
    dec_plan = lambda b: decode_save_plan(loads(b, "save plan"))
    central_plan = coord.reduce_scatter("save planning", local_step, global_step, enc_plan, dec_plan, enc_plan, dec_plan)
    if cache is not None:
        if central_plan.usable:
            cache["central"] = replace(central_plan, storage_data=None)
        elif "central" in cache:
            central_plan = replace(cache["central"], storage_data=central_plan.storage_data)
        else:
            raise CheckpointError("the coordinator sent a cached plan this rank does not have; "
                                  "pass the same planner object to every save, on every rank")

    def write_step():
        final_plan = planner.finish_plan(central_plan)
        return writer.write_data(final_plan, planner).wait()

    def finish_step(all_results) -> Metadata:
        metadata = global_metadata[0]
        writer.finish(metadata=metadata, results=all_results)
        return metadata

    try:
        return coord.all_reduce(
            "save write",
            write_step,
            finish_step,
            lambda r: dumps(encode_write_results(r)),
            lambda b: decode_write_results(loads(b, "write results")),
            encode_metadata,
            lambda b: parse_metadata(b, "metadata from the coordinator"),
        )
    except CheckpointError:
        # every rank has left write_data by now: the coordinator removes the uncommitted files
        discard = getattr(writer, "discard_incomplete", None)
        if coord.is_coordinator and discard is not None:
            discard()
        raise
