"""torch's own state-dict helpers (get_state_dict / set_state_dict) with FSDP2 and AdamW, saved by distckpt sync
and async at 2 ranks and loaded at 1 and 3: model and optimizer come back bit-exact, with one import changed."""

import pytest
import torch

import distckpt
from distckpt.testing import run_ranks


def _model_and_optim(world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 5))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, optim, seed):
    g = torch.Generator().manual_seed(seed)
    loss = model(torch.randn(4, 8, generator=g)).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.item()


def _full(sd):
    """Every tensor of a state dict whole (DTensors gathered), keyed by path; other values as they are."""
    out = {}

    def walk(obj, path):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, path + (str(k),))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, path + (str(i),))
        elif isinstance(obj, torch.Tensor):
            out[".".join(path)] = (obj.full_tensor() if hasattr(obj, "full_tensor") else obj).clone()  # never an alias
        else:
            out[".".join(path)] = obj
    walk(sd, ())
    return out


def _save(rank, world_size, path, use_async):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = _model_and_optim(world_size)
    for seed in range(2):
        _step(model, optim, seed)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    if use_async:
        handle = distckpt.async_save(state, checkpoint_id=path)
        handle.result()
    else:
        distckpt.save(state, checkpoint_id=path)
    return _full(state), _step(model, optim, 7)  # the next step's loss, to compare after resuming


def _load(rank, world_size, path):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optim = _model_and_optim(world_size)
    _step(model, optim, 99)  # different state, and the optimizer's state exists
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    distckpt.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    again_model, again_optim = get_state_dict(model, optim)
    return _full({"model": again_model, "optim": again_optim}), _step(model, optim, 7)


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("use_async", [False, pytest.param(True, marks=pytest.mark.slow)])  # async: test_in_step.py guards it
def test_fsdp2_and_adamw_state_dicts_save_at_two_ranks_and_resume_at_one_and_three(tmp_path, use_async):
    path = str(tmp_path / "ck")
    saved = run_ranks(_save, 2, path, use_async, timeout_s=180)
    want, next_loss = saved[0]
    for world_size in (1, 3):
        for got, loss in run_ranks(_load, world_size, path, timeout_s=180):
            _same(got, want)
            if world_size == 1:
                assert loss == next_loss  # the same step on the same state: the same loss
