"""accelerate's FSDP2 save and load helpers, which call torch.distributed.checkpoint with DCP's own
FileSystemWriter/Reader and planners, run on distckpt after one line (route_dcp_calls): 2 ranks save model
and optimizer, twice into the same folders (accelerate reuses them), and load them back bit-exact."""

import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,  # imported by the tests that use it
                                reason="accelerate is not installed (pip install 'distckpt[accelerate]')")

from distckpt.testing import run_ranks  # noqa: E402


def _model_and_optim(world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, optim, seed):
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(5, 6, generator=g)).square().mean().backward()
    optim.step()
    optim.zero_grad()


def _flat(model, optim):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    out = {f"model.{k}": v.full_tensor().clone() for k, v in msd.items()}
    for key, state in osd["state"].items():
        for name, value in state.items():
            out[f"optim.{key}.{name}"] = (value.full_tensor() if hasattr(value, "full_tensor") else value).clone()
    return out


def _job(rank, world_size, out_dir):
    from accelerate import PartialState
    from accelerate.utils.fsdp_utils import load_fsdp_model, load_fsdp_optimizer, save_fsdp_model, save_fsdp_optimizer
    from torch.distributed.fsdp import StateDictType

    from distckpt.integrations.dcp_routing import route_dcp_calls

    PartialState(cpu=True)  # accelerate's logging needs its state; the process group is run_ranks' own
    plugin = SimpleNamespace(state_dict_type=StateDictType.SHARDED_STATE_DICT, fsdp_version=2,
                             state_dict_config=SimpleNamespace(), optim_state_dict_config=SimpleNamespace())
    accelerator = SimpleNamespace(process_index=rank, num_processes=world_size, wait_for_everyone=lambda: None)
    model, optim = _model_and_optim(world_size)
    with route_dcp_calls():
        for seed in (1, 2):  # the second save goes into the folders of the first
            _train(model, optim, seed)
            save_fsdp_model(plugin, accelerator, model, out_dir)
            save_fsdp_optimizer(plugin, accelerator, optim, model, out_dir)
        want = _flat(model, optim)
        _train(model, optim, 9)  # move away from the saved state
        load_fsdp_model(plugin, accelerator, model, out_dir)
        load_fsdp_optimizer(plugin, accelerator, optim, model, out_dir)
    got = _flat(model, optim)
    committed = [os.path.isfile(os.path.join(out_dir, d, "metadata.json")) for d in sorted(os.listdir(out_dir))]
    import torch.distributed.checkpoint as dcp

    return (want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), committed,
            dcp.save.__module__)


def test_accelerate_fsdp2_helpers_save_and_load_through_distckpt(tmp_path):
    for same, committed, save_module in run_ranks(_job, 2, str(tmp_path / "out"), timeout_s=180):
        assert same and committed == [True, True]  # pytorch_model_fsdp_0 and optimizer_0, distckpt's format
        assert save_module.startswith("torch.distributed.checkpoint")  # the routing was undone after the block


ACCELERATE = "1.15.0"
_NO_FSDP_ON_CPU = (
    f"accelerate {ACCELERATE} takes FSDP only on accelerators: accelerate/state.py:986-1013 sets DistributedType.FSDP "
    "inside `elif self.distributed_type in [MULTI_GPU, MULTI_MLU, MULTI_SDAA, MULTI_MUSA, MULTI_NPU, MULTI_XPU, MULTI_HPU, "
    "MULTI_NEURON]`, which MULTI_CPU is not; on CPU the fsdp_plugin is dropped, prepare() wraps the model in DDP and "
    "save_state writes model.safetensors and optimizer.bin without calling DCP (the test above pins that)")


def _accelerate_run(tmp_path, nproc, *flags):
    """Accelerator.save_state/load_state under route_dcp_calls(), ``nproc`` ranks launched by torchrun."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(here / "accelerate_worker.py"), str(tmp_path / "out"), str(tmp_path / "result.json"), *flags]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return json.loads((tmp_path / "result.json").read_text())


def _pinned():
    from importlib.metadata import version

    if version("accelerate") != ACCELERATE:
        pytest.skip(f"pins accelerate {ACCELERATE}'s choice of distributed type (installed: {version('accelerate')})")


def test_accelerator_on_cpu_drops_its_fsdp_plugin_so_save_state_is_not_routed(tmp_path):
    """The silence README documents: on CPU, Accelerator(fsdp_plugin=FSDP2) runs DDP, and save_state never calls DCP,
    so route_dcp_calls() routes nothing (routing.calls stays 0) and the files are accelerate's own."""
    _pinned()
    result = _accelerate_run(tmp_path, 2, "--cpu")
    assert result["distributed_type"] == "MULTI_CPU" and result["routed"] == 0 and result["committed"] == []
    assert "model.safetensors" in result["files"] and "optimizer.bin" in result["files"] and result["same"]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason=_NO_FSDP_ON_CPU + "; needs 2 GPUs")
def test_accelerator_fsdp2_save_state_and_load_state_through_distckpt(tmp_path):
    _pinned()
    result = _accelerate_run(tmp_path, 2)
    assert result["distributed_type"] == "FSDP" and result["routed"] >= 4  # model and optimizer, saved twice and loaded
    assert set(result["committed"]) >= {"pytorch_model_fsdp_0", "optimizer_0"} and result["same"]
