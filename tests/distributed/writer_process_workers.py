"""Rank jobs of tests/distributed/test_writer_process.py: async saves from a writer process of each rank."""

from __future__ import annotations

import gc
import os
import time

import torch

import distckpt
from distckpt import async_saving


def _state(world: int, salt: float) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(4096.0).reshape(64, 64) + salt
    return {"w": distribute_tensor(full, mesh, [Shard(0)]), "b": torch.arange(8) + int(salt), "step": int(salt),
            "nested": {"lr": 0.5 + salt}}


def _loads(path: str, world: int, salt: float) -> bool:
    want = _state(world, salt)
    out = _state(world, -1.0)
    distckpt.load(out, checkpoint_id=path)
    return (torch.equal(out["w"].full_tensor(), want["w"].full_tensor()) and torch.equal(out["b"], want["b"])
            and out["step"] == want["step"] and out["nested"] == want["nested"])


def saves_from_writer_processes(rank: int, world: int, root: str) -> dict:
    """Two saves through PROCESS: both load bit-exact; one writer process per rank, the same for both saves; the
    caller may change its tensors once the call returns."""
    from distckpt.async_saving import _STATE

    state = _state(world, 1.0)
    first = distckpt.async_save(state, checkpoint_id=f"{root}/one", async_checkpointer_type="process")
    state["w"].to_local().add_(1000.0)  # after the call returned: not in the save
    first.result(timeout=120)
    writers = {c.writer.process.pid for c in _STATE.channels.values() if c.writer is not None}
    second = distckpt.async_save(_state(world, 2.0), checkpoint_id=f"{root}/two",
                                 async_checkpointer_type=distckpt.AsyncCheckpointerType.PROCESS)
    second.result(timeout=120)
    after = {c.writer.process.pid for c in _STATE.channels.values() if c.writer is not None}
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
        children = {int(pid) for pid in f.read().split()}
    return {"one": _loads(f"{root}/one", world, 1.0), "two": _loads(f"{root}/two", world, 2.0),
            "writers": len(writers), "reused": writers == after, "child": writers <= children, "pid": os.getpid() not in writers}


def a_fault_in_one_writer(rank: int, world: int, root: str, spec: str) -> dict:
    """A fault (``DISTCKPT_WRITER_FAULT``) in the writer of one rank during the first save: every rank's handle
    raises a typed error within the collective timeout, nothing is committed, and the next save works."""
    os.environ["DISTCKPT_WRITER_FAULT"] = spec
    begun = time.monotonic()
    handle = distckpt.async_save(_state(world, 1.0), checkpoint_id=f"{root}/faulty", async_checkpointer_type="process")
    os.environ.pop("DISTCKPT_WRITER_FAULT")  # the writers started next have none
    try:
        handle.result(timeout=120)
        error = None
    except distckpt.CheckpointError as exc:
        error = type(exc).__name__
    except Exception as exc:  # noqa: BLE001 - an untyped error is what the test looks for
        error = f"untyped {type(exc).__name__}: {exc}"
    waited = time.monotonic() - begun
    committed = os.path.exists(f"{root}/faulty/metadata.json")
    again = distckpt.async_save(_state(world, 3.0), checkpoint_id=f"{root}/after", async_checkpointer_type="process")
    again.result(timeout=120)
    return {"error": error, "waited": waited, "committed": committed, "after": _loads(f"{root}/after", world, 3.0)}


class SlowPlanner(distckpt.DefaultSavePlanner):
    """Plans as the default does, after ``seconds`` (in the writer process, where it plans)."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def create_local_plan(self):
        time.sleep(self.seconds)
        return super().create_local_plan()


def _refuse_to_rebuild(rank: int):
    raise ValueError(f"rank {rank}'s planner cannot be rebuilt here")


class PlannerThatDoesNotTravel(distckpt.DefaultSavePlanner):
    """Pickles in the training process, and fails to rebuild in the writer process."""

    def __reduce__(self):
        return (_refuse_to_rebuild, (int(os.environ.get("RANK", "0")),))


def one_writer_cannot_rebuild_its_save(rank: int, world: int, root: str) -> dict:
    # the writers started first, by a save that works: the time measured is the failure's, not a fresh interpreter's
    # start, which a loaded machine can stretch past the bound
    distckpt.async_save(_state(world, 2.0), checkpoint_id=f"{root}/warm", async_checkpointer_type="process").result(timeout=120)
    begun = time.monotonic()
    planner = PlannerThatDoesNotTravel() if rank == 1 else None
    handle = distckpt.async_save(_state(world, 1.0), checkpoint_id=f"{root}/bad", planner=planner,
                                 async_checkpointer_type="process")
    try:
        handle.result(timeout=120)
        error = None
    except distckpt.CheckpointError as exc:
        error = type(exc).__name__ + ": " + str(exc)[:2000]
    except Exception as exc:  # noqa: BLE001
        error = f"untyped {type(exc).__name__}: {exc}"
    waited = time.monotonic() - begun
    again = distckpt.async_save(_state(world, 3.0), checkpoint_id=f"{root}/after", async_checkpointer_type="process")
    again.result(timeout=120)
    return {"error": error, "waited": waited, "committed": os.path.exists(f"{root}/bad/metadata.json"),
            "after": _loads(f"{root}/after", world, 3.0)}


def saves_refused_by_the_agreement_leave_nothing_shared(rank: int, world: int, root: str) -> dict:
    """Saves that one rank cannot hand to its writer (a value that does not pickle) fail on every rank; they leave no
    file descriptor or shared memory behind."""
    def held() -> list:
        out = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                out.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass
        return out

    distckpt.async_save(_state(world, 0.0), checkpoint_id=f"{root}/first", async_checkpointer_type="process").result(timeout=120)
    before = held()
    failed = 0
    for i in range(5):
        state = _state(world, float(i)) | {f"extra{i}": torch.zeros(1000 + i)}  # a new layout each time
        if rank == 1:
            state["fn"] = lambda: 0
        try:
            distckpt.async_save(state, checkpoint_id=f"{root}/refused-{i}", async_checkpointer_type="process")
        except distckpt.CheckpointError:
            failed += 1
    distckpt.release_buffers()
    gc.collect()  # the failed calls' tracebacks (cycles through their frames) held the staged views
    after = held()
    return {"failed": failed, "grew": len(after) - len(before), "new": sorted(set(after) - set(before))}


class _Unreadable(torch.Tensor):
    """A tensor whose bytes cannot be copied out (its staging fails after the ranks agreed to the save)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            raise RuntimeError("this tensor's bytes cannot be read")
        return super().__torch_function__(func, types, args, kwargs or {})


def a_copy_fails_while_the_writers_write(rank: int, world: int, root: str) -> dict:
    """Rank 1's copy into staging fails on its second tensor, after its writer was handed the save and may have
    written the first: rank 1's call raises the cause, every rank's handle fails typed, nothing is committed, and
    the next save works."""
    sd = {"a": torch.full((1 << 20,), float(rank)), "b": torch.full((1 << 20,), 2.0 + rank)}
    if rank == 1:
        sd["b"] = sd["b"].as_subclass(_Unreadable)
    raised, error = None, None
    handle = None
    try:
        handle = distckpt.async_save(sd, checkpoint_id=f"{root}/faulty", async_checkpointer_type="process")
    except Exception as exc:  # noqa: BLE001 - rank 1's call raises what stopped its copy
        raised = f"{type(exc).__name__}: {exc}"
        handle = async_saving._STATE.in_flight[-1]
    try:
        handle.result(timeout=120)
    except distckpt.CheckpointError as exc:
        error = type(exc).__name__
    except Exception as exc:  # noqa: BLE001 - an untyped error is what the test looks for
        error = f"untyped {type(exc).__name__}: {exc}"
    committed = os.path.exists(f"{root}/faulty/metadata.json")
    again = distckpt.async_save(_state(world, 3.0), checkpoint_id=f"{root}/after", async_checkpointer_type="process")
    again.result(timeout=120)
    return {"raised": raised, "error": error, "committed": committed, "after": _loads(f"{root}/after", world, 3.0)}


class SlowCopy(torch.Tensor):
    """A source whose copy into staging takes a while (a large or GPU state): the writer starts before it ends."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            time.sleep(0.5)
        return super().__torch_function__(func, types, args, kwargs or {})


class Rescaled(distckpt.DefaultSavePlanner):
    """DCP's transform_object hook: a new tensor made from the staged one, just before it is written."""

    def transform_object(self, write_item, object):
        return object * 1 if isinstance(object, torch.Tensor) else object


def a_copy_fails_on_a_rank_whose_writer_writes_nothing_of_it(rank: int, world: int, root: str) -> dict:
    """A replicated key that deduplication gives rank 0 to write fails to copy on rank 1: rank 1 raises, and the
    save commits nowhere (rank 1's writer wrote nothing of it, and must still fail)."""
    sd = {f"own{rank}": torch.full((256,), float(rank)), "replicated": torch.full((64,), 3.0)}
    if rank == 1:
        sd["replicated"] = sd["replicated"].as_subclass(_Unreadable)
    raised = None
    try:
        handle = distckpt.async_save(sd, checkpoint_id=f"{root}/ck", async_checkpointer_type="process")
    except Exception as exc:  # noqa: BLE001 - rank 1's call raises what stopped its copy
        raised = type(exc).__name__
        handle = async_saving._STATE.in_flight[-1]
    try:
        handle.result(timeout=120)
        error = None
    except distckpt.CheckpointError as exc:
        error = type(exc).__name__
    return {"raised": raised, "error": error, "committed": os.path.exists(f"{root}/ck/metadata.json")}


def dtensors_of_one_mesh_travel_to_the_writer(rank: int, world: int, root: str) -> bool:
    """Several DTensors on one mesh (the mesh's own small tensor once shared by fd: a segfault in torch)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = {f"t{i}": torch.arange(32, dtype=torch.float32).reshape(8, 4) + i for i in range(3)}
    sd = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    distckpt.async_save(sd, checkpoint_id=f"{root}/mesh", async_checkpointer_type="process").result(timeout=120)
    out = {k: distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)]) for k in full}
    distckpt.load(out, checkpoint_id=f"{root}/mesh")
    return all(torch.equal(out[k].full_tensor(), full[k]) for k in full)
