"""Rank bodies of the benchmark: each measures the peers in one process group, in turn."""

from __future__ import annotations

import os
import random
import shutil

import torch
import torch.distributed as dist

from distckpt.engine.windows import WINDOW_BYTES
from distckpt.format.checksum import crc32c

from .measure import best, drop_cache, measure, warm_memory
from .states import gpt_like, many_small, nbytes

PEERS = ("distckpt", "dcp", "torch.save", "safetensors", "raw")
# On disk, the disk's own sequential bandwidth, taken between the peers' rounds (the disk drifts: see docs/performance.md):
# through the page cache as dd measures it ("seq"), and around it with O_DIRECT ("direct"), as distckpt writes
DISK_PEERS = PEERS + ("seq", "direct")
_SEQ_PIECE = 64 << 20


def _local_state(total: int, world_size: int, rank: int, sharded: bool):
    """This rank's part of a GPT-like state: DTensors sharded on dim 0 (or plain tensors at 1 rank)."""
    shard = gpt_like(total // world_size, seed=rank)
    if world_size == 1 or not sharded:
        return shard, shard
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    dts = {k: DTensor.from_local(v, mesh, [Shard(0)], run_check=False,
                                 shape=torch.Size([v.shape[0] * world_size, *v.shape[1:]]),
                                 stride=None if v.dim() < 1 else _stride(v, world_size))
           for k, v in shard.items()}
    return dts, shard


def _stride(v: torch.Tensor, ws: int):
    shape = [v.shape[0] * ws, *v.shape[1:]]
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def _blank(sd):
    out = {}
    for k, v in sd.items():
        if hasattr(v, "to_local"):
            from torch.distributed.tensor import DTensor

            out[k] = DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements, run_check=False,
                                        shape=v.shape, stride=v.stride())
        else:
            out[k] = torch.zeros_like(v)
    return out


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    dfd = os.open(os.path.dirname(path), os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)


def _raw_views(tensors: dict) -> list[memoryview]:
    return [memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy()) for t in tensors.values()]


def _raw_io(local: dict, path: str, rank: int, write: bool, sequential: bool = False, checksum: bool = False) -> None:
    """The floor: this rank's tensor bytes written to (or read into) files with vectored I/O from as
    many threads as distckpt uses, one file per thread (tmpfs and many file systems serialise
    writes to one file), and nothing else: no format, checksum or metadata.

    ``sequential``: the disk's sequential bandwidth instead, as people measure it with dd: one
    thread, one file, 64 MiB at a time.

    ``checksum`` (reads): the floor of a verified load instead: the same reads in cache-sized
    windows, each CRC-32C'd right after it arrives, as cheaply as this checksum can be had."""
    from concurrent.futures import ThreadPoolExecutor

    import distckpt.knobs as knobs
    from distckpt.engine.write import split_runs

    views = _raw_views(local)
    # the same contiguous runs of tensors, one per thread and file, as distckpt's writer makes
    total = sum(len(v) for v in views)
    files = max(1, min(knobs.io_threads(), total // knobs.min_file_bytes()))
    parts = [[views[i] for i in group] for group in split_runs([len(v) for v in views], files)]
    if sequential:
        parts = [views]
    piece_bytes = _SEQ_PIECE if sequential else WINDOW_BYTES if checksum else 1 << 30
    threads = len(parts)
    if write:
        os.makedirs(path, exist_ok=True)

    def run(t: int) -> None:
        f = os.path.join(path, f"rank{rank}.{t}.{'seq' if sequential else 'raw'}")
        fd = os.open(f, (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY, 0o644)
        try:
            pos = 0
            for v in parts[t]:
                done = 0
                while done < len(v):
                    piece = v[done:done + piece_bytes]
                    got = os.pwrite(fd, piece, pos) if write else os.preadv(fd, [piece], pos)
                    if got <= 0:
                        raise OSError(f"short {'write' if write else 'read'} in {f}")
                    if checksum:
                        crc32c(piece[:got])
                    done += got
                    pos += got
            if write and knobs.fsync_enabled():
                os.fsync(fd)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(run, range(threads)))


def _direct_io(local: dict, path: str, rank: int, write: bool) -> None:
    """The disk's sequential bandwidth around the page cache: one thread, one file, O_DIRECT through a 64 MiB
    page-aligned buffer (tensor memory is not aligned for it), as ``dd oflag=direct``/``iflag=direct`` plus the copy
    between the buffer and the tensors."""
    import mmap

    import numpy as np

    views = _raw_views(local)
    total = sum(len(v) for v in views)
    buf = mmap.mmap(-1, _SEQ_PIECE)
    arr = np.frombuffer(buf, dtype=np.uint8)
    if write:
        os.makedirs(path, exist_ok=True)
    f = os.path.join(path, f"rank{rank}.direct")
    fd = os.open(f, (os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT) if write else (os.O_RDONLY | os.O_DIRECT), 0o644)
    try:
        pos = 0
        while pos < total:
            n = min(_SEQ_PIECE, total - pos)
            padded = -(-n // 4096) * 4096
            if write:
                _gather(views, pos, arr[:n])
                arr[n:padded] = 0
                os.pwrite(fd, memoryview(buf)[:padded], pos)
            else:
                got = os.preadv(fd, [memoryview(buf)[:padded]], pos)
                if got < n:
                    raise OSError(f"short read in {f}")
                _gather(views, pos, arr[:n], scatter=True)
            pos += n
        if write:
            os.ftruncate(fd, total)
            os.fsync(fd)
    finally:
        os.close(fd)
        del arr
        buf.close()


def _gather(views: list, pos: int, out, scatter: bool = False) -> None:
    """Copy the bytes at ``pos`` of the views laid end to end into ``out`` (or, with ``scatter``, back)."""
    import numpy as np

    start = 0
    for v in views:
        end = start + len(v)
        if end > pos and start < pos + len(out):
            a, b = max(start, pos), min(end, pos + len(out))
            src = np.frombuffer(v, dtype=np.uint8)[a - start:b - start]
            if scatter:
                src[...] = out[a - pos:b - pos]
            else:
                out[a - pos:b - pos] = src
        start = end


def _save(peer, sd, local, path, rank):
    if peer == "direct":
        _direct_io(local, path, rank, write=True)
    elif peer in ("raw", "seq"):
        _raw_io(local, path, rank, write=True, sequential=peer == "seq")
    elif peer == "distckpt":
        import distckpt

        distckpt.save(sd, checkpoint_id=path)
    elif peer == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save(sd, checkpoint_id=path)  # its FileSystemWriter fsyncs by default
    elif peer == "torch.save":
        os.makedirs(path, exist_ok=True)
        f = os.path.join(path, f"rank{rank}.pt")
        torch.save(local, f)
        _fsync_file(f)
    elif peer == "safetensors":
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        save_file(local, os.path.join(path, f"rank{rank}.safetensors"))
        _fsync_file(os.path.join(path, f"rank{rank}.safetensors"))


def _load(peer, dest, dest_local, path, rank):
    if peer == "direct":
        _direct_io(dest_local, path, rank, write=False)
    elif peer in ("raw", "seq", "raw+crc"):
        _raw_io(dest_local, path, rank, write=False, sequential=peer == "seq", checksum=peer == "raw+crc")
    elif peer == "distckpt":
        import distckpt

        distckpt.load(dest, checkpoint_id=path)
    elif peer == "unverified":  # distckpt without its checksums
        import distckpt

        distckpt.load(dest, storage_reader=distckpt.FileSystemReader(path, verify_checksums=False))
    elif peer == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.load(dest, checkpoint_id=path)
    elif peer == "torch.save":
        got = torch.load(os.path.join(path, f"rank{rank}.pt"), weights_only=True)
        for k, v in got.items():
            dest_local[k].copy_(v)
    elif peer == "safetensors":
        from safetensors.torch import load_file

        got = load_file(os.path.join(path, f"rank{rank}.safetensors"))
        for k, v in got.items():
            dest_local[k].copy_(v)


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def peers_round(rank, world_size, total, location, cold, repeat=1):
    """Save and load the GPT-like state with every peer, ``repeat`` rounds; the fastest of each (peer, op).

    Each round runs every peer once, in an order shuffled anew for each round (the same on every rank), so
    a slow spell of the machine (see docs/performance.md) falls on all peers alike instead of on
    whichever sits at a fixed place in the round.
    """
    sd, local = _local_state(total, world_size, rank, sharded=True)
    size = nbytes(local)
    runs: dict = {}
    for round_index in range(repeat):
        order = list(DISK_PEERS if cold else PEERS)
        random.Random(round_index).shuffle(order)
        for peer in order:
            path = os.path.join(location, f"{peer}-{world_size}")
            _barrier()
            os.sync()  # start from a quiet disk: no write-back of the previous peer's files
            _barrier()
            runs.setdefault((peer, "save"), []).append(measure(lambda: _save(peer, sd, local, path, rank), size))
            _barrier()
            dest = _blank(sd)
            dest_local = {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in dest.items()}
            if cold and rank == 0:
                drop_cache(path)
            if cold:  # backed memory for the page cache the load fills, for every peer alike (see warm_memory)
                warm_memory(1.25 * size / (1 << 30))
            _barrier()
            runs.setdefault((peer, "load"), []).append(measure(lambda: _load(peer, dest, dest_local, path, rank), size))
            ok = all(torch.equal(dest_local[k], local[k]) for k in local)
            assert ok, f"{peer} loaded wrong data"
            dest = dest_local = None  # free before the next run
            # warm loads also without checksums (what the rest of the format costs) and the raw floor with them (what
            # verifying costs any format with this checksum): the two halves of distckpt's gap to the floor. Each
            # reads files saved anew right before it, as every load here does: on this VM the first read of freshly
            # written pages costs more than later reads (about 50 ms for 2 GiB), so a second load of the same files
            # would be flattered
            extra = {"distckpt": "unverified", "raw": "raw+crc"}.get(peer) if not cold else None
            if extra:
                _barrier()
                if rank == 0:
                    shutil.rmtree(path, ignore_errors=True)
                _barrier()
                _save(peer, sd, local, path, rank)
                dest = _blank(sd)
                dest_local = {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in dest.items()}
                _barrier()
                runs.setdefault((extra, "load"), []).append(measure(lambda: _load(extra, dest, dest_local, path, rank), size))
                assert all(torch.equal(dest_local[k], local[k]) for k in local), f"{extra} loaded wrong data"
                dest = dest_local = None
            _barrier()
            if rank == 0:  # one peer's files at a time
                shutil.rmtree(path, ignore_errors=True)
    return {f"{p}|{o}": best(v).as_dict() for (p, o), v in runs.items()}


def small_round(rank, world_size, count, location, repeat=1, tiny=False):
    """Many small tensors (1-64 KiB; with ``tiny``, 64 B-4 KiB) saved and loaded by distckpt, DCP and the raw
    floor (the same bytes with vectored I/O into as many files as distckpt writes, nothing else)."""
    sd = many_small(count, tiny=tiny)
    size = nbytes(sd)
    runs: dict = {}
    for _ in range(repeat):
        for peer in ("distckpt", "dcp", "raw"):  # alternating, as in peers_round
            path = os.path.join(location, f"small-{peer}")
            shutil.rmtree(path, ignore_errors=True)
            runs.setdefault(f"{peer}|save", []).append(measure(lambda: _save(peer, sd, sd, path, rank), size))
            dest = {k: torch.zeros_like(v) for k, v in sd.items()}
            runs.setdefault(f"{peer}|load", []).append(measure(lambda: _load(peer, dest, dest, path, rank), size))
            assert all(torch.equal(dest[k], sd[k]) for k in sd)
            shutil.rmtree(path, ignore_errors=True)
    return {k: best(v).as_dict() for k, v in runs.items()}


RESHARD_PEERS = ("distckpt", "dcp", "raw", "raw-read")


def reshard_save(rank, world_size, total, location):
    sd, local = _local_state(total, world_size, rank, sharded=True)
    for peer in RESHARD_PEERS:
        if peer == "raw-read":
            continue  # reads distckpt's files
        path = os.path.join(location, f"reshard-{peer}")
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        _barrier()
        if peer == "raw":  # each rank's shards back to back in one file, in key order
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, f"rank{rank}.raw"), "wb") as f:
                for v in _raw_views(local):
                    f.write(v)
        else:
            _save(peer, sd, sd, path, rank)
    return nbytes({k: v.to_local() for k, v in sd.items()})


def _raw_reshard_load(dest: dict, path: str, rank: int, world_size: int, saved_world: int) -> None:
    """The floor of a reshard load: the same bytes moved with no format, checksum, metadata or planning.

    The checkpoint is ``saved_world`` files of equal row shards (Shard(0)), back to back in key order.
    Where a destination takes whole rows of a saved shard, they are read straight into it (``preadv``);
    where it takes part of every row (Shard(1)), the saved file is mapped and the columns copied out of
    the page cache, which is what any reader does with rows narrower than a page.
    """
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    import distckpt.knobs as knobs

    fds = [os.open(os.path.join(path, f"rank{s}.raw"), os.O_RDONLY) for s in range(saved_world)]
    maps = [mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE) for fd in fds]
    jobs = []
    offset = 0
    src = None
    for k, d in dest.items():
        full = tuple(d.shape)
        local = d.to_local() if hasattr(d, "to_local") else d
        rows = full[0] // saved_world
        nbytes_shard = rows * int(torch.Size(full[1:]).numel()) * local.element_size()
        if world_size == 1 or local.dim() == 1:  # whole rows: dest rows [r0, r0 + n) of the full tensor
            r0 = rank * local.shape[0] if world_size > 1 else 0
            for s in range(saved_world):
                a, b = max(r0, s * rows), min(r0 + local.shape[0], (s + 1) * rows)
                if a < b:
                    row_bytes = nbytes_shard // rows
                    view = memoryview(local.narrow(0, a - r0, b - a).view(-1).view(torch.uint8).numpy())
                    jobs.append(("read", fds[s], view, offset + (a - s * rows) * row_bytes))
        else:  # Shard(1): columns [c0, c0 + n) of every row
            c0 = rank * local.shape[1]
            for s in range(saved_world):
                src = torch.frombuffer(maps[s], dtype=local.dtype, count=nbytes_shard // local.element_size(),
                                       offset=offset).view(rows, *full[1:])
                jobs.append(("copy", local.narrow(0, s * rows, rows), src.narrow(1, c0, local.shape[1]), None))
        offset += nbytes_shard

    def run(job):
        kind, a, b, at = job
        if kind == "read":
            _pread_all(a, b, at, path)
        else:
            a.copy_(b)

    try:
        with ThreadPoolExecutor(knobs.io_threads()) as pool:
            list(pool.map(run, jobs))
    finally:
        jobs = src = None  # views of the mappings, which cannot close while they live
        for m in maps:
            m.close()
        for fd in fds:
            os.close(fd)


def raw_read_places(dest: dict, path: str, rank: int, world_size: int) -> list[tuple]:
    """Where each byte :func:`_raw_read_reshard_load` moves lies in distckpt's checkpoint at ``path`` (from its
    metadata, read before the clock starts): ("rows", destination, file, offset, chunk rows, row bytes, (a, b),
    destination row) for rows [a, b) of a chunk read whole, ("cols", ..., None, destination row, first column)
    for a chunk whose rows each hold this rank's columns."""
    import distckpt
    from distckpt.metadata import MetadataIndex

    md = distckpt.read_metadata(path)
    items = md.storage_data.items
    places = []
    for key, d in dest.items():
        local = d.to_local() if hasattr(d, "to_local") else d
        row_bytes = int(torch.Size(d.shape[1:]).numel()) * local.element_size()
        for chunk in md.state_dict_metadata[key].chunks:
            info = items[MetadataIndex(key, chunk.offsets)]
            r0, n = chunk.offsets[0], chunk.sizes[0]
            if world_size == 1 or local.dim() == 1:
                first = rank * local.shape[0] if world_size > 1 else 0
                a, b = max(first, r0), min(first + local.shape[0], r0 + n)
                if a < b:
                    places.append(("rows", local, info.file, info.offset, n, row_bytes, (a - r0, b - r0), a - first, 0))
            else:
                places.append(("cols", local, info.file, info.offset, n, row_bytes, None, r0, rank * local.shape[1]))
    return places


def _raw_read_reshard_load(places: list[tuple], path: str) -> None:
    """The floor of a reshard load that reads files with ``preadv`` and never maps them (as distckpt, which must
    not die of SIGBUS when another process truncates a file it reads), with no checksum, check or planning:
    distckpt's own data files (:func:`raw_read_places`), whole rows straight into the destination; for Shard(1),
    every row of a chunk read through one reused buffer of about 8 MiB, and this rank's columns copied out of it.

    It reads the very files distckpt reads: on this VM the speed of reading a tmpfs file depends on the memory
    its pages landed in (a byte-identical copy of a data file read 16% faster than the file, and the raw row's
    own files 35% faster), so a floor measured on other files is no floor."""
    fds = {name: os.open(os.path.join(path, name), os.O_RDONLY) for name in {p[2] for p in places}}
    buf = None
    try:
        for kind, local, name, offset, rows, row_bytes, span, dest_row, col in places:
            if kind == "rows":
                a, b = span
                view = memoryview(local.narrow(0, dest_row, b - a).view(-1).view(torch.uint8).numpy())
                _pread_all(fds[name], view, offset + a * row_bytes, path)
                continue
            step = max(1, min(rows, (8 << 20) // row_bytes))
            if buf is None or buf.numel() < step * row_bytes:
                buf = torch.empty(step * row_bytes, dtype=torch.uint8)
            for r in range(0, rows, step):
                n = min(step, rows - r)
                _pread_all(fds[name], memoryview(buf[:n * row_bytes].numpy()), offset + r * row_bytes, path)
                src = buf[:n * row_bytes].view(local.dtype).view(n, row_bytes // local.element_size())
                local.narrow(0, dest_row + r, n).copy_(src.narrow(1, col, local.shape[1]))
    finally:
        for fd in fds.values():
            os.close(fd)


def _pread_all(fd: int, view: memoryview, at: int, path: str) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], at + done)
        if got <= 0:
            raise OSError(f"short read in {path}")
        done += got


def reshard_load(rank, world_size, total, location, saved_world, repeat=1):
    """Load the 2-rank checkpoint at this world size, with the other shard dim (Shard(1)) at >1 rank."""
    from torch.distributed.tensor import Shard

    full_shapes = {k: torch.Size([v.shape[0] * saved_world, *v.shape[1:]]) for k, v in gpt_like(total // saved_world, seed=0).items()}
    if world_size == 1:
        dest = {k: torch.zeros(s) for k, s in full_shapes.items()}
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import distribute_tensor

        mesh = init_device_mesh("cpu", (world_size,))
        dest = {k: distribute_tensor(torch.zeros(s), mesh, [Shard(1) if len(s) > 1 else Shard(0)]) for k, s in full_shapes.items()}
    size = sum(v.numel() * v.element_size() for v in dest.values()) // world_size
    runs: dict = {}
    expected = _reshard_expected(dest, total, saved_world, rank, world_size)
    for _ in range(repeat):
        for peer in RESHARD_PEERS:  # alternating, as in peers_round
            for v in dest.values():
                (v.to_local() if hasattr(v, "to_local") else v).zero_()
            path = os.path.join(location, f"reshard-{'distckpt' if peer == 'raw-read' else peer}")
            if peer == "raw":
                run = measure(lambda: _raw_reshard_load(dest, path, rank, world_size, saved_world), size)
            elif peer == "raw-read":
                places = raw_read_places(dest, path, rank, world_size)
                run = measure(lambda: _raw_read_reshard_load(places, path), size)
            else:
                run = measure(lambda: _load(peer, dest, None, path, rank), size)
            runs.setdefault(f"{peer}|load", []).append(run)
            got = {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in dest.items()}
            assert all(torch.equal(got[k], expected[k]) for k in got), f"{peer} resharded wrong data"
    return {k: best(v).as_dict() for k, v in runs.items()}


def _reshard_expected(dest: dict, total: int, saved_world: int, rank: int, world_size: int) -> dict:
    """What this rank's part of each tensor must hold after the reshard load (from the saved ranks' seeds)."""
    shards = [gpt_like(total // saved_world, seed=s) for s in range(saved_world)]
    out = {}
    for k, d in dest.items():
        full = torch.cat([sh[k] for sh in shards])
        if world_size == 1:
            out[k] = full
        else:
            local = d.to_local()
            dim = 1 if full.dim() > 1 else 0
            out[k] = full.narrow(dim, rank * local.shape[dim], local.shape[dim]).clone()
    return out


def async_round(rank, world_size, total, location, repeat=1):
    """async_save's blocking time against one in-memory copy, and its total time against a sync save.

    Sync and async saves alternate, ``repeat`` times, so both see the same disk state; the in-memory copy is
    taken in each round right before the async save, under the same conditions; the fastest runs are reported.
    """
    import distckpt

    sd = gpt_like(total)
    size = nbytes(sd)
    copies = {k: torch.empty_like(v).fill_(0) for k, v in sd.items()}  # preallocated, as the staging pool is
    memcpys = []
    out = {}
    path = os.path.join(location, "async")
    # the first async save allocates the staging pool; the measured ones show the steady state
    distckpt.async_save(sd, checkpoint_id=path + "-warm").result()
    shutil.rmtree(path + "-warm", ignore_errors=True)
    syncs, blocks, totals = [], [], []
    def run_sync():
        os.sync()
        syncs.append(measure(lambda: distckpt.save(sd, checkpoint_id=path + "-sync"), size))

    def run_async():
        os.sync()
        memcpys.append(measure(lambda: [copies[k].copy_(v) for k, v in sd.items()], size))
        handle = []
        blocking = measure(lambda: handle.append(distckpt.async_save(sd, checkpoint_id=path)), size)
        rest = measure(lambda: handle[0].result(), size)
        blocks.append(blocking)
        totals.append(type(blocking)(blocking.wall_s + rest.wall_s, blocking.cpu_s + rest.cpu_s,
                                     max(blocking.peak_rss_delta_mb, rest.peak_rss_delta_mb), size))

    for i in range(max(2, repeat)):  # alternate which goes first: the second one lands on fresh page-cache pages
        for p in (path, path + "-sync"):
            shutil.rmtree(p, ignore_errors=True)
        for step in ((run_sync, run_async) if i % 2 == 0 else (run_async, run_sync)):
            step()
    copies = None
    out["memcpy|copy"] = best(memcpys).as_dict()
    out["distckpt|save"] = best(syncs).as_dict()
    out["async|blocking"] = best(blocks).as_dict()
    out["async|total"] = best(totals).as_dict()
    for p in (path, path + "-sync"):
        shutil.rmtree(p, ignore_errors=True)
    out["train"] = _train_during_write(sd, path + "-train")
    return out


def _train_during_write(sd, path):
    """Steps per second of a compute loop on every core, alone and while an async save's write runs."""
    import time

    import distckpt

    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    a = torch.randn(512, 512)

    def rate(stop):
        n, t0 = 0, time.perf_counter()
        while not stop(t0):
            a @ a
            n += 1
        return n / (time.perf_counter() - t0)
    try:
        alone = rate(lambda t0: time.perf_counter() - t0 > 2.0)
        t0 = time.perf_counter()
        handle = distckpt.async_save(sd, checkpoint_id=path)
        during = rate(lambda _: handle.done())
        write = time.perf_counter() - t0
        handle.result()
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(path, ignore_errors=True)
    return {"alone_steps_per_s": alone, "during_steps_per_s": during, "write_s": write}
