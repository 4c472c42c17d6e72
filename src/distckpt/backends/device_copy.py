"""Moving tensor bytes between accelerator memory and the host for the I/O engine.

On CUDA, copies go through pinned host memory: a device-to-host copy into a
pinned buffer runs at the bus's speed and can be queued without waiting
(``non_blocking``), where a copy into ordinary pageable memory is staged by the
driver and, on a fresh allocation, also pays for every first-touched page.
Pinned buffers come from torch's caching host allocator, so repeated saves and
loads reuse them instead of pinning memory again. Copies are queued on the
calling thread's current stream, which orders them after the kernels already
queued there (the ones that produced the tensors), and :class:`PendingCopies`
waits for them before anyone reads or reuses the host bytes.

Other accelerators take the plain synchronous path.
"""

from __future__ import annotations

import torch


def uses_pinned(device: torch.device) -> bool:
    """Whether copies to and from ``device`` go through pinned host buffers."""
    return device.type == "cuda" and torch.cuda.is_available()


class PendingCopies:
    """Streams with queued copies between pinned host memory and a device; ``wait`` waits for them all."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def __bool__(self) -> bool:
        return bool(self._streams)

    def note(self, device: torch.device) -> None:
        if device not in self._streams:
            self._streams[device] = torch.cuda.current_stream(device)

    def wait(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()
        self._streams.clear()


def to_host(tensor: torch.Tensor, dtype: torch.dtype, pending: PendingCopies) -> torch.Tensor:
    """A contiguous host copy of ``tensor`` as ``dtype``.

    From a CUDA tensor the copy lands in pinned memory and is only queued: the
    caller must ``pending.wait()`` before reading it.
    """
    src = tensor.detach()
    if uses_pinned(src.device):
        out = torch.empty(src.shape, dtype=dtype, pin_memory=True)
        out.copy_(src, non_blocking=True)  # converts dtype and layout on the way
        pending.note(src.device)
        return out
    return src.to(device="cpu", dtype=dtype).contiguous()


def host_buffer(nbytes: int, for_device: torch.device) -> torch.Tensor:
    """A host byte buffer for reading data that goes to ``for_device`` (pinned for CUDA)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=uses_pinned(for_device))


def to_device(dest: torch.Tensor, src: torch.Tensor, pending: PendingCopies) -> None:
    """Copy host tensor ``src`` into device tensor ``dest``; queued when ``src`` is pinned."""
    if uses_pinned(dest.device) and src.is_pinned():
        dest.copy_(src, non_blocking=True)
        pending.note(dest.device)
    else:
        dest.copy_(src)
