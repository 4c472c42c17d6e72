"""What the tier sends between ranks: JSON reports to every rank, and checkpoint directories point to point.

Nothing here pickles: reports travel as UTF-8 JSON in byte tensors, directories as their files' bytes, received
straight into the files they become (memory-mapped, so a received byte is copied once).
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import stat
import uuid
import warnings
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CheckpointError

__all__ = ["all_gather_json", "dir_manifest", "send_dir", "recv_dir", "finish", "commit_dir", "dir_bytes"]


def all_gather_json(obj: Any, group: Any) -> list[Any]:
    """Every rank's ``obj`` (JSON-able), in rank order, on every rank of ``group``."""
    data = json.dumps(obj, sort_keys=True).encode()
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    everyone = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    return [json.loads(bytes(t[: int(n.item())].numpy())) for t, n in zip(everyone, sizes)]


def dir_manifest(path: str) -> list[list[Any]]:
    """``[[name, size], ...]`` of the regular files directly in ``path`` (sorted); anything else is refused."""
    out = []
    for name in sorted(os.listdir(path)):
        st = os.lstat(os.path.join(path, name))
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{os.path.join(path, name)!r} is not a regular file; a tier step holds only files "
                                  "distckpt wrote. Remove it")
        out.append([name, st.st_size])
    return out


def dir_bytes(path: str) -> int:
    return sum(size for _, size in dir_manifest(path))


def _mapped(path: str, size: int, writable: bool) -> tuple[Any, torch.Tensor]:
    fd = os.open(path, (os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW) if writable else (os.O_RDONLY | os.O_NOFOLLOW), 0o644)
    try:
        if writable:
            os.ftruncate(fd, size)
        m = mmap.mmap(fd, size, prot=mmap.PROT_READ | mmap.PROT_WRITE if writable else mmap.PROT_READ,
                      flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    if writable:
        return m, torch.frombuffer(m, dtype=torch.uint8)
    with warnings.catch_warnings():  # the tensor is only sent, never written
        warnings.simplefilter("ignore", UserWarning)
        return m, torch.frombuffer(m, dtype=torch.uint8)


def send_dir(path: str, manifest: list[list[Any]], dst: int, group: Any) -> list[Any]:
    """Start sending the files of ``manifest`` to ``dst``; returns the work objects and buffers to keep alive."""
    keep: list[Any] = []
    for name, size in manifest:
        if size == 0:
            continue
        m, t = _mapped(os.path.join(path, name), size, writable=False)
        keep.append((dist.isend(t, dst, group=group), m, t))
    return keep


def recv_dir(parent: str, manifest: list[list[Any]], src: int, group: Any) -> tuple[str, list[Any]]:
    """Start receiving the files of ``manifest`` from ``src`` into a new hidden directory under ``parent``; returns
    it and the work objects (commit it with :func:`commit_dir` once they are done)."""
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".incoming-{uuid.uuid4().hex}")
    os.mkdir(tmp)
    keep: list[Any] = []
    for name, size in manifest:
        if os.sep in name or name in (".", ".."):
            raise CheckpointError(f"a peer sent the file name {name!r}; tier steps hold plain file names only")
        if size == 0:
            open(os.path.join(tmp, name), "xb").close()
            continue
        m, t = _mapped(os.path.join(tmp, name), size, writable=True)
        keep.append((dist.irecv(t, src, group=group), m, t))
    return tmp, keep


def finish(keep: list[Any]) -> None:
    """Wait for the transfers started by :func:`send_dir`/:func:`recv_dir` and unmap their files."""
    try:
        for work, _, _ in keep:
            work.wait()
    finally:
        maps = [m for _, m, _ in keep]
        keep.clear()  # the tensors go first: a map with live views cannot close
        for m in maps:
            try:
                m.close()
            except BufferError:
                pass


def commit_dir(tmp: str, final: str) -> None:
    """Put ``tmp`` in place as ``final`` (replacing an older one) by renames: a reader sees the old or the new."""
    if os.path.lexists(final):
        old = f"{os.path.dirname(final)}/.replaced-{uuid.uuid4().hex}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
