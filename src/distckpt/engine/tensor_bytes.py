"""Byte views of tensor memory, without copies where the memory allows it.

The views go through numpy, which costs a microsecond or two per tensor: a
ctypes array over the data pointer builds a new ctypes type for every distinct
size (about 21 us), and tens of thousands of small tensors made that a quarter
of a save. Dtypes numpy has are viewed as they are and cast to bytes; the
others (bfloat16, float8) through a uint8 view first. A view keeps its
tensor's memory alive.

A conjugate or negative view (``t.conj()``, ``torch._neg_view``) shares memory
that holds the un-conjugated values, so its raw bytes are not its elements:
such tensors are materialised before their bytes are taken, and are never
written to byte-wise.
"""

from __future__ import annotations

import ctypes
import sys

import torch

_EMPTY = memoryview(bytearray(0))
_NUMPY_DTYPES = frozenset((torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32,
                           torch.int64, torch.uint64, torch.float16, torch.float32, torch.float64, torch.complex64,
                           torch.complex128))


def flat_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous CPU tensor ``t`` (not a lazy view), writable, without a copy."""
    if t.numel() == 0:
        return _EMPTY
    if t.requires_grad:
        t = t.detach()
    if t.dtype in _NUMPY_DTYPES:
        return memoryview(t.numpy()).cast("B")
    return memoryview(t.view(-1).view(torch.uint8).numpy())


# this process's memory as one writable byte view (every user-space address is below sys.maxsize // 2): a slice
# at a tensor's data pointer is its bytes in a fraction of a microsecond, with no numpy array per tensor
_MEMORY = memoryview((ctypes.c_ubyte * (sys.maxsize // 2)).from_address(0)).cast("B")


def memory_at(address: int, nbytes: int) -> memoryview:
    """The ``nbytes`` bytes at ``address`` of this process's memory, writable. For the bytes of a contiguous
    CPU tensor (``t.data_ptr()``, ``nbytes`` at most its size), which the caller keeps alive while it uses them:
    the view holds no reference to the tensor, and nothing checks the range."""
    return _MEMORY[address:address + nbytes]


def is_lazy_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory holds something other than its elements (a conjugate or negative view)."""
    return tensor.is_conj() or tensor.is_neg()


def host_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s elements as a contiguous CPU tensor (itself when it already is one)."""
    if tensor.device.type != "cpu":
        tensor = tensor.detach().to("cpu")
    if is_lazy_view(tensor):
        tensor = tensor.detach().resolve_conj().resolve_neg()
    if not tensor.is_contiguous():
        return tensor.detach().contiguous()
    return tensor


def host_bytes(tensor: torch.Tensor) -> tuple[memoryview, torch.Tensor]:
    """A flat byte view of ``tensor``'s elements on the host, and the tensor that owns the bytes."""
    t = host_tensor(tensor)
    return flat_bytes(t), t


def writable_bytes(tensor: torch.Tensor) -> memoryview | None:
    """A writable flat byte view of ``tensor`` if it is a contiguous CPU tensor, else None."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or is_lazy_view(tensor):
        return None
    return flat_bytes(tensor)
