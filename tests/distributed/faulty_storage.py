"""A storage writer and reader that raise ValueError in a chosen phase on chosen ranks, for the tests of how
every rank learns what each failing rank raised (the exception itself, rebuilt with its type)."""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch.futures import Future

import distckpt
from distckpt.metadata import Metadata
from distckpt.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from distckpt.storage import StorageReader, StorageWriter, WriteResult

SAVE_PHASES = ["set_up_storage_writer", "prepare_local_plan", "prepare_global_plan", "write_data",
               "write_data_async", "finish"]
LOAD_PHASES = ["read_metadata", "set_up_storage_reader", "prepare_local_plan", "prepare_global_plan", "read_data",
               "read_data_async"]


class _Faults:
    def __init__(self, failing: dict[str, list[int]]):
        self.failing = failing
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    def _maybe_raise(self, phase: str) -> None:
        if self.rank in self.failing.get(phase, ()):
            raise ValueError(f"injected failure of {phase} on rank {self.rank}")

    def _future(self, phase: str, value: Any) -> Future:
        fut: Future = Future()
        if self.rank in self.failing.get(phase, ()):
            fut.set_exception(ValueError(f"injected failure of {phase} on rank {self.rank}"))
        else:
            fut.set_result(value)
        return fut


class FaultyStorageWriter(_Faults, StorageWriter):
    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._maybe_raise("set_up_storage_writer")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._maybe_raise("prepare_local_plan")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self._maybe_raise("prepare_global_plan")
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self._maybe_raise("write_data")
        return self._future("write_data_async", [])

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self._maybe_raise("finish")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return True


class FaultyStorageReader(_Faults, StorageReader):
    def __init__(self, metadata: Metadata, failing: dict[str, list[int]]):
        super().__init__(failing)
        self.metadata = metadata

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self._maybe_raise("read_metadata")
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._maybe_raise("set_up_storage_reader")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        self._maybe_raise("prepare_local_plan")
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        self._maybe_raise("prepare_global_plan")
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self._maybe_raise("read_data")
        return self._future("read_data_async", None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return True


def state_dict() -> dict:
    sd: dict = {"replicated": torch.rand(10, 10), "bytes": [1, 2, 3, 4]}
    if dist.is_initialized():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        sd["sharded"] = distribute_tensor(torch.rand(20, 20), mesh, [Shard(0)])
    return sd


def metadata_of(sd: dict) -> Metadata:
    """The metadata a save of ``sd`` by every rank would write, built with the default planner's protocol calls."""
    planner = distckpt.DefaultSavePlanner()
    planner.set_up_planner(sd, is_coordinator=True)
    plans = [planner.create_local_plan()]
    if dist.is_initialized():
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, plans[0])
        plans = gathered
    _, md = planner.create_global_plan(plans)
    return md


def outcome(call) -> Optional[dict]:
    """None if ``call()`` returned; else what it raised: its class, and each failing rank's exception type."""
    try:
        call()
    except distckpt.CheckpointException as exc:
        return {"error": "CheckpointException", "failures": {r: type(f[0]).__name__ for r, f in exc.failures.items()},
                "texts": {r: str(f[0]) for r, f in exc.failures.items()},
                "stack_named_phase": all(any(frame.name for frame in f[1]) for f in exc.failures.values())}
    except Exception as exc:  # noqa: BLE001 - the test reports what else came out
        return {"error": type(exc).__name__, "text": str(exc)}
    return None


def run_cases(rank: int, world_size: int, kind: str, cases: list) -> list:
    """Each case ``(coordinator, phase, failing_ranks)`` as one save (``kind`` "save") or load, in order."""
    no_dist = not dist.is_initialized()
    sd = state_dict()
    md = metadata_of(sd) if kind == "load" else None
    out = []
    for coordinator, phase, failing in cases:
        failing_conf = {phase: failing} if phase else {}
        if kind == "save":
            out.append(outcome(lambda: distckpt.save(sd, storage_writer=FaultyStorageWriter(failing_conf),
                                                     coordinator_rank=coordinator, no_dist=no_dist)))
        else:
            out.append(outcome(lambda: distckpt.load(sd, storage_reader=FaultyStorageReader(md, failing_conf),
                                                     coordinator_rank=coordinator, no_dist=no_dist)))
    return out
