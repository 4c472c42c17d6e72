"""What the tier sends between ranks: JSON reports to every rank, and checkpoint directories point to point.

Nothing here pickles: reports travel as UTF-8 JSON in byte tensors, directories as their files' bytes in chunks.
Chunks go through reusable buffers, read with ``preadv`` and written with ``pwrite``: gloo sending from or
receiving into memory-mapped tmpfs files ran several times slower than through plain memory (docs/tiers.md).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading
import uuid
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..errors import CheckpointError

__all__ = ["all_gather_json", "dir_manifest", "transfer", "Buffers", "commit_dir", "dir_bytes"]

_CHUNK = 64 << 20
_DEPTH = 3


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


class Buffers:
    """Reusable transfer buffers: ``depth`` chunks per stream, kept across transfers so that steady-state
    replication allocates nothing (fresh pages cost several times warm ones to touch). A chunk is no larger
    than the largest file a stream has carried."""

    def __init__(self, chunk_bytes: int = _CHUNK, depth: int = _DEPTH) -> None:
        self.chunk_bytes, self.depth = chunk_bytes, depth
        self._rings: list[list[torch.Tensor]] = []

    def rings(self, largest: list[int]) -> list[list[torch.Tensor]]:
        """One ring per stream, for streams whose largest files are ``largest``."""
        for i, size in enumerate(largest):
            need = max(1, min(self.chunk_bytes, size))
            if i == len(self._rings):
                self._rings.append([])
            if not self._rings[i] or self._rings[i][0].numel() < need:
                self._rings[i] = [torch.empty(need, dtype=torch.uint8) for _ in range(self.depth)]
        return self._rings[:len(largest)]


def _chunks(manifest: list[list[Any]], chunk: int) -> list[tuple[int, int, int]]:
    """``(file index, offset, length)`` of every message, file by file in manifest order: both ends compute the same
    list (every rank's Buffers has the same ``chunk_bytes``), whatever the size of their rings."""
    return [(i, off, min(chunk, size - off)) for i, (_, size) in enumerate(manifest) for off in range(0, size, chunk)]


def _send_stream(folder: str, manifest: list[list[Any]], dst: int, group: Any, ring: list[torch.Tensor], chunk: int) -> None:
    """Read the files of ``manifest`` chunk by chunk into ``ring`` and send each chunk; a buffer is refilled once its
    send is done. A file that cannot be read is sent as zeros, so that the receiver, which cannot be told
    mid-stream, finishes its plan (its copy then fails verification); the error is raised once all is sent."""
    pending: list[Any] = [None] * len(ring)
    fds: dict[int, int] = {}
    failure: Optional[BaseException] = None
    try:
        for k, (i, off, n) in enumerate(_chunks(manifest, chunk)):
            slot = k % len(ring)
            if pending[slot] is not None:
                pending[slot].wait()
            path = os.path.join(folder, manifest[i][0])
            view = memoryview(ring[slot].numpy())[:n]
            try:
                if i not in fds:
                    fds[i] = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                if os.preadv(fds[i], [view], off) != n:
                    raise CheckpointError(f"{path!r} became shorter while it was being sent; a tier step is never "
                                          "rewritten in place, so something else wrote to it")
            except (OSError, CheckpointError) as exc:
                failure = failure or exc
                ring[slot][:n].zero_()
            pending[slot] = dist.isend(ring[slot][:n], dst, group=group)
        for work in pending:
            if work is not None:
                work.wait()
    finally:
        for fd in fds.values():
            os.close(fd)
    if failure is not None:
        raise failure


def _recv_stream(tmp: str, manifest: list[list[Any]], src: int, group: Any, ring: list[torch.Tensor], chunk: int) -> None:
    """Receive the files of ``manifest`` chunk by chunk into ``ring``, writing each chunk to its file; a buffer takes
    the next chunk once its bytes are written."""
    plan = _chunks(manifest, chunk)
    fds: dict[int, int] = {}
    pending: dict[int, Any] = {}
    try:
        for i, (name, size) in enumerate(manifest):
            # a reused file (see _reuse) keeps its pages; every byte up to ``size`` is written below
            fds[i] = os.open(os.path.join(tmp, name), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            os.ftruncate(fds[i], size)
        for k in range(min(len(ring), len(plan))):
            pending[k] = dist.irecv(ring[k][:plan[k][2]], src, group=group)
        for k, (i, off, n) in enumerate(plan):
            slot = k % len(ring)
            pending.pop(k).wait()
            view = memoryview(ring[slot].numpy())[:n]
            done = 0
            while done < n:
                done += os.pwrite(fds[i], view[done:], off + done)
            nxt = k + len(ring)
            if nxt < len(plan):
                pending[nxt] = dist.irecv(ring[slot][:plan[nxt][2]], src, group=group)
    finally:
        for fd in fds.values():
            os.close(fd)


def _reuse(tmp: str, manifest: list[list[Any]]) -> None:
    """Give the files of a spare step (a dropped one, moved to ``tmp``) the names of ``manifest``, largest to
    largest, so that receiving overwrites pages the node already has instead of allocating and zeroing new ones;
    anything else in it goes."""
    found = []
    for name in os.listdir(tmp):
        path = os.path.join(tmp, name)
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode):
            staged = os.path.join(tmp, f".reuse-{len(found)}")
            os.rename(path, staged)
            found.append((st.st_size, staged))
        elif stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    found.sort(reverse=True)
    for (_, staged), (name, _) in zip(found, sorted(manifest, key=lambda e: -e[1])):
        os.rename(staged, os.path.join(tmp, name))
    for _, staged in found[len(manifest):]:
        os.unlink(staged)


def transfer(outgoing: list[tuple[str, list[list[Any]], int]],
             incoming: list[tuple[str, list[list[Any]], int, Optional[str]]], group: Any, buffers: Buffers) -> list[str]:
    """Send each ``(folder, manifest, dst)`` and receive each ``(parent, manifest, src, spare)``, all at once: one
    thread per stream, each pipelining file I/O with the network through its own ring of buffers (the network runs
    while a chunk is read or written). Each received directory lands in a new hidden directory under its ``parent``
    (made from ``spare``, a directory of the caller's whose files it may overwrite, where given); returns them in
    ``incoming`` order, to be put in place with :func:`commit_dir`. On any failure the hidden directories are
    removed and the first error is raised."""
    tmps = []
    try:
        for parent, manifest, _, spare in incoming:
            for name, _ in manifest:
                if os.sep in name or name in (".", "..") or name.startswith(".reuse-"):
                    raise CheckpointError(f"a peer sent the file name {name!r}; tier steps hold plain file names only")
            os.makedirs(parent, exist_ok=True)
            tmps.append(os.path.join(parent, f".incoming-{uuid.uuid4().hex}"))
            if spare and os.path.isdir(spare) and not os.path.islink(spare):
                os.rename(spare, tmps[-1])
                _reuse(tmps[-1], manifest)
            else:
                os.mkdir(tmps[-1])
        streams = [(_send_stream, folder, manifest, peer) for folder, manifest, peer in outgoing]
        streams += [(_recv_stream, tmp, manifest, peer) for tmp, (_, manifest, peer, _) in zip(tmps, incoming)]
        rings = buffers.rings([max((size for _, size in s[2]), default=0) for s in streams])
        errors: list[BaseException] = []

        def run(job: tuple, ring: list[torch.Tensor]) -> None:
            fn, folder, manifest, peer = job
            try:
                fn(folder, manifest, peer, group, ring, buffers.chunk_bytes)
            except BaseException as exc:  # noqa: BLE001 - raised by the caller below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(job, ring), name="distckpt-tier-transfer", daemon=True)
                   for job, ring in zip(streams, rings)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
    except BaseException:
        for tmp in tmps:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmps


def commit_dir(tmp: str, final: str) -> None:
    """Put ``tmp`` in place as ``final`` (replacing an older one) by renames: a reader sees the old or the new."""
    if os.path.lexists(final):
        old = f"{os.path.dirname(final)}/.replaced-{uuid.uuid4().hex}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
