"""Incremental saves under the run model of test_manager.py: random saves, crashes at every fault point of a save and of
its retention, disk-full errors, restarts, overwrites of kept steps, compaction, and kept steps written again another
way (documents reordered or spaced, a lookalike file table in planner_data, data-file headers re-serialised:
distckpt.testing.rewritten); after each step every kept step loads bit-exact and verifies, and nothing is left
behind but the files kept steps reference. The same machine runs in memory (here) and on S3
(tests/storage/test_incremental_s3.py)."""

import json
import os

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

import distckpt
from distckpt import backends
from distckpt.testing import rewritten

from .test_manager import ManagerMachine

TENSORS = 6


def incremental_state(step: int) -> dict:
    """Tensor i changes every i+1 steps ("w", i = 0, at every step): most of a save is unchanged since the last."""
    sd = {"w": torch.full((64,), float(step)), "step": step}
    for i in range(1, TENSORS):
        sd[f"t{i}"] = torch.arange(48, dtype=torch.float32) + float(step // (i + 1)) * 1000 + i
    sd["half"] = torch.full((5, 3), float(step // 4), dtype=torch.bfloat16)
    return sd


def referenced_by_committed(root: str, steps: list) -> set:
    """(checkpoint, save id, file) of every data file the committed ``steps``' tables reference."""
    out = set()
    for name in steps:
        with open(os.path.join(root, name, "metadata.json"), "rb") as f:
            files = json.loads(f.read())["storage_data"]["$files"]["files"]
        out |= {(row[0].split("/")[0], row[4], row[0].split("/")[1]) for row in files if len(row) == 5}
    return out


class IncrementalMachine(ManagerMachine):
    @initialize(keep_last=st.one_of(st.none(), st.integers(1, 3)), keep_every=st.one_of(st.none(), st.integers(2, 5)),
                full_every=st.one_of(st.none(), st.integers(2, 4)))
    def start(self, keep_last, keep_every, full_every):
        self.keep_last, self.keep_every, self.full_every = keep_last, keep_every, full_every
        self.mgr = self.manager()

    def manager(self):
        return distckpt.CheckpointManager(self.root, keep_last=self.keep_last, keep_every=self.keep_every,
                                          incremental=True, full_every=self.full_every)

    def _state(self, step):
        sd = incremental_state(step)
        salt = getattr(self, "salts", {}).get(step)
        if salt is not None:  # saved again over itself: one tensor differs, the rest is referenced
            sd["w"] = sd["w"] + salt
        return sd

    @precondition(lambda self: self.committed)
    @rule()
    def resume_latest(self):
        want = self._state(max(self.committed))
        out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in want.items()}
        assert self.mgr.load(out) == max(self.committed)
        assert all(torch.equal(out[k], v) if isinstance(v, torch.Tensor) else out[k] == v for k, v in want.items())

    @precondition(lambda self: self.committed)
    @rule(data=st.data())
    def overwrite_a_kept_step(self, data):
        step = data.draw(st.sampled_from(self.committed))
        self.salts = getattr(self, "salts", {})
        self.salts[step] = self.salts.get(step, 0.0) + 0.5
        self.mgr.save(step, self._state(step), storage_writer=backends.writer_for(self.mgr.path(step), overwrite=True))

    @precondition(lambda self: self.committed)
    @rule(data=st.data(), how=st.sampled_from(sorted(rewritten.REWRITES) + ["header"]))
    def write_a_kept_step_again_another_way(self, data, how):
        step = data.draw(st.sampled_from(self.committed))
        if how == "header":
            rewritten.header_reordered(self.mgr.path(step), [self.mgr.path(s) for s in self.committed])
        else:
            rewritten.REWRITES[how](self.mgr.path(step))

    @precondition(lambda self: self.committed)
    @rule(data=st.data())
    def compact_a_kept_step(self, data):
        self.mgr.compact(data.draw(st.sampled_from(self.committed)))

    @rule()
    def restart(self):
        self.mgr = self.manager()
        assert not self.leftovers(), "stale temporaries or unreferenced retired files survived a restart"

    @rule()
    def explicit_retention(self):
        self.mgr.apply_retention()

    def leftovers(self) -> list:
        names = [n for n in os.listdir(self.root) if n.startswith(".")]
        steps = [self.mgr._name(s) for s in self.mgr.all_steps()]
        wanted = referenced_by_committed(self.root, steps)
        out = []
        for n in names:
            if "retired" not in n:
                out.append(n)
                continue
            base = bytes.fromhex(n.split("-retired-", 1)[1].split("-", 1)[0]).decode()
            save_id = n.rsplit("-", 1)[1]
            out += [f"{n}/{f}" for f in os.listdir(os.path.join(self.root, n)) if (base, save_id, f) not in wanted]
        return out

    @invariant()
    def every_kept_step_loads_bit_exact(self):
        if not hasattr(self, "mgr"):
            return
        for step in self.mgr.all_steps():
            want = self._state(step)
            out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in want.items()}
            distckpt.load(out, checkpoint_id=self.mgr.path(step))
            for k, v in want.items():
                assert (torch.equal(out[k], v) if isinstance(v, torch.Tensor) else out[k] == v), (step, k)
            assert distckpt.verify(self.mgr.path(step)).ok, step


def stray_keys(keys: list, mgr) -> list:
    """Of the keys of a run on an object store (relative to its root), those that are neither a committed
    checkpoint's nor a retired step's that a kept step references (with its marker)."""
    live = {mgr._name(s): distckpt.read_metadata(mgr.path(s)).storage_meta.save_id for s in mgr.all_steps()}
    wanted = set()
    for step in mgr.all_steps():
        files = distckpt.read_metadata(mgr.path(step)).storage_data.files
        wanted |= {(name.split("/")[0], info.save_id, name.split("/")[1]) for name, info in files.items() if info.save_id}
    kept_saves = {(step, save_id) for step, save_id, _ in wanted}
    stray = []
    for key in keys:
        step, _, rest = key.partition("/")
        if step in live and (rest == "metadata.json" or rest.startswith(f"saves/{live[step]}/")):
            continue
        parts = rest.split("/")
        if len(parts) == 3 and parts[0] == "saves" and (step, parts[1], parts[2]) in wanted:
            continue
        if len(parts) == 2 and parts[0] == "retired" and (step, parts[1]) in kept_saves:
            continue
        stray.append(key)
    return stray


class MemoryIncrementalMachine(IncrementalMachine):
    @rule(kind=st.sampled_from(["write"]))  # memory has no fsync, and its commit is no rename of the disk's
    def disk_full(self, kind):
        IncrementalMachine.disk_full(self, kind)

    def new_root(self):
        import uuid

        return f"memory://inc-{uuid.uuid4().hex[:10]}"

    def leftovers(self):
        from distckpt.backends.memory import MemoryObjects

        name = self.root[len("memory://"):]
        return stray_keys([o.key[len(name) + 1:] for o in MemoryObjects().list(name + "/")], self.mgr)

    def remove_root(self):
        from distckpt.backends.memory import MemoryObjects

        objects = MemoryObjects()
        objects.delete([o.key for o in objects.list(self.root[len("memory://"):] + "/")])


TestIncrementalMachine = IncrementalMachine.TestCase
TestIncrementalMachine.settings = settings(settings.get_profile("machines"), stateful_step_count=16, deadline=None)


TestMemoryIncrementalMachine = MemoryIncrementalMachine.TestCase
TestMemoryIncrementalMachine.settings = settings(settings.get_profile("machines"), stateful_step_count=16, deadline=None)
