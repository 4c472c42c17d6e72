"""Rank functions of bench/hf_load.py: one peer's load of a Hugging Face directory into an FSDP2 model."""

from __future__ import annotations

import json
import os
import time
import warnings

import torch

from distckpt.testing.read_counts import FileReads

from .measure import measure, warm_memory

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def llama_config(gib: float):
    """A Llama-style config of about ``gib`` GiB of float32 weights (untied embeddings)."""
    import transformers

    hidden, inter, vocab = (1024, 2816, 32000) if gib >= 0.5 else (128, 352, 4000)  # small ones for smoke runs
    per_layer = 4 * hidden * hidden * 3 // 4 + 3 * hidden * inter + 2 * hidden  # q,o full; k,v at half the heads
    fixed = 2 * vocab * hidden + hidden
    layers = max(1, round((gib * (1 << 30) / 4 - fixed) / per_layer))
    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                                    num_attention_heads=16 if gib >= 0.5 else 4, num_key_value_heads=8 if gib >= 0.5 else 2,
                                    tie_word_embeddings=False)


def _fsdp_model(config, mesh):
    import transformers
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    return model


def _headers(path: str) -> dict:
    """name -> (file, absolute offset, dtype, shape), from the shards' headers (the raw floor's only parsing)."""
    out = {}
    for name in sorted(os.listdir(path)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(path, name), "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        for key, e in header.items():
            out[key] = (name, 8 + n + e["data_offsets"][0], DTYPES[e["dtype"]], e["shape"])
    return out


def _raw(state: dict, path: str) -> int:
    """Each local shard's rows, read with one pread per tensor straight into it: no format, no checks."""
    headers = _headers(path)
    fds: dict = {}
    total = 0
    try:
        for key, dt in state.items():
            local = dt.to_local()
            if not local.numel():
                continue
            file, offset, _, shape = headers[key]
            row_bytes = local[0].nbytes if local.dim() else local.nbytes
            first = dt.device_mesh.get_local_rank() * ((shape[0] + dt.device_mesh.size() - 1) // dt.device_mesh.size())
            if file not in fds:
                fds[file] = os.open(os.path.join(path, file), os.O_RDONLY)
            view = memoryview(local.view(torch.uint8).numpy()).cast("B")
            total += os.preadv(fds[file], [view], offset + first * row_bytes)
    finally:
        for fd in fds.values():
            os.close(fd)
    return total


def load_round(rank: int, world_size: int, peer: str, path: str, gib: float) -> dict:
    """One load by ``peer``: its wall time, CPU time, peak RSS above the start, bytes read from files, and a
    fingerprint of the loaded local shards (the sum of their float64 sums) for checking peers against each other."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    import distckpt

    with open(os.path.join(path, "config.json")) as f:
        config = llama_config(gib).__class__.from_dict(json.load(f))
    mesh = init_device_mesh("cpu", (world_size,))
    model = _fsdp_model(config, mesh)
    state = get_model_state_dict(model)
    local_bytes = sum(v.to_local().nbytes for v in state.values())
    warm_memory(1.25 * local_bytes / (1 << 30))
    counter = FileReads() if peer == "distckpt" else None
    read = {"n": None}
    # every peer's modules imported before the clock starts: the load is measured, not the first import
    import torch.distributed.checkpoint as dcp  # noqa: F401
    import transformers  # noqa: F401

    import distckpt.backends.hf_reader  # noqa: F401
    import distckpt.loading  # noqa: F401

    def run() -> None:
        if peer == "distckpt":
            distckpt.load(state, checkpoint_id=path)
            read["n"] = counter.total
        elif peer == "raw":
            read["n"] = _raw(state, path)
        elif peer == "dcp-hf":
            import torch.distributed.checkpoint as dcp

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(path))
        elif peer == "from_pretrained":
            import transformers

            full = {}
            if rank == 0:
                full = transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).state_dict()
            set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
            full = None
        else:
            raise ValueError(peer)

    dist.barrier()
    t0 = time.perf_counter()
    sample = measure(run, local_bytes)
    dist.barrier()
    span = time.perf_counter() - t0
    state = get_model_state_dict(model)
    fingerprint = sum(float(v.to_local().double().sum()) for v in state.values())
    return {"wall_s": sample.wall_s, "span_s": span, "cpu_s": sample.cpu_s, "peak_rss_delta_mb": sample.peak_rss_delta_mb,
            "read_bytes": read["n"], "local_bytes": local_bytes, "fingerprint": fingerprint}
