"""Byte views of tensors, without copies where the memory allows it."""

from __future__ import annotations

import torch


def host_bytes(tensor: torch.Tensor) -> memoryview:
    """A flat byte view of ``tensor``'s elements on the host.

    Contiguous CPU tensors are viewed in place (zero copy); device tensors are
    copied to host memory first, non-contiguous ones are compacted.
    """
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if not t.is_contiguous():
        t = t.contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def writable_bytes(tensor: torch.Tensor) -> memoryview | None:
    """A writable flat byte view of ``tensor`` if it is a contiguous CPU tensor, else None."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")
