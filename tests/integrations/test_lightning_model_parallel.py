"""Lightning's ModelParallelStrategy (FSDP2 over a device mesh), Fabric and Trainer, 2 ranks on CPU, with its
sharded checkpoints written and read by distckpt after one line (``route_dcp_calls()``), or, for the Trainer,
through ``DistckptModelParallelStrategy`` with Lightning's metadata inside the checkpoint, pickle-free where it is
plain data: saving twice into one folder replaces the checkpoint, and a run resumed from it ends with the weights of
an uninterrupted run."""

import collections
import importlib.util
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,  # imported by the tests that use it
                                reason="lightning is not installed (pip install 'distckpt[lightning]')")

from distckpt.testing import run_ranks  # noqa: E402

from .lightning_steps import RegressionSteps  # noqa: E402

WORLD = 2


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)


def _full(module):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in module.state_dict().items()}


def _committed(path):
    return os.path.isfile(os.path.join(path, "metadata.json"))


def _fabric_job(rank, world_size, root):
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from distckpt.integrations.dcp_routing import route_dcp_calls

    route_dcp_calls()  # the one line

    def parallelize(model, mesh):
        fully_shard(model, mesh=mesh["data_parallel"])
        return model

    strategy = ModelParallelStrategy(parallelize, data_parallel_size=world_size, tensor_parallel_size=1)
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(_net())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))

    def train(first, last):
        for step in range(first, last + 1):
            x, y = _batch(step, rank)
            fabric.backward((model(x) - y).square().mean())
            optimizer.step()
            optimizer.zero_grad()

    path = os.path.join(root, "ckpt")
    train(1, 2)
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2})
    train(3, 4)
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 4})  # into the same folder
    want_at_4 = _full(model)
    train(5, 6)
    want_at_6 = _full(model)

    fresh = fabric.setup_module(_net())
    fresh_optimizer = fabric.setup_optimizers(torch.optim.AdamW(fresh.parameters(), lr=1e-2))
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    fabric.load(path, state)
    got_at_4 = _full(fresh)
    model, optimizer = fresh, fresh_optimizer
    train(state["step"] + 1, 6)
    got_at_6 = _full(model)
    same = all(torch.equal(want_at_4[k], got_at_4[k]) and torch.equal(want_at_6[k], got_at_6[k]) for k in want_at_4)
    return same, state["step"], _committed(path)


def test_fabric_model_parallel_saves_and_resumes_through_distckpt(tmp_path):
    for same, step, committed in run_ranks(_fabric_job, WORLD, str(tmp_path), timeout_s=240):
        assert committed and step == 4
        assert same  # the loaded weights are step 4's, and training on from them gives step 6's


def _trainer_job(rank, world_size, root, max_steps, resume, through="routing"):
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from distckpt.integrations.dcp_routing import route_dcp_calls
    from distckpt.integrations.lightning import DistckptModelParallelStrategy

    if through == "routing":
        route_dcp_calls()
    strategy_class = ModelParallelStrategy if through == "routing" else DistckptModelParallelStrategy

    class Model(RegressionSteps, L.LightningModule):
        def __init__(self):
            super().__init__()
            self.save_hyperparameters({"lr": 1e-2, "widths": [6, 8, 2]})
            self.net = _net()
            self.loaded = None

        def configure_model(self):
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def on_save_checkpoint(self, checkpoint):
            checkpoint["order"] = collections.OrderedDict(a=1, b=[2, 3])  # not plain data: a dict subclass

        def on_load_checkpoint(self, checkpoint):
            self.loaded = {k: checkpoint.get(k) for k in ("order", "hyper_parameters", "global_step", "epoch")}

    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 6, generator=g), torch.randn(64, 2, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    ckpt_dir = os.path.join(root, "ckpt")
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=2, save_top_k=1)
    strategy = strategy_class(data_parallel_size=world_size, tensor_parallel_size=1)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=max_steps, callbacks=[checkpoints],
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    model = Model()
    trainer.fit(model, loader, ckpt_path=os.path.join(ckpt_dir, "last.ckpt") if resume else None)
    last = os.path.join(ckpt_dir, "last.ckpt")
    return _full(model.net), _committed(last), sorted(os.listdir(last)), model.loaded, trainer.global_step


def _resume_scenario(root, through, first=None):
    """An uninterrupted run to step 6, and a run to step 4 (saved ``first`` way, else ``through``) resumed to step 6."""
    straight = run_ranks(_trainer_job, WORLD, str(root / "straight"), 6, False, through, timeout_s=240)
    at_four = run_ranks(_trainer_job, WORLD, str(root / "run"), 4, False, first or through, timeout_s=240)  # saves at 2, 4
    resumed = run_ranks(_trainer_job, WORLD, str(root / "run"), 6, True, through, timeout_s=240)
    for rank in range(WORLD):
        want, got = straight[rank][0], resumed[rank][0]
        assert at_four[rank][1] and resumed[rank][1]  # last.ckpt is a committed distckpt checkpoint, replaced in place
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
        assert not all(torch.equal(want[k], at_four[rank][0][k]) for k in want)  # the resumed run trained steps 5 and 6
        loaded, steps = resumed[rank][3], resumed[rank][4]
        assert steps == 6 and loaded["global_step"] == 4 and loaded["epoch"] == 0
        assert loaded["hyper_parameters"] == {"lr": 1e-2, "widths": [6, 8, 2]}
        assert type(loaded["order"]) is collections.OrderedDict and loaded["order"] == {"a": 1, "b": [2, 3]}
    return resumed[0][2]


@pytest.mark.filterwarnings("ignore")
def test_trainer_model_parallel_save_last_and_resume_through_distckpt(tmp_path):
    files = _resume_scenario(tmp_path, "routing")
    assert "meta.pt" in files  # routed: Lightning keeps its own pickled metadata beside distckpt's files


@pytest.mark.filterwarnings("ignore")
def test_trainer_distckpt_strategy_keeps_lightning_metadata_in_the_checkpoint(tmp_path):
    import distckpt
    from distckpt.integrations.lightning import META_KEY, META_TORCH_SAVE_KEY

    files = _resume_scenario(tmp_path, "strategy")
    assert "metadata.json" in files and "meta.pt" not in files and not any(f.endswith(".distcp") for f in files), files
    keys = distckpt.read_metadata(str(tmp_path / "run" / "ckpt" / "last.ckpt")).state_dict_metadata
    for plain in ("global_step", "epoch", "pytorch-lightning_version", "hyper_parameters.lr", "hyper_parameters.widths"):
        assert f"{META_KEY}.{plain}" in keys, plain  # stored as data, each its own value
    assert any(k.startswith(f"{META_KEY}.loops.") for k in keys) and any(k.startswith(f"{META_KEY}.callbacks.") for k in keys)
    assert META_TORCH_SAVE_KEY in keys and not any(k.startswith(f"{META_KEY}.order") for k in keys)  # only the OrderedDict


@pytest.mark.filterwarnings("ignore")
@pytest.mark.slow  # guards that stay: the strategy's own resume (above) and tests/integrations/test_dcp_routing.py
def test_trainer_distckpt_strategy_resumes_a_run_saved_through_routing(tmp_path):
    files = _resume_scenario(tmp_path, "strategy", first="routing")  # read with the meta.pt beside it, then replaced
    assert "metadata.json" in files and "meta.pt" not in files, files
