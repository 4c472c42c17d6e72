"""Rank functions for test_capabilities: subclasses that wrap distckpt's classes, and ones that withdraw what they declare."""

from __future__ import annotations

import os

import distckpt
from distckpt import distributed as dd
from distckpt.capabilities import keeps_plans, plans_on_columns

from . import states
from .workers import counting_column_plans


class LoggingWriter(distckpt.FileSystemWriter):
    """Wraps write_data and finish, as a metrics or logging layer would; declares nothing itself."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    def write_data(self, plan, planner):
        self.calls.append("write_data")
        return super().write_data(plan, planner)

    def finish(self, metadata, results):
        self.calls.append("finish")
        return super().finish(metadata, results)


class PlainWriter(distckpt.FileSystemWriter):
    """Withdraws the columnar commit: the save plans and commits through the protocol's objects."""

    capabilities = frozenset()


class LoggingPlanner(distckpt.DefaultSavePlanner):
    """Wraps create_global_plan and declares that the wrapper still plans as the default one does."""

    @plans_on_columns
    def create_global_plan(self, all_plans):
        return super().create_global_plan(all_plans)


class LoggingReader(distckpt.FileSystemReader):
    """Wraps read_data; declares nothing itself."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reads = 0

    def read_data(self, plan, planner):
        self.reads += 1
        return super().read_data(plan, planner)


class ChangingReader(distckpt.FileSystemReader):
    """Overrides prepare_global_plan without declaring keeps_plans: plans travel to the coordinator."""

    def prepare_global_plan(self, plans):
        return super().prepare_global_plan(plans)


class DeclaredReader(distckpt.FileSystemReader):
    """Overrides prepare_global_plan and declares that it keeps plans."""

    @keeps_plans
    def prepare_global_plan(self, plans):
        return super().prepare_global_plan(plans)


def save_through_wrappers(rank, world_size, root):
    """Save the same state four ways; report, per way, whether the coordinator planned on columns and what moved."""
    sd = states.build(world_size, states.SAVE, fill=True)
    sd["step"] = 5
    out = {}
    ways = {
        "default": (None, None),
        "logging_writer": (LoggingWriter(os.path.join(root, "logging_writer")), None),
        "logging_planner": (None, LoggingPlanner()),
        "plain_writer": (PlainWriter(os.path.join(root, "plain_writer")), None),
    }
    for name, (writer, planner) in ways.items():
        with counting_column_plans() as calls:
            distckpt.save(sd, checkpoint_id=os.path.join(root, name), storage_writer=writer, planner=planner)
        out[name] = {"columns": len(calls), "planning_bytes": dd.phase_bytes["save planning"],
                     "calls": getattr(writer, "calls", None)}
    return out


def load_through_wrappers(rank, world_size, path):
    """Load with readers that wrap or change the global step; report what planning moved and whether data is right."""
    from distckpt.engine import read as engine_read

    out = {}
    whole: list[int] = []
    split = engine_read.Read.split_direct
    engine_read.Read.split_direct = lambda self: whole.append(len(self.whole)) or split(self)  # whole chunks from columns
    for name, reader in (("default", distckpt.FileSystemReader(path)), ("logging", LoggingReader(path)),
                         ("changing", ChangingReader(path)), ("declared", DeclaredReader(path))):
        dd.phase_bytes.clear()
        whole.clear()
        sd = states.build(world_size, states.RESHARD_LAYOUT, fill=False)
        distckpt.load(sd, storage_reader=reader)
        out[name] = {"ok": not states.check(sd), "moved": dd.phase_bytes.get("load planning", 0),
                     "reads": getattr(reader, "reads", None), "whole": sum(whole)}
    return out


def save_through_zstd_on_columns(rank, world_size, root):
    """Save sharded and replicated state through DCP's zstd extension, failing if any step leaves the columns;
    then load it back. Returns how many column plans the coordinator made and what did not load."""
    from distckpt.engine import commit
    from distckpt.item_columns import PlanColumns, ResultColumns, WriteColumns
    from distckpt.planning import save_planner

    def fell_back(*args, **kwargs):
        raise AssertionError("the zstd save left the columnar path")

    sd = states.build(world_size, states.SAVE, fill=True)
    sd["step"] = 5
    patched = [(WriteColumns, "build"), (PlanColumns, "to_plan"), (ResultColumns, "to_results"),
               (save_planner, "build_metadata"), (commit, "encode_metadata")]
    real = [getattr(owner, name) for owner, name in patched]
    for owner, name in patched:
        setattr(owner, name, fell_back)
    try:
        with counting_column_plans() as calls:
            distckpt.save(sd, storage_writer=distckpt.FileSystemWriter(root, _extensions=[distckpt.ZStandard()]))
    finally:
        for (owner, name), fn in zip(patched, real):
            setattr(owner, name, fn)
    back = states.build(world_size, states.SAVE, fill=False)
    back["step"] = 0
    distckpt.load(back, checkpoint_id=root)
    return {"columns": len(calls), "wrong": states.check(back), "step": back["step"]}
