"""Synthetic training states: GPT-like layers, and many small tensors like optimizer state."""

from __future__ import annotations

import torch


def gpt_like(total_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Transformer-shaped fp32 weights adding up to about ``total_bytes``."""
    d = 1024 if total_bytes >= (256 << 20) else 128
    per_layer = (3 * d * d + d * d + 4 * d * d + 4 * d * d + 4 * d) * 4
    layers = max(1, total_bytes // per_layer)
    g = torch.Generator().manual_seed(seed)
    sd = {"embed.weight": torch.randn(256, d, generator=g)}
    for i in range(layers):
        p = f"layers.{i}."
        sd[p + "attn.qkv.weight"] = torch.randn(3 * d, d, generator=g)
        sd[p + "attn.proj.weight"] = torch.randn(d, d, generator=g)
        sd[p + "mlp.up.weight"] = torch.randn(4 * d, d, generator=g)
        sd[p + "mlp.down.weight"] = torch.randn(d, 4 * d, generator=g)
        sd[p + "ln1.weight"] = torch.ones(d)
        sd[p + "ln1.bias"] = torch.zeros(d)
        sd[p + "ln2.weight"] = torch.ones(d)
        sd[p + "ln2.bias"] = torch.zeros(d)
    return sd


def many_small(count: int, seed: int = 0, tiny: bool = False) -> dict[str, torch.Tensor]:
    """``count`` fp32 tensors of 1 to 64 KiB, like per-parameter optimizer state (``tiny``: 64 B to 4 KiB,
    like biases, norms and per-expert scalars)."""
    g = torch.Generator().manual_seed(seed)
    low, high = (16, 1024) if tiny else (256, 16 * 1024)
    sizes = torch.randint(low, high + 1, (count,), generator=g).tolist()
    return {f"state.{i}.exp_avg": torch.randn(n, generator=g) for i, n in enumerate(sizes)}


def nbytes(sd: dict) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())
