"""CheckpointManager: retention invariants under random saves, crashes, disk-full errors and restarts."""

import os

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import distckpt
from distckpt import faults
from distckpt.backends.leases import simulate_process_death


class SimulatedCrash(BaseException):
    """Stops a save the way a dying process does: no cleanup code runs."""


class ManagerMachine(RuleBasedStateMachine):
    """The run's model against a CheckpointManager on local disk; subclasses run it on other stores."""

    def __init__(self):
        super().__init__()
        self.root = self.new_root()
        self.committed: list[int] = []  # what the model says is stored
        self.step = 0

    def new_root(self) -> str:
        import tempfile

        return tempfile.mkdtemp(prefix="mgr-")

    def leftovers(self) -> list[str]:
        """What crashed saves or deletions left in the root (checked without the manager's help)."""
        return [n for n in os.listdir(self.root) if n.startswith(".")]

    def remove_root(self) -> None:
        import shutil

        shutil.rmtree(self.root, ignore_errors=True)

    def is_committed(self, step) -> bool:
        try:
            distckpt.read_metadata(self.mgr.path(step))
            return True
        except distckpt.CheckpointNotFoundError:
            return False

    @initialize(keep_last=st.one_of(st.none(), st.integers(1, 4)), keep_every=st.one_of(st.none(), st.integers(2, 5)))
    def start(self, keep_last, keep_every):
        self.keep_last, self.keep_every = keep_last, keep_every
        self.mgr = distckpt.CheckpointManager(self.root, keep_last=keep_last, keep_every=keep_every)

    def _expected_after_commit(self):
        steps = sorted(self.committed)
        keep = set(steps) if self.keep_last is None else set(steps[-self.keep_last:])
        if self.keep_every is not None:
            every = {s for s in steps if s % self.keep_every == 0}
            keep = every if self.keep_last is None else keep | every
        keep.add(steps[-1])
        self.committed = sorted(keep)

    def _state(self, step):
        return {"w": torch.full((64,), float(step)), "step": step}

    @rule()
    def save_ok(self):
        self.step += 1
        self.mgr.save(self.step, self._state(self.step))
        self.committed.append(self.step)
        self._expected_after_commit()

    @rule(at=st.integers(0, 30))
    def save_crashes(self, at):
        self.step += 1

        def crash(kind, what):
            raise SimulatedCrash()

        with pytest.raises((SimulatedCrash, distckpt.CheckpointError)):
            with faults.inject(faults.Fault("call", index=at, callback=crash)):
                self.mgr.save(self.step, self._state(self.step))
                raise SimulatedCrash()  # the save finished before the crash point: crash right after
        simulate_process_death()  # what the crashed process held (a lease on its save) died with it
        if self.is_committed(self.step):
            # it committed before the crash point: it counts, and retention may not have run
            self.committed.append(self.step)
            self.committed = sorted(set(self.committed))
            self.mgr.apply_retention()
            self._expected_after_commit()

    @rule(kind=st.sampled_from(["write", "fsync", "rename"]))
    def disk_full(self, kind):
        self.step += 1
        with pytest.raises(distckpt.CheckpointError, match="No space left"):
            with faults.inject(faults.Fault("enospc", kinds=(kind,))):
                os.environ["DISTCKPT_FSYNC"] = "1"
                try:
                    self.mgr.save(self.step, self._state(self.step))
                finally:
                    os.environ["DISTCKPT_FSYNC"] = "0"

    @rule()
    def restart(self):
        self.mgr = distckpt.CheckpointManager(self.root, keep_last=self.keep_last, keep_every=self.keep_every)
        assert not self.leftovers(), "stale temporaries survived a restart"

    @precondition(lambda self: self.committed)
    @rule()
    def resume_latest(self):
        out = {"w": torch.zeros(64), "step": -1}
        step = self.mgr.load(out)
        assert step == max(self.committed) and out["step"] == step and float(out["w"][0]) == step

    @invariant()
    def committed_set_matches_policy(self):
        if hasattr(self, "mgr"):
            assert self.mgr.all_steps() == self.committed
            assert self.mgr.latest_step() == (self.committed[-1] if self.committed else None)

    def teardown(self):
        self.remove_root()


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(settings.get_profile("machines"), stateful_step_count=15, deadline=None)


def test_load_without_checkpoints_is_a_clear_error(tmp_path):
    mgr = distckpt.CheckpointManager(tmp_path)
    with pytest.raises(distckpt.CheckpointNotFoundError, match="nothing to resume"):
        mgr.load({"w": torch.zeros(1)})
    mgr.save(3, {"w": torch.ones(1)})
    with pytest.raises(distckpt.CheckpointNotFoundError, match=r"committed steps: \[3\]"):
        mgr.load({"w": torch.zeros(1)}, step=2)
    with pytest.raises(distckpt.CheckpointError, match="already exists"):
        mgr.save(3, {"w": torch.ones(1)})


def test_overwrite_keeps_the_old_checkpoint_until_the_new_one_commits(tmp_path):
    path = str(tmp_path / "ck")
    distckpt.save({"w": torch.ones(4)}, checkpoint_id=path)
    with pytest.raises(distckpt.CheckpointError):
        with faults.inject(faults.Fault("enospc", kinds=("write",))):
            distckpt.save({"w": torch.full((4,), 2.0)}, storage_writer=distckpt.FileSystemWriter(path, overwrite=True))
    out = {"w": torch.zeros(4)}
    distckpt.load(out, checkpoint_id=path)
    assert torch.equal(out["w"], torch.ones(4))
    distckpt.save({"w": torch.full((4,), 2.0)}, storage_writer=distckpt.FileSystemWriter(path, overwrite=True))
    distckpt.load(out, checkpoint_id=path)
    assert torch.equal(out["w"], torch.full((4,), 2.0))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]
