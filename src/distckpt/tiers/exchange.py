"""What the tier sends between ranks point to point: checkpoint directories, as their files' bytes in chunks.

Nothing here pickles; what the ranks agree on travels through the package's Coordinator (distributed.py).
On a tmpfs of huge pages, chunks go straight from and into the files' mapped pages, as fast as plain memory; over
4 KiB pages gloo runs slower that way than through reusable buffers read with ``preadv`` and written with
``pwrite``, so there the chunks go through those (docs/tiers.md).
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import threading
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import knobs
from ..backends.fs_objects import remove_tree
from ..errors import CheckpointError, CorruptCheckpointError

__all__ = ["dir_manifest", "transfer", "Buffers", "reuse_spare", "dir_bytes", "huge_pages", "map_file"]


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
    """How a rank's transfers move bytes, and the buffers they reuse. ``mapped``: send from and receive into the
    files' pages mapped whole (True), copy through rings of ``depth`` buffers of up to ``chunk_bytes`` (False), or
    map where the folder lies on a huge-page tmpfs (None, see :func:`huge_pages`). Rings are kept across
    transfers so that steady-state replication allocates nothing (fresh pages cost several times warm ones to
    touch); a buffer is no larger than the largest file its stream has carried."""

    def __init__(self, chunk_bytes: Optional[int] = None, depth: Optional[int] = None, mapped: Optional[bool] = None) -> None:
        self.chunk_bytes = knobs.tier_chunk_bytes() if chunk_bytes is None else chunk_bytes
        self.depth, self.mapped = knobs.tier_transfer_depth() if depth is None else depth, mapped
        self._rings: list[list[torch.Tensor]] = []

    def maps(self, folder: Optional[str]) -> bool:
        if folder is None:  # nothing to map: a stream that only drains
            return False
        return huge_pages(folder) if self.mapped is None else self.mapped

    def rings(self, largest: list[Optional[int]]) -> list[list[torch.Tensor]]:
        """One ring per stream, for streams whose largest files are ``largest``; none for a stream given None."""
        for i, size in enumerate(largest):
            if i == len(self._rings):
                self._rings.append([])
            if size is None:
                continue
            need = max(1, min(self.chunk_bytes, size))
            if not self._rings[i] or self._rings[i][0].numel() < need:
                self._rings[i] = [torch.empty(need, dtype=torch.uint8) for _ in range(self.depth)]
        return [ring if size is not None else [] for ring, size in zip(self._rings, largest)]


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


def _recv_stream(tmp: Optional[str], manifest: list[list[Any]], src: int, group: Any, ring: list[torch.Tensor], chunk: int) -> None:
    """Receive the files of ``manifest`` chunk by chunk into ``ring``, writing each chunk to its file; a buffer takes
    the next chunk once its bytes are written. A file that cannot be created or written (a full tmpfs) still has its
    messages taken, and dropped, so that the sender finishes its list instead of waiting on this rank; the error is
    raised once all is through. With no folder (``tmp`` None: the receiving rank could not make one), every
    message is taken and dropped."""
    plan = _chunks(manifest, chunk)
    fds: dict[int, int] = {}
    pending: dict[int, Any] = {}
    failure: Optional[BaseException] = None
    if tmp is None:
        failure = CheckpointError("no folder to receive into (see the error before this transfer)")
    try:
        for i, (name, size) in enumerate(manifest if tmp is not None else []):
            try:
                # a reused file (see reuse_spare) keeps its pages; every byte up to ``size`` is written below
                fds[i] = os.open(os.path.join(tmp, name), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
                os.ftruncate(fds[i], size)
            except OSError as exc:
                failure = failure or exc
                break
        for k in range(min(len(ring), len(plan))):
            pending[k] = dist.irecv(ring[k][:plan[k][2]], src, group=group)
        for k, (i, off, n) in enumerate(plan):
            slot = k % len(ring)
            pending.pop(k).wait()
            if failure is None:
                view = memoryview(ring[slot].numpy())[:n]
                try:
                    done = 0
                    while done < n:
                        done += os.pwrite(fds[i], view[done:], off + done)
                except OSError as exc:
                    failure = exc
            nxt = k + len(ring)
            if nxt < len(plan):
                pending[nxt] = dist.irecv(ring[slot][:plan[nxt][2]], src, group=group)
    finally:
        for fd in fds.values():
            os.close(fd)
    if failure is not None:
        raise failure


def huge_pages(path: str) -> bool:
    """Whether ``path`` lies on a tmpfs that backs files with huge pages (mounted ``huge=always`` or
    ``huge=within_size``, or every tmpfs forced to by the kernel). There, gloo sends from and receives into mapped
    files as fast as through plain memory; over 4 KiB pages it runs slower than copying through buffers."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            policy = f.read()
        with open("/proc/self/mountinfo") as f:
            mounts = f.read().splitlines()
    except OSError:
        return False
    if "[deny]" in policy:
        return False
    real = os.path.realpath(path)
    best, fstype, options = "", "", ""
    for line in mounts:  # "id parent dev root point options [tags] - fstype source super-options"
        head, _, tail = line.partition(" - ")
        fields, rest = head.split(" "), tail.split(" ")
        if len(fields) < 5 or len(rest) < 3:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, fstype, options = point, rest[0], rest[2]
    if fstype != "tmpfs":
        return False
    huge = {o.split("=", 1)[1] for o in options.split(",") if o.startswith("huge=")}
    return bool(huge & {"always", "within_size"}) or "[force]" in policy


def map_file(path: str, size: int, receive: bool = False) -> Optional[mmap.mmap]:
    """``path`` mapped whole (None when it is empty): shared and writable to receive into, private (never written)
    to read from. A file to receive into is cut to ``size`` and has its pages reserved first, so that a full tmpfs
    fails here with ENOSPC instead of with SIGBUS when a byte lands; a file to read must be a regular file of
    ``size`` bytes (a tier's files are never rewritten in place, so anything else means something changed it)."""
    fd = os.open(path, (os.O_RDWR | os.O_CREAT if receive else os.O_RDONLY) | os.O_NOFOLLOW, 0o600)
    try:
        if receive:
            os.ftruncate(fd, size)
            if size:
                os.posix_fallocate(fd, 0, size)
        else:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                raise CorruptCheckpointError(f"{path!r} is not a regular file of the {size} bytes recorded for it; a "
                                             "tier step is never rewritten in place, so something else changed it")
        if not size:
            return None
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED if receive else mmap.MAP_PRIVATE,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _mapped_stream(folder: str, manifest: list[list[Any]], peer: int, group: Any, depth: int, chunk: int,
                   receive: bool) -> None:
    """Send the files of ``manifest`` from, or receive them into, their pages mapped whole: no copy between the
    file and the network beyond the socket's own; up to ``depth`` messages in flight. A file that cannot be mapped
    still has its messages sent (zeros) or taken (and dropped), so that the peer finishes its list; the error is
    raised once all is through."""
    maps: list[mmap.mmap] = []
    views: list[Optional[torch.Tensor]] = []
    failure: Optional[BaseException] = None
    try:
        for name, size in manifest:
            try:
                m = map_file(os.path.join(folder, name), size, receive)
            except (OSError, CheckpointError) as exc:
                failure, m = failure or exc, None
            if m is not None:
                maps.append(m)
            views.append(torch.frombuffer(m, dtype=torch.uint8) if m is not None else None)
        scratch = torch.zeros(chunk if failure is not None else 0, dtype=torch.uint8)
        op = dist.irecv if receive else dist.isend
        pending: list[Any] = []
        for i, off, n in _chunks(manifest, chunk):
            if len(pending) == depth:
                pending.pop(0).wait()
            view = views[i]
            pending.append(op(view[off:off + n] if view is not None else scratch[:n], peer, group=group))
        for work in pending:
            work.wait()
    finally:
        views.clear()
        for m in maps:
            try:
                m.close()
            except BufferError:  # a tensor over it is still held (a message that failed): unmapped when it goes
                pass
    if failure is not None:
        raise failure


def reuse_spare(spare: str, tmp: str, manifest: list[list[Any]]) -> None:
    """Move the spare step ``spare`` (a dropped one, kept for its pages) to ``tmp`` and give its files the names of
    ``manifest``, largest to largest, so that receiving overwrites pages the node already has instead of allocating
    and zeroing new ones; anything else in it goes (through the package's no-follow deletion)."""
    os.rename(spare, tmp)
    found = []
    for name in os.listdir(tmp):
        path = os.path.join(tmp, name)
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode):
            staged = os.path.join(tmp, f".reuse-{len(found)}")
            os.rename(path, staged)
            found.append((st.st_size, staged))
        elif stat.S_ISDIR(st.st_mode):
            remove_tree(path)
        else:
            os.unlink(path)
    found.sort(reverse=True)
    for (_, staged), (name, _) in zip(found, sorted(manifest, key=lambda e: -e[1])):
        os.rename(staged, os.path.join(tmp, name))
    for _, staged in found[len(manifest):]:
        os.unlink(staged)


def check_names(manifest: list[list[Any]]) -> None:
    """A manifest a peer sent names plain files only."""
    for name, size in manifest:
        if (not isinstance(name, str) or not name or os.sep in name or "\0" in name or name in (".", "..")
                or name.startswith(".") or type(size) is not int or size < 0):
            raise CheckpointError(f"a peer sent the file entry {[name, size]!r}; tier steps hold plain files only")


def transfer(outgoing: list[tuple[str, list[list[Any]], int]],
             incoming: list[tuple[Optional[str], list[list[Any]], int]], group: Any, buffers: Buffers) -> None:
    """Send each ``(folder, manifest, dst)`` and receive each ``(folder, manifest, src)`` into its folder (made by the
    caller, empty or holding a spare's files), all at once: one thread per stream, straight from or into the files'
    mapped pages, or pipelining file I/O with the network through its own ring of buffers (the network runs while
    a chunk is read or written), as ``buffers`` says. Every stream runs its whole list of messages, whatever fails
    on either end (an incoming folder of None only drains), so that no peer is left waiting; then the first
    error is raised, as a CheckpointError where it is not an OSError (gloo's own errors included)."""
    for _, manifest, _ in incoming:
        check_names(manifest)
    streams = [(_send_stream, folder, manifest, peer) for folder, manifest, peer in outgoing]
    streams += [(_recv_stream, folder, manifest, peer) for folder, manifest, peer in incoming]
    mapped = [buffers.maps(folder) for _, folder, _, _ in streams]
    rings = buffers.rings([None if m else max((size for _, size in s[2]), default=0) for s, m in zip(streams, mapped)])
    errors: list[BaseException] = []

    def run(job: tuple, ring: list[torch.Tensor]) -> None:
        fn, folder, manifest, peer = job
        try:
            if not ring:
                _mapped_stream(folder, manifest, peer, group, buffers.depth, buffers.chunk_bytes, fn is _recv_stream)
            else:
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
        first = errors[0]
        if isinstance(first, (CheckpointError, OSError)):
            raise first
        raise CheckpointError(f"a transfer between ranks failed: {first}") from first
