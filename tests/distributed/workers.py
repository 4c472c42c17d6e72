"""Functions that run inside the ranks spawned by distckpt.testing.run_ranks."""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

import distckpt
from distckpt.planner import SavePlan

from . import states


def save_all_layouts(rank, world_size, path):
    sd = states.build(world_size, states.SAVE, fill=True)
    distckpt.save(sd, checkpoint_id=path)
    return True


def load_all_layouts(rank, world_size, paths):
    failures = {}
    for path in paths:
        for variant, layouts in (("same", states.SAVE), ("reshard", states.RESHARD_LAYOUT)):
            sd = states.build(world_size, layouts, fill=False)
            distckpt.load(sd, checkpoint_id=path)
            bad = states.check(sd)
            if bad:
                failures[f"{os.path.basename(path)}/{variant}"] = bad
    return failures


def save_replicated(rank, world_size, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    sd = {f"w{i}": torch.full((64 * (i + 1),), float(i)) for i in range(8)}
    sd["dt"] = distribute_tensor(torch.arange(12.0).reshape(3, 4), mesh, [Replicate()])
    sd["step"] = 5
    distckpt.save(sd, checkpoint_id=path)
    return True


class _FailingSavePlanner(distckpt.DefaultSavePlanner):
    def __init__(self, fail_rank, phase):
        super().__init__()
        self.fail_rank, self.phase = fail_rank, phase

    def create_local_plan(self) -> SavePlan:
        if self.phase == "plan" and self.rank == self.fail_rank:
            raise ValueError(f"planned failure on rank {self.rank}")
        return super().create_local_plan()

    def resolve_data(self, write_item):
        if self.phase == "write" and self.rank == self.fail_rank:
            raise OSError(28, "No space left on device (injected)")
        return super().resolve_data(write_item)


class _FailingLoadPlanner(distckpt.DefaultLoadPlanner):
    def __init__(self, fail_rank):
        super().__init__()
        self.fail_rank = fail_rank

    def resolve_tensor(self, read_item):
        if self.rank == self.fail_rank:
            raise RuntimeError(f"injected read failure on rank {self.rank}")
        return super().resolve_tensor(read_item)


def failing_save(rank, world_size, path, fail_rank, phase):
    sd = {"w": torch.ones(4, 4), f"own{rank}": torch.ones(3)}
    try:
        distckpt.save(sd, checkpoint_id=path, planner=_FailingSavePlanner(fail_rank, phase))
    except distckpt.CheckpointError as exc:
        return {"type": type(exc).__name__, "text": str(exc), "failures": sorted(getattr(exc, "failures", {}))}
    return None


def failing_load(rank, world_size, path, fail_rank):
    sd = {"w": torch.zeros(4, 4)}
    try:
        distckpt.load(sd, checkpoint_id=path, planner=_FailingLoadPlanner(fail_rank))
    except distckpt.CheckpointError as exc:
        return {"type": type(exc).__name__, "text": str(exc), "failures": sorted(getattr(exc, "failures", {}))}
    return None


def missing_key_load(rank, world_size, path):
    sd = {"w": torch.zeros(4, 4)}
    if rank == 1:
        sd["nope"] = torch.zeros(2)
    try:
        distckpt.load(sd, checkpoint_id=path)
    except distckpt.CheckpointError as exc:
        return {"type": type(exc).__name__, "text": str(exc), "failures": sorted(getattr(exc, "failures", {}))}
    return None


from itertools import zip_longest  # noqa: E402


class DDPLoadBalancingPlanner(distckpt.DefaultSavePlanner):
    def create_global_plan(self, all_plans):
        from dataclasses import replace

        iters = [iter(all_plans[0].items)] * len(all_plans)
        items_per_rank = [[item for item in items if item is not None] for items in zip(*zip_longest(*iters), strict=True)]
        all_plans = [replace(plan, items=items) for plan, items in zip(all_plans, items_per_rank, strict=True)]
        return super().create_global_plan(all_plans)


def ddp_balanced_save(rank, world_size, path):
    torch.manual_seed(0)  # every rank holds the same replicated model
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    distckpt.save({"model": model}, checkpoint_id=path, planner=DDPLoadBalancingPlanner())
    return {k: v.clone() for k, v in model.state_dict().items()}


def rank_local_roundtrip(rank, world_size, path):
    distckpt.save({"rng": distckpt.RankLocal(torch.full((3,), rank)), "shared": torch.ones(2)}, checkpoint_id=path)
    out = {"rng": distckpt.RankLocal(torch.zeros(3, dtype=torch.int64)), "shared": torch.zeros(2)}
    distckpt.load(out, checkpoint_id=path)
    return out["rng"].value.tolist()


def mismatched_replicas(rank, world_size, path):
    try:
        distckpt.save({"w": torch.ones(2 + rank)}, checkpoint_id=path)
    except distckpt.CheckpointError as exc:
        return str(exc)
    return None


def async_sharded_save(rank, world_size, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(60.0).reshape(12, 5)
    dt = distribute_tensor(full.clone(), mesh, [Shard(0)])
    handle = distckpt.async_save({"dt": dt, "rep": torch.ones(3)}, checkpoint_id=path)
    dt.to_local().fill_(-1)  # training goes on
    dist.barrier()  # a training collective while the background save runs its own
    handle.result(timeout=60)
    out = {"dt": distribute_tensor(torch.zeros(12, 5), mesh, [Shard(1)]), "rep": torch.zeros(3)}
    distckpt.load(out, checkpoint_id=path)
    return torch.equal(out["dt"].full_tensor(), full)


def dtensor_parameters_with_grads(rank, world_size, path):
    """Sharded parameters that require grad and hold a gradient: saved (sync and async) and loaded in place."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(48.0).reshape(8, 6)
    p = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)]))
    (p * 2).sum().backward()
    distckpt.save({"p": p}, checkpoint_id=path)
    distckpt.async_save({"p": p}, checkpoint_id=path + "-async").result(timeout=60)
    loaded = []
    for source, placement in ((path, Shard(1)), (path + "-async", Shard(0))):
        dest = torch.nn.Parameter(distribute_tensor(torch.zeros(8, 6), mesh, [placement]))
        distckpt.load({"p": dest}, checkpoint_id=source)
        loaded.append(torch.equal(dest.full_tensor(), full) and dest.requires_grad and dest.grad is None)
    return loaded + [p.grad is not None and torch.equal(p.grad.full_tensor(), torch.full((8, 6), 2.0))]


@contextlib.contextmanager
def counting_column_plans():
    """Record each time the coordinator plans on columns (DefaultSavePlanner.create_global_plan_columns), in a list."""
    calls: list = []
    real = distckpt.DefaultSavePlanner.create_global_plan_columns

    def counted(self, all_cols):
        calls.append(1)
        return real(self, all_cols)

    distckpt.DefaultSavePlanner.create_global_plan_columns = counted
    try:
        yield calls
    finally:
        distckpt.DefaultSavePlanner.create_global_plan_columns = real


class _ObjectPathPlanner(distckpt.DefaultSavePlanner):
    """Overrides create_global_plan without declaring plans_on_columns, which sends the save down the object path."""

    def create_global_plan(self, all_plans):
        return super().create_global_plan(all_plans)


def cached_plan_saves(rank, world_size, root, object_path=False):
    from distckpt import distributed as dd

    planner = (_ObjectPathPlanner if object_path else distckpt.DefaultSavePlanner)(enable_plan_caching=True)
    sizes, planned = [], []
    state = {f"layer{i}.w{i * 7919 % 1000}": torch.full((2 + i % 5, 3 + i % 7), float(i)) for i in range(400)}
    state["own"] = distckpt.RankLocal(torch.full((4,), float(rank)))
    for step in range(4):
        if step == 3:
            state["new"] = torch.ones(2)  # a changed state dict invalidates the cache
        for t in state.values():
            if isinstance(t, torch.Tensor):
                t.add_(1)
        with counting_column_plans() as calls:
            distckpt.save(state, checkpoint_id=f"{root}/s{step}", planner=planner)
        planned += [step] * len(calls)
        sizes.append(dd.phase_bytes["save planning"])
        out = {k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
        out["own"] = distckpt.RankLocal(torch.zeros(4))
        distckpt.load(out, checkpoint_id=f"{root}/s{step}")
        assert all(torch.equal(out[k], state[k]) for k in out if k != "own"), step
        assert torch.equal(out["own"].value, state["own"].value)
    return sizes, planned


def save_by_both_paths(rank, world_size, root):
    sd = states.build(world_size, states.SAVE, fill=True)
    sd["step"] = 11
    sd["opt"] = {"lr": 0.1, "betas": (0.9, 0.99)}
    with counting_column_plans() as calls:
        distckpt.save(sd, checkpoint_id=os.path.join(root, "columns"))
        planning_bytes = distckpt.distributed.phase_bytes["save planning"]
        distckpt.save(sd, checkpoint_id=os.path.join(root, "objects"), planner=_ObjectPathPlanner())
        object_bytes = distckpt.distributed.phase_bytes["save planning"]
    return {"calls": len(calls), "planning_bytes": planning_bytes, "object_bytes": object_bytes}


class _CopyingFinishPlanner(distckpt.DefaultSavePlanner):
    """Returns a new plan object from finish_plan: write results then travel in the general form."""

    def finish_plan(self, new_plan):
        from dataclasses import replace

        return super().finish_plan(replace(new_plan, items=list(new_plan.items)))


def save_with_general_results(rank, world_size, path):
    sd = states.build(world_size, states.SAVE, fill=True)
    sd["step"] = 5
    with counting_column_plans() as calls:
        distckpt.save(sd, checkpoint_id=path, planner=_CopyingFinishPlanner())
    return len(calls)


class _ObjectPathLoadPlanner(distckpt.DefaultLoadPlanner):
    """Overrides create_global_plan (without changing it): load plans then travel to the coordinator."""

    def create_global_plan(self, global_plan):
        return super().create_global_plan(global_plan)


def load_with_and_without_plan_transport(rank, world_size, path):
    from distckpt import distributed as dd

    moved = {}
    for name, planner in (("default", None), ("object", _ObjectPathLoadPlanner())):
        dd.phase_bytes.clear()
        sd = states.build(world_size, states.RESHARD_LAYOUT, fill=False)
        distckpt.load(sd, checkpoint_id=path, planner=planner)
        assert not states.check(sd), name
        moved[name] = dd.phase_bytes.get("load planning", 0)
    return moved


def _rows_dtensor(world_size, fill):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(12 * 1024, dtype=torch.float32).reshape(12, 1024) if fill else torch.zeros(12, 1024)
    return {"w": distribute_tensor(full, mesh, [Shard(0)])}


def save_rows(rank, world_size, path):
    distckpt.save(_rows_dtensor(world_size, True), checkpoint_id=path)
    return True


def load_rows_sharing_verification(rank, world_size, path):
    """Load at another world size; report which partly read chunks this rank verified and whether the data is right."""
    sd = _rows_dtensor(world_size, False)
    reader = distckpt.FileSystemReader(path, shared_reads=False)  # shared reads would send these chunks whole
    try:
        distckpt.load(sd, storage_reader=reader)
    except distckpt.CheckpointError as exc:
        return {"error": type(exc).__name__, "text": str(exc)}
    want = torch.arange(12 * 1024, dtype=torch.float32).reshape(12, 1024)
    local = sd["w"].to_local()
    start = sd["w"].device_mesh.get_coordinate()[0] * (12 // world_size)
    return {"ok": torch.equal(local, want[start:start + local.shape[0]]),
            "elsewhere": sorted(tuple(i.offset) for i in reader.verified_elsewhere)}


def forged_rank_local_name(rank, world_size, path):
    """Rank 0 saves a RankLocal ``x``; rank 1 a plain key spelled like rank 0's stored copy."""
    sd = {"x": distckpt.RankLocal(torch.full((2,), float(rank)))} if rank == 0 else {"x@rank0": torch.full((2,), 9.0)}
    try:
        distckpt.save(sd, checkpoint_id=path)
    except distckpt.CheckpointError as exc:
        return type(exc).__name__, str(exc)
    return None


class _Collective:
    """A Stateful whose state_dict and load_state_dict run a collective naming it: ranks that ask the objects in
    different orders meet different names (or wait on each other)."""

    def __init__(self, name: str):
        self.name, self.met = name, []

    def _meet(self):
        names = [None] * dist.get_world_size()
        dist.all_gather_object(names, self.name)
        self.met.append(names)

    def state_dict(self):
        self._meet()
        return {"v": torch.tensor([len(self.name)])}

    def load_state_dict(self, state):
        self._meet()


def stateful_in_rank_order(rank: int, world_size: int, path: str):
    """Each rank builds its state dict in another key order; every collective the objects run must meet its twin."""
    objs = {k: _Collective(k) for k in ("model", "optim", "sched")}
    order = list(objs) if rank == 0 else list(reversed(objs))
    distckpt.save({k: objs[k] for k in order}, checkpoint_id=path)
    distckpt.load({k: objs[k] for k in order}, checkpoint_id=path)
    return {k: o.met for k, o in objs.items()}


def collectives_of_a_load(rank, world_size, path):
    """Save DTensor row shards, then load them at the same sharding and resharded; count the process group's
    collectives each load makes, and the plan bytes it moves."""
    from distckpt import distributed as dd

    counted = {"n": 0}
    names = ("all_gather", "gather", "scatter", "broadcast", "all_reduce", "all_gather_into_tensor")
    originals = {name: getattr(dist, name) for name in names}

    def counting(fn):
        def call(*args, **kwargs):
            counted["n"] += 1
            return fn(*args, **kwargs)
        return call

    distckpt.save(_rows_dtensor(world_size, True), checkpoint_id=path)
    out = {}
    for name in names:
        setattr(dist, name, counting(originals[name]))
    try:
        for label, dim in (("same", 0), ("reshard", 1)):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Shard, distribute_tensor

            sd = {"w": distribute_tensor(torch.zeros(12, 1024), init_device_mesh("cpu", (world_size,)), [Shard(dim)])}
            dd.phase_bytes.clear()
            counted["n"] = 0
            distckpt.load(sd, checkpoint_id=path)
            assert torch.equal(sd["w"].full_tensor(), _rows_dtensor(world_size, True)["w"].full_tensor()), label
            planner = distckpt.DefaultLoadPlanner()
            planner.set_up_planner(sd, distckpt.read_metadata(path))
            general = len(planner.create_local_plan().items.general)  # reads that are not a whole chunk into a whole shard
            out[label] = {"collectives": counted["n"], "moved": dd.phase_bytes.get("load planning", 0), "general": general}
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return out
