"""Rank functions for the Hugging Face tests: tiny Llama- and GPT-2-style models built from their configs (no
downloads), sharded with FSDP2, loaded from a ``save_pretrained`` directory with one distckpt.load."""

from __future__ import annotations

import torch

import distckpt
from distckpt.testing.read_counts import FileReads

BATCH = torch.tensor([[1, 5, 9, 17, 33, 2, 7, 64], [3, 3, 8, 100, 12, 0, 44, 6]])


def config(kind: str):
    import transformers

    if kind == "llama":
        return transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=False)
    return transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=3, n_head=4, n_positions=64)  # tied lm_head


def build(kind: str, seed: int):
    import transformers

    torch.manual_seed(seed)
    cls = transformers.LlamaForCausalLM if kind == "llama" else transformers.GPT2LMHeadModel
    model = cls(config(kind)).eval()
    return model


def reference(kind: str, path: str, max_shard_size: str) -> torch.Tensor:
    """Save a model as Hugging Face does, in several shards; return its logits on BATCH."""
    model = build(kind, 0)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    with torch.no_grad():
        return model(BATCH).logits


def fsdp_load(rank: int, world_size: int, kind: str, path: str):
    """An FSDP2 model of other weights, loaded from ``path`` in place; its logits and the bytes this rank read."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    model = build(kind, 1 + rank)
    layers = model.model.layers if kind == "llama" else model.transformer.h
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = get_model_state_dict(model)
    assert all(isinstance(v, torch.distributed.tensor.DTensor) for v in state.values())
    counter = FileReads()
    distckpt.load(state, checkpoint_id=path)
    read = counter.total
    with torch.no_grad():
        logits = model(BATCH).logits
    local = sum(v.to_local().nbytes for v in state.values())
    return logits, read, local


def fsdp_publish(rank: int, world_size: int, kind: str, path: str, max_shard_size: str):
    """An FSDP2 model of the reference weights published as a Hugging Face directory from every rank; the peak
    bytes any rank held of other ranks' rows is none: each writes its own local shards."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    model = build(kind, 0)
    layers = model.model.layers if kind == "llama" else model.transformer.h
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = get_model_state_dict(model)
    distckpt.save(state, storage_writer=distckpt.HuggingFaceWriter(path, max_shard_size=max_shard_size, config=model.config))
    return sorted(state)


def dtensor_publish(rank: int, world_size: int, path: str):
    """DTensors of every placement a publish meets: rows (uneven), columns, replicated, a scalar, bf16 and bool."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = dtensor_state()
    placements = {"rows": Shard(0), "cols": Shard(1), "cube": Shard(2), "rep": Replicate(), "half": Shard(1),
                  "mask": Shard(0)}
    state = {k: distribute_tensor(v, mesh, [placements[k]]) if k in placements else v for k, v in full.items()}
    distckpt.save(state, storage_writer=distckpt.HuggingFaceWriter(path, max_shard_size="2KB"))


def dtensor_state() -> dict:
    g = torch.Generator().manual_seed(7)
    return {"rows": torch.randn(13, 5, generator=g), "cols": torch.randn(6, 11, generator=g),
            "cube": torch.randn(3, 4, 7, generator=g).double(), "rep": torch.randn(9, generator=g),
            "half": torch.randn(5, 9, generator=g).bfloat16(), "mask": torch.rand(10, 3, generator=g) > 0.5,
            "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3)}


def publish_failing(rank: int, world_size: int, path: str, fault: str, mapping: bool):
    """A 2-rank publish that fails (a fault, a target already used, a bad shard mapping): what each rank raised."""
    import contextlib
    import os
    import time

    from distckpt import faults

    injected = contextlib.nullcontext()
    if fault:
        action, on = fault.split(":")
        if int(on) == rank:  # every write of that rank fails: its first one, in whatever phase it comes
            injected = faults.inject(faults.Fault(action, None, kinds=("write",)))
    state = dtensor_state_sharded(world_size)
    writer = distckpt.HuggingFaceWriter(path, max_shard_size="2KB", fqn_to_index_mapping={"rows": 1} if mapping else None)
    start = time.monotonic()
    try:
        with injected:
            distckpt.save(state, storage_writer=writer)
    except distckpt.CheckpointError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start, sorted(os.listdir(os.path.dirname(path)))
    return None


def dtensor_state_sharded(world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    return {k: distribute_tensor(v, mesh, [Shard(0)]) if v.dim() else v for k, v in dtensor_state().items()}


def replicated_publish(rank: int, world_size: int, path: str, max_shard_size: str):
    """The same plain (replicated) model on every rank, published: each tensor is written once, by one rank."""
    model = build("llama", 0)
    distckpt.save(model.state_dict(), storage_writer=distckpt.HuggingFaceWriter(path, max_shard_size=max_shard_size))
