"""The read engine: validate files, then read each stored chunk once, in parallel."""

from __future__ import annotations

import io
import threading
from collections import defaultdict
from typing import Optional

import torch

from .. import knobs
from ..errors import CheckpointError, CorruptCheckpointError, UnsupportedTensorError
from ..format.checksum import crc32c
from ..format.datafile import VALUE_FORM, HeaderInfo, check_header_entry, header_spans, read_header, stored_form
from ..format.dtypes import itemsize
from ..format.records import FileStorageData, StorageInfo
from ..metadata import Metadata, MetadataIndex, TensorStorageMetadata
from ..planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from ..planning.resharding import volume
from ..progress import Progress
from .blobs import BlobReader, BlobStore
from .budget import ByteBudget
from .device_copy import PendingCopies, caller_streams, host_buffer, to_device, uses_pinned
from .tasks import run_lanes
from .tensor_bytes import writable_bytes
from .windows import WINDOW_BYTES, windows


def open_and_validate(store: BlobStore, fsd: FileStorageData, names, where: str,
                      spans: Optional[dict] = None) -> dict[str, BlobReader]:
    """Open the named data files and check size, header and save id of each, before anything is read
    into place; with ``spans``, put each file's header entries there (see :func:`header_spans`)."""
    blobs: dict[str, BlobReader] = {}
    try:
        for name in sorted(names):
            info = fsd.files.get(name)
            if info is None:
                raise CorruptCheckpointError(f"{where}: data file {name!r} is not listed in the metadata")
            blob = store.open(name)
            blobs[name] = blob
            here = f"{where}, file {name!r}"
            if blob.size != info.size:
                raise CorruptCheckpointError(
                    f"{here}: size is {blob.size} bytes, the metadata records {info.size}; the file is truncated or was replaced")
            header = _check_header(blob, info, fsd.save_id, here)
            if spans is not None:
                spans[name] = header_spans(header)
    except BaseException:
        for b in blobs.values():
            b.close()
        raise
    return blobs


def _check_header(blob: BlobReader, info, save_id: str, here: str) -> HeaderInfo:
    """Parse and check the header (every rule of docs/format.md, section 4), its save id and its CRC.

    A CRC that matches the metadata's is not enough: metadata and header may have been forged
    together, so the header is always parsed, and the load cross-checks each chunk against it.
    """
    header = read_header(blob.pread, blob.size, here)  # raises if malformed
    if header.save_id != save_id:
        raise CorruptCheckpointError(
            f"{here}: belongs to save {header.save_id}, but this checkpoint is save {save_id}; "
            "a file from another checkpoint was copied in. Restore the original file.")
    if header.lead_crc32c != info.header_crc32c:
        raise CorruptCheckpointError(
            f"{here}: header checksum mismatch (offset 0 to {header.data_start}): stored {info.header_crc32c:08x}, "
            f"computed {header.lead_crc32c:08x}. The file is damaged; restore it from a copy.")
    return header


def read_items(store: BlobStore, md: Metadata, plan: LoadPlan, planner: LoadPlanner, checkpoint_id: str,
               *, verify: bool, threads: int, verified_elsewhere: set = frozenset(), is_coordinator: bool = True) -> None:
    """Read every item of ``plan``.

    Stored chunks that one read item needs whole, into a contiguous CPU
    destination of the same dtype, are read straight into the destination;
    adjacent ones are batched into one vectored read. Any other chunk is read
    once into a buffer (within the memory budget) and copied to every
    destination that needs part of it: whole, to verify its checksum, unless
    it is in ``verified_elsewhere`` (another rank of this load verifies it;
    see shared_verification.py), in which case only the rows needed are read.
    """
    fsd: FileStorageData = md.storage_data
    where = f"checkpoint {checkpoint_id!r}"
    streams = caller_streams()  # copies to a device happen in worker threads, ordered on the caller's stream
    by_chunk: dict[MetadataIndex, list[ReadItem]] = defaultdict(list)
    for item in plan.items:
        by_chunk[item.storage_index].append(item)
    infos: dict[MetadataIndex, StorageInfo] = {}

    def here_of(index: MetadataIndex) -> str:
        chunk = f", chunk {list(index.offset)}" if index.offset is not None else ""
        return f"{where}: key {index.fqn!r}{chunk}"

    shapes = ChunkShapes(md)
    chunk_shapes: dict[MetadataIndex, tuple[int, ...]] = {}
    for index, items in by_chunk.items():
        info = fsd.items.get(index)
        shape = shapes.get(index) if items[0].type == LoadItemType.TENSOR else ()
        if info is None or shape is None:
            raise CorruptCheckpointError(f"{where}: key {index.fqn!r} chunk {list(index.offset or [])} has no storage entry "
                                         "in the metadata")
        infos[index] = info
        chunk_shapes[index] = shape
    spans: dict = {}
    blobs = open_and_validate(store, fsd, {i.file for i in infos.values()}, where, spans)
    for index, info in infos.items():  # each chunk is what its file's header says it is (dtype, shape, place)
        entry = md.state_dict_metadata.get(index.fqn)
        if isinstance(entry, TensorStorageMetadata):
            form = stored_form(entry.properties.dtype, chunk_shapes[index], info.length)
        else:
            form = (VALUE_FORM, (info.length,))
        try:
            check_header_entry(spans[info.file], info.offset, info.length, form, f"{here_of(index)}, file {info.file!r}")
        except BaseException:
            for b in blobs.values():
                b.close()
            raise
    lock = threading.Lock()
    budget = ByteBudget(knobs.memory_budget_bytes())
    per_thread = threading.local()

    def slab_buffer(n: int, pinned: bool) -> torch.Tensor:
        """This thread's reusable read buffer: fresh pages for every chunk would cost page faults.

        Pinned when the bytes go on to a CUDA device, so that the copy there runs at the bus's speed.
        """
        name = "pinned" if pinned else "buf"
        buf = getattr(per_thread, name, None)
        if buf is None or buf.numel() < n:
            buf = host_buffer(n, pinned)
            setattr(per_thread, name, buf)
        return buf[:n]

    def reader(name: str) -> BlobReader:
        """This lane's own reader of ``name`` where it has one (see lanes below), else the shared one."""
        own = getattr(per_thread, "readers", None)
        return own[name] if own and name in own else blobs[name]

    here = here_of

    # decide, in file order, which chunks go straight into their destination
    direct: list[tuple[MetadataIndex, torch.Tensor, memoryview]] = []  # and the destination's bytes
    buffered: list[MetadataIndex] = []
    for index in sorted(by_chunk, key=lambda ix: (infos[ix].file, infos[ix].offset)):
        items = by_chunk[index]
        if items[0].type == LoadItemType.TENSOR and len(items) == 1 and tuple(items[0].lengths) == chunk_shapes[index]:
            dest = planner.resolve_tensor(items[0])
            entry = md.state_dict_metadata[index.fqn]
            view = writable_bytes(dest) if dest.dtype == entry.properties.dtype and tuple(dest.shape) == chunk_shapes[index] else None
            if view is not None:
                direct.append((index, dest, view))
                continue
        buffered.append(index)

    def run_direct(batch: list[tuple[MetadataIndex, torch.Tensor, memoryview]]) -> None:
        first = infos[batch[0][0]]
        blob = reader(first.file)
        views = [view for _, _, view in batch]
        crcs = [0] * len(views)
        # where reads are cheap, read a cache-sized window and checksum it while it is still in cache;
        # but where a lane's file is not in the page cache, each batch is one read: small reads that
        # each wait for the disk leave it idle in between (see docs/performance.md). Whether it is
        # cached is asked once per lane: a non-blocking read starts read-ahead of its own, and one
        # per window or per batch cost more than it saved at 2 ranks.
        total = sum(len(v) for v in views)
        window = WINDOW_BYTES if verify and blob.small_reads_are_cheap else total
        position = first.offset
        if window == WINDOW_BYTES:
            if getattr(per_thread, "cached", None) is None:
                probe = [piece for _, piece in next(windows(views, window))]
                got = blob.readv_cached(probe, position)
                per_thread.cached = got is None or got == sum(len(p) for p in probe)
            if not per_thread.cached:
                window = total
        for pieces in windows(views, window):
            want = sum(len(piece) for _, piece in pieces)
            got = blob.readv([piece for _, piece in pieces], position)
            if got != want:
                raise CorruptCheckpointError(f"{here(batch[0][0])}: file {first.file!r} ends at {position + got}, before "
                                             f"offset {position + want}; it is truncated")
            if verify:
                for j, piece in pieces:
                    crcs[j] = crc32c(piece, crcs[j])
            position += want
        bad = [(index, dest, crc) for (index, dest, _), crc in zip(batch, crcs) if verify and crc != infos[index].crc32c]
        if bad:  # every chunk of the batch that failed is zeroed, not only the first
            _check(verify, bad[0][2], infos[bad[0][0]], here(bad[0][0]), [dest for _, dest, _ in bad])
        for index, dest, _ in batch:
            with lock:
                planner.commit_tensor(by_chunk[index][0], dest)

    def run_buffered(index: MetadataIndex) -> None:
        items = by_chunk[index]
        info = infos[index]
        blob = reader(info.file)
        check = verify and index not in verified_elsewhere
        if items[0].type == LoadItemType.BYTE_IO:
            data = _read_exact(blob, info.length, info.offset, here(index), info.file)
            _check(check, crc32c(data), info, here(index))
            with lock:
                planner.load_bytes(items[0], io.BytesIO(data))
            return
        dtype = md.state_dict_metadata[index.fqn].properties.dtype
        shape = chunk_shapes[index]
        with lock:
            dests = [planner.resolve_tensor(item) for item in items]
        if info.length == 0:  # nothing stored, nothing to copy
            with lock:
                for item, dest in zip(items, dests):
                    planner.commit_tensor(item, dest)
            return
        for item, dest in zip(items, dests):
            if dest.device.type == "meta":  # planning with meta tensors is fine; loading into one would drop the data
                raise UnsupportedTensorError(
                    f"{here(index)}: the destination is on the meta device and has no memory to load into; materialise "
                    "it first (for a module: .to_empty(device=...)), or return a real tensor from resolve_tensor")
            if tuple(dest.shape) != tuple(item.lengths):
                raise CheckpointError(f"{here(index)}: resolve_tensor returned shape {tuple(dest.shape)}, the read item "
                                      f"needs {tuple(item.lengths)}")
        if not shape or info.length == 0:
            rows, row_bytes = 1, info.length
        else:
            rows, row_bytes = shape[0], info.length // shape[0]
        # stream the chunk through one reused buffer, a slab of whole rows at a time:
        # every byte is read once, the checksum is computed on the way, memory stays bounded
        slab_rows = max(1, min(rows, min(knobs.read_slab_bytes(), budget.limit) // max(1, row_bytes)))
        to_gpu = any(uses_pinned(dest.device) for dest in dests)
        pending = PendingCopies(streams) if to_gpu else None
        # always read into a buffer, never copy out of a mapping of the file: a file truncated by
        # another process while mapped kills the process with SIGBUS instead of raising an error
        with budget.hold(slab_rows * row_bytes):
            buf = slab_buffer(slab_rows * row_bytes, to_gpu)
            crc = 0
            first, end = 0, rows
            if not check and shape:  # only the rows some item needs
                first = min(item.storage_offsets[0] for item in items)
                end = max(item.storage_offsets[0] + item.lengths[0] for item in items)
            for a in range(first, end, slab_rows):
                b = min(end, a + slab_rows)
                wanted = [(item, dest) for item, dest in zip(items, dests) if _rows_meet(item, a, b, shape)]
                if not wanted and not check:
                    continue
                n = (b - a) * row_bytes
                data = buf[:n]
                raw = memoryview(buf.numpy()).cast("B")[:n] if n else memoryview(bytearray(0))
                _read_into(blob, raw, info.offset + a * row_bytes, here(index), info.file)
                try:
                    slab = data.view(dtype).reshape(((b - a),) + tuple(shape[1:])) if shape else data.view(dtype).reshape(())
                    # checksum a cache-sized run of rows, then copy from it while it is still in cache; not
                    # on the way to a GPU, whose copy is DMA from the pinned slab, where smaller copies only
                    # add launches (H100, 2 GiB into GPU memory: 0.27 s whole slabs, 0.32 s in windows)
                    step = max(1, WINDOW_BYTES // max(1, row_bytes)) if check and shape and not to_gpu else b - a
                    for c in range(a, b, step):
                        d = min(b, c + step)
                        if check:
                            crc = crc32c(raw[(c - a) * row_bytes:(d - a) * row_bytes], crc)
                        part = slab.narrow(0, c - a, d - c) if shape else slab
                        for item, dest in wanted:
                            if _rows_meet(item, c, d, shape):
                                _copy_rows(item, dest, part, c, d, shape, pending)
                finally:
                    if pending:  # the next slab reuses the buffer
                        pending.wait()
            _check(check, crc, info, here(index), dests)
        with lock:
            for item, dest in zip(items, dests):
                planner.commit_tensor(item, dest)

    tasks: list = []
    limit = knobs.io_batch_bytes()
    run: list = []
    total = 0
    for job in direct:
        index = job[0]
        info = infos[index]
        if run:
            prev = infos[run[-1][0]]
            if prev.file != info.file or prev.offset + prev.length != info.offset or total + info.length > limit:
                tasks.append((run_direct, run))
                run, total = [], 0
        run.append(job)
        total += info.length
    if run:
        tasks.append((run_direct, run))
    tasks.extend((run_buffered, index) for index in buffered)
    first_chunk = [arg[0][0] if fn is run_direct else arg for fn, arg in tasks]
    stored = [sum(infos[index].length for index, _, _ in arg) if fn is run_direct else infos[arg].length for fn, arg in tasks]
    # each file is read front to back by one thread at a time (a lane); see run_lanes
    order = sorted(range(len(tasks)), key=lambda i: (infos[first_chunk[i]].file, infos[first_chunk[i]].offset))
    lanes = split_lanes([infos[first_chunk[i]].file for i in order], [stored[i] for i in order], threads)
    lanes = [(name, [order[i] for i in lane]) for name, lane in lanes]
    if knobs.progress_mode() != "off":
        sizes = [sum(infos[index].length for index, _, _ in arg) if fn is run_direct else _item_bytes(md, by_chunk[arg], infos[arg])
                 for fn, arg in tasks]
        progress = Progress("load", sum(sizes), is_coordinator)
        tasks = [(_counted(fn, progress, n), arg) for (fn, arg), n in zip(tasks, sizes)]
    else:
        progress = Progress("load", 0, is_coordinator)
    # a file read by several lanes gets a reader per lane: the kernel keeps read-ahead state per open file
    seen: set = set()
    own_reader = []
    for name, _ in lanes:
        own_reader.append(name in seen)
        seen.add(name)
    extra: list[BlobReader] = []

    def start_lane(i: int) -> None:
        per_thread.readers = per_thread.cached = None
        if own_reader[i]:
            name = lanes[i][0]
            blob = store.open(name)
            with lock:
                extra.append(blob)
            if blob.size != blobs[name].size:
                raise CorruptCheckpointError(f"{where}, file {name!r}: changed size while it was being read; it was replaced")
            per_thread.readers = {name: blob}

    try:
        run_lanes([[(tasks[i][0], tasks[i][1], len(tasks[i][1]) if isinstance(tasks[i][1], list) else len(by_chunk[tasks[i][1]]))
                    for i in lane] for _, lane in lanes], threads, "distckpt-read", start_lane)
        progress.close()
    finally:
        for b in list(blobs.values()) + extra:
            b.close()


def split_lanes(files: list[str], sizes: list[int], threads: int) -> list[tuple[str, list[int]]]:
    """Lanes over tasks given in file order: one per file, and where there are fewer files than
    threads, the largest lanes halved (by bytes, keeping file order) until every thread has one.

    Returns (file, task positions) per lane, in file order.
    """
    lanes: list[tuple[str, list[int]]] = []
    for i, name in enumerate(files):
        if lanes and lanes[-1][0] == name:
            lanes[-1][1].append(i)
        else:
            lanes.append((name, [i]))
    while len(lanes) < threads:
        splittable = [j for j, (_, lane) in enumerate(lanes) if len(lane) > 1]
        if not splittable:
            break
        j = max(splittable, key=lambda j: sum(sizes[i] for i in lanes[j][1]))
        name, lane = lanes[j]
        half, acc, cut = sum(sizes[i] for i in lane) / 2, 0, 1
        for k, i in enumerate(lane[:-1], start=1):
            acc += sizes[i]
            cut = k
            if acc >= half:
                break
        lanes[j:j + 1] = [(name, lane[:cut]), (name, lane[cut:])]
    return lanes


def _counted(fn, progress: Progress, n: int):
    """``fn``, then ``n`` bytes more done."""
    def run(arg) -> None:
        fn(arg)
        progress.advance(n)
    return run


def _item_bytes(md: Metadata, items: list, info: StorageInfo) -> int:
    """Bytes the read items of one buffered chunk bring into their destinations."""
    if items[0].type != LoadItemType.TENSOR:
        return info.length
    size = itemsize(md.state_dict_metadata[items[0].storage_index.fqn].properties.dtype)
    return sum(volume(item.lengths) * size for item in items)


def _rows_meet(item: ReadItem, a: int, b: int, shape: tuple) -> bool:
    if not shape:
        return True
    r0 = item.storage_offsets[0]
    return max(a, r0) < min(b, r0 + item.lengths[0])


def _copy_rows(item: ReadItem, dest: torch.Tensor, slab: torch.Tensor, a: int, b: int, shape: tuple,
               pending: PendingCopies | None) -> None:
    """Copy the part of ``item`` that lies in rows [a, b) of its chunk from ``slab`` into ``dest``.

    With ``pending``, a copy from a pinned slab to a device is only queued there.
    """
    if not shape:
        _copy(dest, slab, pending)
        return
    r0 = item.storage_offsets[0]
    lo, hi = max(a, r0), min(b, r0 + item.lengths[0])
    src = slab.narrow(0, lo - a, hi - lo)
    for dim in range(1, len(shape)):
        src = src.narrow(dim, item.storage_offsets[dim], item.lengths[dim])
    _copy(dest.narrow(0, lo - r0, hi - lo), src, pending)


def _copy(dest: torch.Tensor, src: torch.Tensor, pending: PendingCopies | None) -> None:
    if pending is None:
        dest.copy_(src)
    else:
        to_device(dest, src, pending)


class ChunkShapes:
    """Shapes of stored chunks, looked up by MetadataIndex.

    The ``index`` hint of a MetadataIndex (set by the load planners) finds the
    chunk directly; a key's chunks are scanned into a table only when a hint
    is missing or stale. So a load touches the metadata of the chunks it reads,
    not of every chunk of the checkpoint (at 1,024 ranks a table of all chunks
    took longer than decoding the metadata).
    """

    def __init__(self, md: Metadata) -> None:
        self.md = md
        self.tables: dict[str, dict] = {}

    def get(self, index: MetadataIndex) -> tuple[int, ...] | None:
        """The chunk's shape, or None if the metadata has no such chunk."""
        entry = self.md.state_dict_metadata.get(index.fqn)
        chunks = entry.chunks if isinstance(entry, TensorStorageMetadata) else None
        if not chunks:
            return None
        hint = index.index
        if hint is not None and 0 <= hint < len(chunks) and chunks[hint].offsets == index.offset:
            return tuple(chunks[hint].sizes)
        table = self.tables.get(index.fqn)
        if table is None:
            table = self.tables[index.fqn] = {tuple(c.offsets): tuple(c.sizes) for c in chunks}
        return table.get(tuple(index.offset or ()))


def _check(verify: bool, got: int, info: StorageInfo, here: str, dests: list = ()) -> None:
    """Raise if the checksum of a chunk read differs from the stored one, first zeroing ``dests``:
    bytes that failed their checksum never stay in the caller's tensors."""
    if verify and got != info.crc32c:
        for dest in dests:
            if isinstance(dest, torch.Tensor) and dest.device.type != "meta":
                dest.zero_()
        raise CorruptCheckpointError(
            f"{here}: checksum mismatch in file {info.file!r} at offset {info.offset} ({info.length} bytes): "
            f"stored {info.crc32c:08x}, computed {got:08x}. The data is damaged; restore the file from a copy.")


def _read_into(blob: BlobReader, view: memoryview, offset: int, here: str, file: str) -> None:
    got = blob.readinto(view, offset)
    if got != len(view):
        raise CorruptCheckpointError(f"{here}: file {file!r} ends at {offset + got}, before the {len(view)} bytes at offset "
                                     f"{offset}; it is truncated")


def _read_exact(blob: BlobReader, n: int, offset: int, here: str, file: str) -> bytes:
    buf = bytearray(n)
    _read_into(blob, memoryview(buf), offset, here, file)
    return bytes(buf)
