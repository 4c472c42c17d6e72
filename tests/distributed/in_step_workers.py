"""Ranks that save a few steps while one rank fails at chosen points (run by test_in_step.py).

Every value saved encodes the step and the rank it came from, so a checkpoint
that mixes two steps, or lacks a rank's data, shows up when it is read back.
"""

from __future__ import annotations

import os
import re
import time
from typing import Optional

import torch
import torch.distributed as dist

import distckpt
from distckpt import faults


class Model(distckpt.Stateful):
    """A Stateful whose ``state_dict()`` fails on one rank at one step, like user code that raises."""

    def __init__(self, rank: int, fail_at: Optional[int]):
        self.rank, self.step, self.fail_at = rank, 0, fail_at
        self.w = torch.zeros(64)

    def state_dict(self):
        if self.step == self.fail_at:
            raise ValueError(f"state_dict of rank {self.rank} failed at step {self.step}")
        return {"w": self.w, "mine": distckpt.RankLocal(torch.full((4,), self.step * 10.0 + self.rank))}

    def load_state_dict(self, sd):
        self.w = sd["w"]
        self.mine = sd["mine"].value if isinstance(sd["mine"], distckpt.RankLocal) else sd["mine"]


def _state(rank: int, world_size: int, model: Model, step: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    model.step = step
    model.w = torch.full((64,), float(step))
    mesh = init_device_mesh("cpu", (world_size,))
    return {"model": model, "rep": torch.full((8,), float(step)), "progress": {"step": step},
            "shard": distribute_tensor(torch.full((world_size * 3, 5), float(step)), mesh, [Shard(0)])}


def _read_back(rank: int, world_size: int, checkpoint_id: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    model = Model(rank, None)
    sd = {"model": model, "rep": torch.zeros(8), "progress": {"step": -1},
          "shard": distribute_tensor(torch.zeros(world_size * 3, 5), mesh, [Shard(0)])}
    distckpt.load(sd, checkpoint_id=checkpoint_id)
    return {"step": sd["progress"]["step"], "w": sorted(set(model.w.tolist())), "rep": sorted(set(sd["rep"].tolist())),
            "shard": sorted(set(sd["shard"].full_tensor().flatten().tolist())), "mine": sorted(set(model.mine.tolist()))}


def _alloc_failure(kind: str, what: str) -> None:
    raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 1099511627776 bytes (injected)")


def _outcome(fn) -> str:
    try:
        fn()
        return "ok"
    except distckpt.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"


def faulty_steps(rank, world_size, root, mode, faults_at):
    """Save steps 1..5. ``faults_at`` maps a step to (kind, rank): ``state_dict`` (the Stateful raises),
    ``stage`` (the staging allocation fails, async), ``storage`` (this rank's checkpoint id has no backend).

    mode: ``sync``/``async`` save every step to one id with overwrite (checked after each save),
    ``manager``/``manager-async`` save step N to the manager's ``step-N``. Returns each step's outcome and,
    for every committed step, what reading it back found."""
    model = Model(rank, None)
    outcomes = {}
    committed = {}
    manager = distckpt.CheckpointManager(root) if mode.startswith("manager") else None
    one_id = os.path.join(root, "ck")
    for step in range(1, 6):
        kind, where = faults_at.get(step, (None, None))
        here = where == rank
        model.fail_at = step if (kind == "state_dict" and here) else None
        sd = _state(rank, world_size, model, step)
        ckpt = manager.path(step) if manager else one_id
        target = "bogus-scheme://nowhere" if (kind == "storage" and here) else ckpt
        injected = faults.Fault("call", kinds=("stage",), rank=rank, callback=_alloc_failure) if kind == "stage" and here else None

        def run():
            with faults.inject(injected) if injected else _nothing():
                if mode == "sync":
                    distckpt.save(sd, storage_writer=_writer(target), checkpoint_id=target)
                elif mode == "async":
                    distckpt.async_save(sd, storage_writer=_writer(target), checkpoint_id=target).result(timeout=60)
                elif mode == "manager":
                    manager.save(step, sd) if target == ckpt else distckpt.save(sd, checkpoint_id=target)
                else:
                    handle = (manager.async_save(step, sd) if target == ckpt
                              else distckpt.async_save(sd, checkpoint_id=target))
                    handle.result(timeout=60)

        outcomes[step] = _outcome(run)
        if mode in ("sync", "async") and outcomes[step] == "ok":
            committed[step] = _read_back(rank, world_size, one_id)
    if manager is not None:
        for step in manager.all_steps():
            committed[step] = _read_back(rank, world_size, manager.path(step))
    dist.barrier()
    return {"outcomes": outcomes, "committed": committed}


def _writer(target: str):
    if "://" in target:
        return None  # chosen from the checkpoint id (and failing there, on the faulty rank)
    return distckpt.FileSystemWriter(target, overwrite=True)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def timeout_then_recover(rank, world_size, root, max_in_flight):
    """Async saves where one rank's write stalls past DISTCKPT_TIMEOUT_S once; the saves after it must
    commit, and no async_save call may block near the timeout again."""
    slow = {"armed": True}

    def stall(kind: str, what: str) -> None:
        if slow["armed"] and rank == world_size - 1 and ("ck-2" in what or b"ck-2".hex() in what):  # temporaries name it in hex
            slow["armed"] = False
            time.sleep(float(os.environ["DISTCKPT_TIMEOUT_S"]) + 2)

    outcomes, blocked = {}, {}
    handles = {}
    with faults.inject(faults.Fault("call", kinds=("write",), callback=stall)):
        for step in range(1, 7):
            sd = {"w": torch.full((256,), float(step)), "mine": distckpt.RankLocal(torch.full((2,), step * 10.0 + rank))}
            t0 = time.monotonic()
            try:
                handles[step] = distckpt.async_save(sd, checkpoint_id=os.path.join(root, f"ck-{step}"),
                                                    storage_writer=distckpt.FileSystemWriter(os.path.join(root, f"ck-{step}")),
                                                    max_in_flight=max_in_flight)
            except distckpt.CheckpointError as exc:
                outcomes[step] = f"{type(exc).__name__}: {exc}"
            blocked[step] = time.monotonic() - t0
        for step, handle in handles.items():
            outcomes[step] = _outcome(lambda: handle.result(timeout=120))
    dist.barrier()
    values = {}
    for step, outcome in outcomes.items():
        if outcome == "ok":
            sd = {"w": torch.zeros(256), "mine": distckpt.RankLocal(torch.zeros(2))}
            distckpt.load(sd, checkpoint_id=os.path.join(root, f"ck-{step}"))
            values[step] = (sorted(set(sd["w"].tolist())), sd["mine"].value.tolist())
    return {"outcomes": outcomes, "blocked": blocked, "values": values}


def overlapping_saves(rank, world_size, root, max_in_flight):
    """Several async saves in flight at once, each committing the right step."""
    handles = []
    for step in range(1, 6):
        sd = {"w": torch.full((1024,), float(step)), "mine": distckpt.RankLocal(torch.full((2,), step * 10.0 + rank))}
        handles.append(distckpt.async_save(sd, checkpoint_id=os.path.join(root, f"ck-{step}"), max_in_flight=max_in_flight))
        sd["w"].fill_(-1)  # training goes on
    outcomes = [_outcome(lambda h=h: h.result(timeout=60)) for h in handles]
    dist.barrier()
    values = []
    for step in range(1, 6):
        sd = {"w": torch.zeros(1024), "mine": distckpt.RankLocal(torch.zeros(2))}
        distckpt.load(sd, checkpoint_id=os.path.join(root, f"ck-{step}"))
        values.append((sorted(set(sd["w"].tolist())), sd["mine"].value.tolist()))
    return {"outcomes": outcomes, "values": values}


def skipped_call(rank, world_size, root):
    """Rank 1 skips one save entirely (a bug in the training loop): the mismatch must fail, not mix steps."""
    outcomes = {}
    for step in range(1, 4):
        if rank == 1 and step == 2:
            continue
        sd = {"w": torch.full((16,), float(step)), "mine": distckpt.RankLocal(torch.full((2,), step * 10.0 + rank))}
        outcomes[step] = _outcome(lambda: distckpt.save(sd, checkpoint_id=os.path.join(root, f"ck-{step}")))
    return outcomes


class _FlakyPlanner(distckpt.DefaultSavePlanner):
    """Fails local planning when told to (a planner raising on one rank)."""

    fail = False

    def create_local_plan(self):
        if self.fail:
            raise RuntimeError("injected planning failure")
        return super().create_local_plan()


SOAK_FAULTS = ("none", "none", "state_dict", "stage", "plan", "write", "commit", "timeout")


def _step_of(what: str):
    """The step a fault point's path belongs to: a step's directory, or its staging directory (whose hidden name
    carries the step's name hex-encoded, backends/fs_runs.py)."""
    from distckpt.backends.fs_runs import parse_hidden

    for part in what.split(os.sep):
        parsed = parse_hidden(part)
        found = re.fullmatch(r"step-(\d{10})", parsed[0] if parsed else part)
        if found:
            return int(found.group(1))
    return None


def soak(rank, world_size, root, seed, steps):
    """A training loop with async saves through a manager, a random fault on a random rank at about half
    of the steps (the same draw on every rank). Returns the fault and outcome of each step and what every
    committed step holds."""
    import random

    rng = random.Random(seed)
    plan = [(rng.choice(SOAK_FAULTS), rng.randrange(world_size)) for _ in range(steps)]
    plan = [(f, 0 if f == "commit" else r) for f, r in plan]  # the coordinator commits
    manager = distckpt.CheckpointManager(root, keep_last=3)
    model = Model(rank, None)
    handles, outcomes = {}, {}
    timeout_s = float(os.environ["DISTCKPT_TIMEOUT_S"])
    current = {"step": 0}
    spent: set[int] = set()

    def at_boundary(kind: str, what: str) -> None:
        if kind == "stage":  # in the calling thread, during the current step's async_save
            if plan[current["step"] - 1] == ("stage", rank):
                _alloc_failure(kind, what)
            return
        step = _step_of(what)  # background saves of earlier steps may still be running
        if step is None or not 1 <= step <= steps:
            return
        fault, where = plan[step - 1]
        if where != rank:
            return
        if fault == "write" and kind == "write":
            raise OSError(5, f"Input/output error (injected at {what})")
        if fault == "commit" and kind == "rename":
            raise OSError(5, f"Input/output error (injected at commit {what})")
        if fault == "timeout" and kind == "write" and step not in spent:
            spent.add(step)
            time.sleep(timeout_s + 1)

    with faults.inject(faults.Fault("call", callback=at_boundary)):
        for i, (fault, where) in enumerate(plan):
            step = i + 1
            current["step"] = step
            model.fail_at = step if (fault == "state_dict" and where == rank) else None
            planner = _FlakyPlanner()  # one per save: the previous save may still be planning in the background
            planner.fail = fault == "plan" and where == rank
            sd = _state(rank, world_size, model, step)
            try:
                handles[step] = manager.async_save(step, sd, planner=planner)
            except distckpt.CheckpointError as exc:
                outcomes[step] = f"{type(exc).__name__}: {exc}"[:300]
        for step, h in handles.items():
            outcomes[step] = _outcome(lambda: h.result(timeout=300))[:300]
    dist.barrier()
    committed = {step: _read_back(rank, world_size, manager.path(step)) for step in manager.all_steps()}
    return {"plan": plan, "outcomes": outcomes, "committed": committed}


def busy_on_one_rank(rank, world_size, root):
    """Rank 1's previous save is still writing when the next call comes with wait_for_previous=False:
    that call fails on every rank (rank 0 has room, yet must not go on alone), and the save after commits."""
    def slow(kind: str, what: str) -> None:
        if rank == 1 and kind == "write" and "ck-1" in what:
            time.sleep(1.5)

    with faults.inject(faults.Fault("call", callback=slow)):
        first = distckpt.async_save({"w": torch.ones(8)}, checkpoint_id=os.path.join(root, "ck-1"))
        if rank == 0:
            first.result(timeout=30)  # rank 0 has room for the next save; rank 1 does not
        second = _outcome(lambda: distckpt.async_save({"w": torch.ones(8)}, checkpoint_id=os.path.join(root, "ck-2"),
                                                      wait_for_previous=False))
        first.result(timeout=30)
        third = _outcome(lambda: distckpt.async_save({"w": torch.ones(8)}, checkpoint_id=os.path.join(root, "ck-3"),
                                                     wait_for_previous=False).result(timeout=30))
    return {"second": second, "third": third}


def no_dist_on_one_rank(rank, world_size, root):
    """Only rank 1 saves and loads, with no_dist: no collective, so rank 0 is not needed."""
    if rank == 1:
        path = os.path.join(root, "alone")
        md = distckpt.save({"w": torch.full((3,), 5.0)}, checkpoint_id=path, no_dist=True)
        out = {"w": torch.zeros(3)}
        distckpt.load(out, checkpoint_id=path, no_dist=True)
        handle = distckpt.async_save({"w": torch.full((3,), 6.0)}, checkpoint_id=path + "-async", no_dist=True)
        handle.result(timeout=30)
        distckpt.load(out, checkpoint_id=path + "-async", no_dist=True)
        return {"loaded": out["w"].tolist(), "files": len({v.file for v in md.storage_data.items.values()})}
    return None
