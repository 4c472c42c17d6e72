"""Byte views of tensor memory, without copies where the memory allows it.

The views are built from the tensor's data pointer (well under a microsecond,
which matters with tens of thousands of small tensors). They do not keep the
tensor alive: callers hold the tensor while they use the view.
"""

from __future__ import annotations

import ctypes

import torch

_EMPTY = memoryview(bytearray(0))


def _view(t: torch.Tensor) -> memoryview:
    n = t.numel() * t.element_size()
    if n == 0:
        return _EMPTY
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def host_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s elements as a contiguous CPU tensor (itself when it already is one)."""
    if tensor.device.type != "cpu":
        return tensor.detach().to("cpu")
    if not tensor.is_contiguous():
        return tensor.detach().contiguous()
    return tensor


def host_bytes(tensor: torch.Tensor) -> tuple[memoryview, torch.Tensor]:
    """A flat byte view of ``tensor``'s elements on the host, and the tensor that owns the bytes."""
    t = host_tensor(tensor)
    return _view(t), t


def writable_bytes(tensor: torch.Tensor) -> memoryview | None:
    """A writable flat byte view of ``tensor`` if it is a contiguous CPU tensor, else None."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    return _view(tensor)
