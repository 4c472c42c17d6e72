"""Rank functions for the re-layout tests: DTensor models whose keys are fused or stacked unlike their checkpoint's,
loaded with RelayoutLoadPlanner and saved back with RelayoutSavePlanner; and a fused-qkv Llama under FSDP2."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import distckpt
from distckpt.planning.relayout import Fuse, Relayout, Rename, Stack
from distckpt.planning.relayout_planners import RelayoutLoadPlanner, RelayoutSavePlanner
from distckpt.testing.read_counts import FileReads

from . import hf_workers

# ---------------------------------------------------------------- a small unfused checkpoint and its fused model

LAYERS = 3
QKV = [5, 4, 3]  # rows of q, k, v: the fused tensor's 12 rows cut in halves straddle q|k
FC = [3, 6]  # columns of a and b: fused along dim 1, a rank's half is a non-contiguous view of each part

RULES = Relayout([
    Fuse([f"model.layers.{{n}}.attn.{p}.weight" for p in "qkv"], "layers.{n}.qkv", sizes=QKV),
    Stack("model.layers.{i}.mlp.weight", "mlp"),
    Fuse(["model.fc.a", "model.fc.b"], "fc", dim=1, sizes=FC),
    Rename("model.{*rest}", "{*rest}"),
])


def checkpoint_state() -> dict:
    """The checkpoint's layout: one key per layer and projection."""
    g = torch.Generator().manual_seed(0)
    state: dict = {}
    for i in range(LAYERS):
        for p, rows in zip("qkv", QKV):
            state[f"model.layers.{i}.attn.{p}.weight"] = torch.randn(rows, 6, generator=g)
        state[f"model.layers.{i}.mlp.weight"] = torch.randn(4, 7, generator=g)
    state["model.fc.a"] = torch.randn(4, FC[0], generator=g)
    state["model.fc.b"] = torch.randn(4, FC[1], generator=g)
    state["model.emb"] = torch.randn(5, 6, generator=g)
    state["model.step"] = 7
    return state


def model_state(ckpt: dict) -> dict:
    """The same weights in the model's layout: fused qkv per layer, stacked mlp, fused fc."""
    out = {f"layers.{i}.qkv": torch.cat([ckpt[f"model.layers.{i}.attn.{p}.weight"] for p in "qkv"]) for i in range(LAYERS)}
    out["mlp"] = torch.stack([ckpt[f"model.layers.{i}.mlp.weight"] for i in range(LAYERS)])
    out["fc"] = torch.cat([ckpt["model.fc.a"], ckpt["model.fc.b"]], 1)
    out["emb"] = ckpt["model.emb"]
    out["step"] = ckpt["model.step"]
    return out


def dtensor_load_and_save(rank: int, world_size: int, path: str, out: str, shard_dim: int):
    """Load the checkpoint at ``path`` into a model of DTensors sharded along ``shard_dim`` (plain ``emb``), then save
    it to ``out``; return what was loaded, gathered whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    shapes = model_state(checkpoint_state())
    state = {k: distribute_tensor(torch.full_like(v, float("nan")), mesh, [Shard(shard_dim)]) for k, v in shapes.items()
             if k not in ("emb", "step")}
    state["emb"] = torch.zeros(5, 6)
    state["step"] = 0
    distckpt.load(state, checkpoint_id=path, planner=RelayoutLoadPlanner(RULES, allow_unexpected_keys=False))
    loaded = {k: v.full_tensor() if isinstance(v, torch.distributed.tensor.DTensor) else v for k, v in state.items()}
    distckpt.save(state, checkpoint_id=out, planner=RelayoutSavePlanner(RULES))
    return loaded


# ---------------------------------------------------------------- a Llama whose attention reads one fused qkv


class _Rows(torch.nn.Module):
    """A projection with no parameter of its own: rows [start, stop) of its attention's fused ``qkv_proj``."""

    def __init__(self, attention: torch.nn.Module, start: int, stop: int) -> None:
        super().__init__()
        self._attention = [attention]  # in a list: not a submodule, so its parameters are not listed twice
        self.start, self.stop = start, stop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self._attention[0].qkv_proj.weight[self.start:self.stop])


def head_sizes(config) -> tuple[int, int]:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim


def fused_llama(seed: int):
    """hf_workers' tiny Llama (4 heads, 2 kv heads) with each attention's q/k/v replaced by one fused qkv_proj."""
    model = hf_workers.build("llama", seed)
    hq, hkv = head_sizes(model.config)
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.qkv_proj = torch.nn.Linear(model.config.hidden_size, hq + 2 * hkv, bias=False)
        attn.q_proj, attn.k_proj, attn.v_proj = _Rows(attn, 0, hq), _Rows(attn, hq, hq + hkv), _Rows(attn, hq + hkv, hq + 2 * hkv)
    return model


def llama_rules(config) -> Relayout:
    hq, hkv = head_sizes(config)
    attn = "model.layers.{n}.self_attn."
    return Relayout([Fuse([attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"], attn + "qkv_proj.weight",
                          sizes=[hq, hkv, hkv])])


def fused_fsdp_load(rank: int, world_size: int, path: str, out: str, hf_out: str = ""):
    """A fused-qkv Llama under FSDP2 (each layer and the root), loaded from the Hugging Face directory ``path``;
    saved to the distckpt checkpoint ``out`` (and published to ``hf_out`` with HuggingFaceWriter, if given).
    Returns its logits on hf_workers.BATCH, the bytes this rank read and the bytes of its shards."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    model = fused_llama(1 + rank)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = get_model_state_dict(model)
    assert not any(".q_proj." in k for k in state) and all(isinstance(v, torch.distributed.tensor.DTensor) for v in state.values())
    rules = llama_rules(model.config)
    counter = FileReads()
    distckpt.load(state, checkpoint_id=path, planner=RelayoutLoadPlanner(rules))
    read = counter.total
    with torch.no_grad():
        logits = model(hf_workers.BATCH).logits
    distckpt.save(state, checkpoint_id=out, planner=RelayoutSavePlanner(rules))
    if hf_out:
        from distckpt.backends.hf_writer import HuggingFaceWriter

        distckpt.save(state, storage_writer=HuggingFaceWriter(hf_out, max_shard_size="60KB", config=model.config),
                      planner=RelayoutSavePlanner(rules))
    return logits, read, sum(v.to_local().nbytes for v in state.values())
