"""Moving tensor bytes between accelerator memory and the host for the I/O engine.

On CUDA, copies go through pinned host memory: a device-to-host copy into a
pinned buffer runs at the bus's speed and can be queued without waiting
(``non_blocking``), where a copy into ordinary pageable memory is staged by the
driver and, on a fresh allocation, also pays for every first-touched page.
Pinned buffers come from torch's caching host allocator, so repeated saves and
loads reuse them instead of pinning memory again. Copies are queued on the
stream that was current in the thread that called save or load, which orders
them after the kernels already queued there (the ones that produced the
tensors), and :class:`PendingCopies` waits for them before anyone reads or
reuses the host bytes.

Other accelerators take the plain synchronous path.
"""

from __future__ import annotations

from typing import Optional

import torch


def uses_pinned(device: torch.device) -> bool:
    """Whether copies to and from ``device`` go through pinned host buffers."""
    return device.type == "cuda" and torch.cuda.is_available()


def caller_streams() -> dict:
    """The calling thread's current stream on its current CUDA device, for copies made on its behalf.

    The I/O engine copies in worker threads, whose current stream is the
    device's default one. A caller working under another stream (``with
    torch.cuda.stream(s): distckpt.save(...)``) has its tensors produced on
    that stream, so the copies must be ordered on it, as they would be had
    the caller made them itself.
    """
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    device = torch.device("cuda", torch.cuda.current_device())
    return {device: torch.cuda.current_stream(device)}


class PendingCopies:
    """Copies between pinned host memory and devices, queued on streams; ``wait`` waits for them all.

    ``streams`` maps a device to the stream its copies go on (see
    :func:`caller_streams`); other devices use the thread's current stream.
    """

    def __init__(self, streams: Optional[dict] = None) -> None:
        self._streams = streams or {}
        self._used: dict[int, torch.cuda.Stream] = {}

    def __bool__(self) -> bool:
        return bool(self._used)

    def stream_for(self, device: torch.device) -> "torch.cuda.Stream":
        stream = self._streams.get(device)
        return stream if stream is not None else torch.cuda.current_stream(device)

    def note(self, stream: "torch.cuda.Stream") -> None:
        self._used.setdefault(id(stream), stream)

    def wait(self) -> None:
        for stream in self._used.values():
            stream.synchronize()
        self._used.clear()


def to_host(tensor: torch.Tensor, dtype: torch.dtype, pending: PendingCopies) -> torch.Tensor:
    """A contiguous host copy of ``tensor`` as ``dtype``.

    From a CUDA tensor the copy lands in pinned memory and is only queued: the
    caller must ``pending.wait()`` before reading it.
    """
    src = tensor.detach()
    if uses_pinned(src.device):
        out = torch.empty(src.shape, dtype=dtype, pin_memory=True)
        stream = pending.stream_for(src.device)
        with torch.cuda.stream(stream):
            out.copy_(src, non_blocking=True)  # converts dtype and layout on the way
        pending.note(stream)
        return out
    return src.to(device="cpu", dtype=dtype).contiguous()


def host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """A host byte buffer, pinned for data on its way to a CUDA device."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


def to_device(dest: torch.Tensor, src: torch.Tensor, pending: PendingCopies) -> None:
    """Copy host tensor ``src`` into device tensor ``dest``; queued when ``src`` is pinned."""
    if uses_pinned(dest.device) and src.is_pinned():
        stream = pending.stream_for(dest.device)
        with torch.cuda.stream(stream):
            dest.copy_(src, non_blocking=True)
        pending.note(stream)
    else:
        dest.copy_(src)


def pin_in_place(buffer: torch.Tensor) -> bool:
    """Page-lock ``buffer``'s memory where it lies (cudaHostRegister); False if the driver refuses.

    A refusal leaves nothing behind: see :func:`_clear_cuda_error`.
    """
    portable = 1  # registered for every CUDA context
    code = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel() * buffer.element_size(), portable))
    if code != 0:
        _clear_cuda_error()
    return code == 0


def unpin_in_place(buffer: torch.Tensor) -> None:
    """Undo :func:`pin_in_place`."""
    if int(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())) != 0:
        _clear_cuda_error()


def _clear_cuda_error() -> None:
    """Reset the calling thread's CUDA "last error" after a runtime call failed.

    torch's bindings of cudaHostRegister/Unregister hand back the failure's
    code but leave the runtime's per-thread last error set, so the check after
    the next kernel launch in this thread, anywhere in the training code, would
    raise it. That check reads and resets the last error; one small kernel
    launched here takes the stale error with it, and its exception is dropped.
    """
    try:
        torch.ones(1, device="cuda")
    except RuntimeError:
        pass
