"""torchtitan's checkpoint manager on distckpt (``distckpt.integrations.torchtitan.CheckpointManager``), used
directly with a tiny FSDP2 model, its real optimizer, LR scheduler and dataloader containers, 2 ranks on CPU:
save -> the job is SIGKILLed in a save -> resume from the newest committed step with the losses of an
uninterrupted run -> roll back to an earlier step."""

import importlib.util
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,  # imported by the tests that use it
                                reason="torchtitan is not installed (pip install 'distckpt[torchtitan]')")

from distckpt.testing import run_ranks  # noqa: E402

STEPS = 6


class _Tokens(torch.utils.data.IterableDataset):
    """Deterministic batches, resumable where they stopped (the dataloader saves and restores the position)."""

    def __init__(self, rank):
        self.rank, self.position = rank, 0

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(1000 * self.rank + self.position)
            self.position += 1
            yield {"input": torch.randn(4, 8, generator=g)}, torch.randn(4, 5, generator=g)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, sd):
        self.position = sd["position"]


class _TrainState:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, sd):
        self.step = int(sd["step"])


def _job(rank, world_size, base, mode, resume_step, run_to, kill=False):
    """One training job: resume (newest step, or ``resume_step``), train to ``run_to``; the loss of each step run.
    With ``kill``, every rank is SIGKILLed right after the last step's save call (an async save may be in flight)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig

    from distckpt.integrations.torchtitan import CheckpointManager

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model, mesh=mesh)
    adamw = ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})
    optimizers = OptimizersContainer.Config(param_groups=[adamw], implementation="for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=STEPS)
    loader = ParallelAwareDataloader(_Tokens(rank), dp_rank=rank, dp_world_size=world_size, batch_size=None)
    train = _TrainState()
    # torchtitan's trainer sets its checkpoint config to this one and calls build() with these arguments
    config = CheckpointManager.Config(enable=True, folder="ckpt", interval=1, keep_latest_k=2, async_mode=mode,
                                      last_save_model_only=False, enable_first_step_checkpoint=True)
    ckpt = config.build(dataloader=loader, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
                        states={"train_state": train}, sd_adapter=None, base_folder=base)
    assert type(ckpt) is CheckpointManager
    ckpt.load(step=resume_step)
    losses = {}
    batches = iter(loader)
    while train.step < run_to:
        train.step += 1
        inputs, labels = next(batches)
        loss = (model(inputs["input"]) - labels).square().mean()
        loss.backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        losses[train.step] = loss.item()
        ckpt.save(train.step, last_step=False)
    if kill:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    ckpt.maybe_wait_for_staging()
    ckpt.maybe_wait_for_saving()
    ckpt.close()
    return losses, sorted(os.listdir(os.path.join(base, "ckpt")))


# async in the default run (it takes the staging path the others share); the other two under --run-slow
@pytest.mark.parametrize("mode", [pytest.param("disabled", marks=pytest.mark.slow), "async",
                                  pytest.param("async_with_pinned_mem", marks=pytest.mark.slow)])
def test_save_end_resume_with_identical_losses_and_roll_back(tmp_path, mode):
    reference = run_ranks(_job, 2, str(tmp_path / "ref"), mode, -1, STEPS, timeout_s=240)
    first = run_ranks(_job, 2, str(tmp_path / "run"), mode, -1, 4, timeout_s=240)  # the job ends after step 4
    for losses, folders in first:
        steps = {f for f in folders if not f.startswith(".")}
        assert {"step-3", "step-4"} <= steps <= {"step-2", "step-3", "step-4"}  # keep_latest_k=2 (its purge runs behind)
    killed = run_ranks(_job, 2, str(tmp_path / "run"), mode, -1, 5, True, timeout_s=240, allow_failures=True)
    assert all(not isinstance(r, tuple) for r in killed)  # both ranks died in or after step 5's save
    resumed = run_ranks(_job, 2, str(tmp_path / "run"), mode, -1, STEPS, timeout_s=240)  # the newest committed step
    for rank in range(2):
        assert resumed[rank][0] and resumed[rank][0] == {s: reference[rank][0][s] for s in resumed[rank][0]}, rank
        assert max(resumed[rank][0]) == STEPS
    rolled = run_ranks(_job, 2, str(tmp_path / "run"), mode, 5, STEPS, timeout_s=240)  # back to step 5
    for rank in range(2):
        assert rolled[rank][0] == {6: reference[rank][0][6]}


def test_the_manager_says_at_start_up_that_distckpt_saves_where_and_in_which_format(tmp_path, caplog):
    import logging

    from distckpt.integrations.torchtitan import CheckpointManager

    def build(enable):
        config = CheckpointManager.Config(enable=enable, folder="ckpt", keep_latest_k=0)
        return config.build(dataloader=None, model_parts=[torch.nn.Linear(2, 2)], optimizers=None, lr_schedulers=None,
                            states={}, sd_adapter=None, base_folder=str(tmp_path))

    with caplog.at_level(logging.INFO):
        build(False)
        assert not [r for r in caplog.records if "distckpt" in r.getMessage()]  # checkpointing off: nothing to say
        build(True)
    said = [r.getMessage() for r in caplog.records if r.name == "distckpt"]
    assert len(said) == 1, said
    assert str(tmp_path / "ckpt") in said[0] and "saved by distckpt" in said[0] and "metadata.json" in said[0]
    assert "synchronous" in said[0]
