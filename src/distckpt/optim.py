"""Helpers for optimizers, whose state exists only after the first step."""

from __future__ import annotations

import torch

__all__ = ["init_optimizer_state"]


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create an optimizer's per-parameter state without changing any parameter.

    A fresh optimizer has empty state, so its state dict has nowhere to load a
    checkpoint's moments into. This runs one step with zero gradients and a
    learning rate of 0, then restores the learning rates and clears the
    gradients. Call it before ``distckpt.load`` when resuming; the load then
    overwrites every state value, the step counters included.
    """
    if optimizer.state:
        return
    saved = [group["lr"] for group in optimizer.param_groups]
    had_grad = {}
    for group in optimizer.param_groups:
        group["lr"] = 0.0 if not isinstance(group["lr"], torch.Tensor) else torch.zeros_like(group["lr"])
        for p in group["params"]:
            had_grad[p] = p.grad
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, saved):
            group["lr"] = lr
        for p, g in had_grad.items():
            p.grad = g
