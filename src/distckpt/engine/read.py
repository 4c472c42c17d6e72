"""The read engine: validate files, then read each stored chunk once, in parallel."""

from __future__ import annotations

import io
import threading
from collections import defaultdict
from operator import itemgetter
from typing import Any, Optional

import numpy as np
import torch

from .. import events, knobs
from ..capabilities import resolves_in_bulk
from ..errors import CheckpointError, CorruptCheckpointError, UnsupportedTensorError
from ..format.checksum import crc32c
from ..format.datafile import VALUE_FORM, check_header_entry, stored_form
from ..format.dtypes import itemsize
from ..format.expected_headers import expected_leads
from ..format.locations import ChunkLocations
from ..format.records import FileStorageData, ForeignStorageData, StorageInfo
from ..format.stream_transforms import codec_for
from ..format.tensor_table import stored_dtypes
from ..item_columns import BYTES, ReadColumns
from ..metadata import Metadata, MetadataIndex, TensorStorageMetadata
from ..planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from ..planning.resharding import volume
from ..progress import Progress
from .blobs import BlobReader, BlobStore
from .budget import ByteBudget
from .chunk_reads import ChunkShapes, check_checksum, copy_rows, read_exact, read_into, rows_meet
from .data_files import open_and_validate
from .device_copy import PendingCopies, caller_streams, host_buffer, uses_pinned
from .shared_delivery import SharedChunks, answer_failed
from .shared_reads import RECEIVE, Shares, exchange
from .tasks import run_lanes, split_lanes
from .tensor_bytes import memory_at, writable_bytes
from .windows import WINDOW_BYTES, windows


def read_items(store: BlobStore, md: Metadata, plan: LoadPlan, planner: LoadPlanner, checkpoint_id: str,
               *, verify: bool, threads: int, verified_elsewhere: set = frozenset(), is_coordinator: bool = True,
               extension_registry: Any = None, shares: Optional[Shares] = None) -> None:
    """Read every item of ``plan``.

    Stored chunks that one read item needs whole, into a contiguous CPU
    destination of the same dtype, are read straight into the destination;
    adjacent ones are batched into one vectored read. Any other chunk is read
    once into a buffer (within the memory budget) and copied to every
    destination that needs part of it: whole, to verify its checksum, unless
    it is in ``verified_elsewhere`` (another rank of this load verifies it;
    see shared_verification.py), in which case only the rows needed are read.
    Chunks stored through stream transforms are decoded by extensions that
    ``extension_registry`` rebuilds (format/stream_transforms.py).

    With ``shares`` (shared_reads.py), the chunks it names are read by one rank of the load and sent to the
    others first; a rank that fails before that still takes its part, sending its failure, so that no rank waits.
    """
    where = f"checkpoint {checkpoint_id!r}"
    try:
        read = Read(store, md, plan, planner, where, verify, verified_elsewhere, extension_registry, shares)
        read.open_files()
    except Exception as exc:
        if shares is not None:
            answer_failed(shares, exc)
        raise
    try:
        if shares is not None:
            read.exchange(shares)
        read.execute(threads, is_coordinator)
    finally:
        read.close()


# A chunk read straight into its destination: (fqn, chunk offsets, destination tensor, the destination's bytes,
# file, begin, length, crc32c, its ReadItem or None where commit_tensor does nothing)
_Direct = tuple
_FILE, _BEGIN, _LENGTH, _CRC = 4, 5, 6, 7


class Read:
    """One rank's read of a plan: the chunks it needs, where they are stored, and the steps that read them."""

    def __init__(self, store: BlobStore, md: Metadata, plan: LoadPlan, planner: LoadPlanner, where: str, verify: bool,
                 verified_elsewhere: set, registry: Any = None, shares: Optional[Shares] = None) -> None:
        self.store, self.md, self.planner, self.where, self.verify = store, md, planner, where, verify
        self.verified_elsewhere = verified_elsewhere
        self.fsd: FileStorageData = md.storage_data
        self.foreign = isinstance(self.fsd, ForeignStorageData)
        if self.foreign and any(info.crc32c is None for info in self.fsd.items.values()):
            self.verify = False  # another program's checkpoint without checksums: its layout checked what it could
        self.streams = caller_streams()  # copies to a device happen in worker threads, ordered on the caller's stream
        self.by_chunk: dict[MetadataIndex, list[ReadItem]] = defaultdict(list)
        self.infos: dict[MetadataIndex, StorageInfo] = {}
        self.chunk_shapes: dict[MetadataIndex, tuple[int, ...]] = {}
        self.codecs: dict = {}
        self.registry = registry  # rebuilds stream transforms (format/stream_transforms.py); None: the default one
        self.shapes = ChunkShapes(md)
        # whole chunks into whole destinations, straight from the planner's columns: (fqn, chunk offsets,
        # destination, shape, row of the chunk in ``locations``, destination offsets, stored dtype); everything
        # else goes through the tables above
        self.whole: list[tuple] = []
        cols = plan.items
        locations = self.fsd.items
        if (isinstance(cols, ReadColumns) and cols.intact and resolves_in_bulk(planner, "load")
                and isinstance(locations, ChunkLocations) and not locations.codecs):
            items = cols.general + [cols.column_item(i) for i, code in enumerate(cols.code) if code == BYTES]
            tensors = [i for i, code in enumerate(cols.code) if code != BYTES] if BYTES in cols.code else range(len(cols.code))
            fqns, offsets = [cols.fqn[i] for i in tensors], [cols.chunk_offsets[i] for i in tensors]
            rows = locations.rows(fqns, offsets)
            if None in rows:
                at = rows.index(None)
                raise CorruptCheckpointError(f"{where}: key {fqns[at]!r} chunk {list(offsets[at])} has no storage entry in "
                                             "the metadata")
            self.whole = list(zip(fqns, offsets, [cols.dest[i] for i in tensors], [cols.size[i] for i in tensors], rows,
                                  [cols.dest_offsets[i] for i in tensors], stored_dtypes(md.state_dict_metadata, fqns)))
        else:
            items = plan.items
        for item in items:
            self.by_chunk[item.storage_index].append(item)
        for index in list(self.by_chunk):
            self.add_chunk(index)
        # chunks another rank reads for this one, or this one for others (shared_reads.py): key -> the chunks stored
        # there (several where keys view one storage: a torch.save file's tied weights)
        self.shared: dict[tuple, list[MetadataIndex]] = {}
        self.shared_info: dict[tuple, StorageInfo] = {}
        self.preset: dict[int, torch.Tensor] = {}  # id(read item) -> its destination, for column items made items
        if shares is not None:
            self.take_shared(shares.roles)
        self.lock = threading.Lock()
        # half the budget for the threads' slab buffers, kept across chunks (slab_buffer); half for whole chunks
        # (decodes), rows too large for a thread's share of the first half, and the buffers of shared reads
        limit = knobs.memory_budget_bytes()
        self.budget = ByteBudget(max(1, limit // 2))
        self.slab_limit = max(1, limit - self.budget.limit)
        self.threads = 1
        self.per_thread = threading.local()
        self.blobs: dict[str, BlobReader] = {}
        self.extra: list[BlobReader] = []

    def add_chunk(self, index: MetadataIndex) -> None:
        """Find where the chunk ``index`` (which ``by_chunk`` lists) is stored, its shape and its codec."""
        items = self.by_chunk[index]
        info = self.fsd.items.get(index)
        shape = self.shapes.get(index) if items[0].type == LoadItemType.TENSOR else ()
        if info is None or shape is None:
            raise CorruptCheckpointError(f"{self.where}: key {index.fqn!r} chunk {list(index.offset or [])} has no storage "
                                         "entry in the metadata")
        self.infos[index], self.chunk_shapes[index] = info, shape
        if self.foreign and info.codec != "identity":
            self.codecs[index] = self.fsd.decoder(index, info, self.here(index))
        else:
            self.codecs[index] = codec_for(info.codec, self.registry, self.here(index))

    def take_shared(self, roles: dict) -> None:
        """Set apart the chunks ``roles`` names: column items among them become read items (with their
        destination preset); a chunk received from another rank is not opened here."""
        if self.whole:
            locations = self.fsd.items
            names = [name for name, _ in locations.file_list]
            keep = []
            for entry in self.whole:
                fqn, offsets, dest, size, row, at, _ = entry
                if not locations.length[row] or (names[locations.file_no[row]], locations.begin[row]) not in roles:
                    keep.append(entry)
                    continue
                index = MetadataIndex(fqn, offsets, 0)
                zeros = torch.Size([0] * len(size))
                item = ReadItem(LoadItemType.TENSOR, MetadataIndex(fqn, at), zeros, index, zeros, torch.Size(size))
                self.by_chunk[index].append(item)
                self.preset[id(item)] = dest
                self.add_chunk(index)
            self.whole = keep
        for index, info in list(self.infos.items()):
            role = roles.get((info.file, info.offset)) if info.length else None  # an empty chunk shares its offset
            if role is not None:
                key = (info.file, info.offset)
                known = self.shared_info.setdefault(key, info)
                if known.length != info.length:  # planned_chunks lists no such offset
                    raise CheckpointError(f"{self.here(index)}: shares file {info.file!r} offset {info.offset} with a "
                                          "chunk of another length, but the load planned to share it")
                self.shared.setdefault(key, []).append(index)
                if role == RECEIVE:
                    del self.infos[index]

    def exchange(self, shares: Shares) -> None:
        """Send and receive the shared chunks (shared_reads.py); raise the first failure of a chunk this rank
        needed, once every message has gone."""
        endpoint = SharedChunks(self, shares)
        try:
            whole = ByteBudget(knobs.memory_budget_bytes())  # before execute: no slab is kept yet
            exchange(shares, endpoint, whole.hold, whole.limit)
        except BaseException:
            endpoint.abandon()  # chunks copied in part, never checked whole: zeroed
            raise
        endpoint.raise_first()

    def here(self, index: MetadataIndex) -> str:
        chunk = f", chunk {list(index.offset)}" if index.offset is not None else ""
        return f"{self.where}: key {index.fqn!r}{chunk}"

    # ------------------------------------------------------------ before any destination is touched

    def open_files(self) -> None:
        """Open and validate every file read; check each chunk is what its file's header says (dtype, shape, place)."""
        spans: dict = {}
        locations = self.fsd.items
        names = {i.file for i in self.infos.values()}
        if self.whole:
            names |= {locations.file_list[n][0] for n in set(locations.file_no[w[4]] for w in self.whole)}
        leads = {} if self.foreign else expected_leads(self.md, names)
        self.blobs = open_and_validate(self.store, self.fsd, names, self.where, spans, leads)
        try:  # files whose header is the one the metadata implies (spans None) agree with it on every item
            for index, info in self.infos.items():
                file_spans = spans[info.file]
                if file_spans is None:
                    continue
                form = self.form(index)
                if form not in file_spans.get((info.offset, info.offset + info.length), ()):  # the error names the chunk
                    check_header_entry(file_spans, info.offset, info.length, form, f"{self.here(index)}, file {info.file!r}")
            by_number = [spans.get(name) for name, _ in locations.file_list] if self.whole else []
            if any(s is not None for s in by_number):
                file_no, begin, length = locations.file_no, locations.begin, locations.length
                for fqn, offsets, _, size, row, _, dtype in self.whole:
                    b, n, file_spans = begin[row], length[row], by_number[file_no[row]]
                    if file_spans is None:
                        continue
                    form = stored_form(dtype, size, n)
                    if form not in file_spans.get((b, b + n), ()):
                        name = locations.file_list[file_no[row]][0]
                        check_header_entry(file_spans, b, n, form, f"{self.here(MetadataIndex(fqn, offsets))}, file {name!r}")
        except BaseException:
            self.close()
            raise

    def form(self, index: MetadataIndex) -> tuple:
        """The header entry (dtype code, shape) a stored chunk must have."""
        info = self.infos[index]
        entry = self.md.state_dict_metadata.get(index.fqn)
        if isinstance(entry, TensorStorageMetadata) and self.codecs[index].identity:
            return stored_form(entry.properties.dtype, self.chunk_shapes[index], info.length)
        return (VALUE_FORM, (info.length,))

    def close(self) -> None:
        for b in list(self.blobs.values()) + self.extra:
            b.close()

    # ------------------------------------------------------------ what goes where

    def split_direct(self) -> tuple[list[_Direct], list[MetadataIndex]]:
        """In file order: chunks read straight into their destination, and chunks that go through a buffer."""
        direct: list[_Direct] = []
        buffered: list[MetadataIndex] = []
        sdm = self.md.state_dict_metadata
        add = direct.append
        whole = self.whole
        if whole:  # column items: their locations are rows of ChunkLocations, taken in file order
            locations = self.fsd.items
            names = [name for name, _ in locations.file_list]
            file_no, begin, length, crc = locations.file_no, locations.begin, locations.length, locations.crc
            rows = np.array([w[4] for w in whole], dtype=np.int64)
            order = np.lexsort((np.frombuffer(begin, dtype=np.int64)[rows], np.frombuffer(file_no, dtype=np.int64)[rows]))
            whole = [whole[i] for i in order.tolist()]
        checked = self.verified_elsewhere  # chunks checked already (by a prefetch as it read them): read unchecked
        for fqn, offsets, dest, size, row, at, dtype in whole:
            # the planner gave a destination of the chunk's shape; in place where it is host memory of the stored
            # dtype, whose bytes are then exactly the chunk's length (the job keeps ``dest`` alive while it reads)
            if dest.dtype == dtype and dest.is_cpu and dest.is_contiguous() and not dest.is_conj() and not dest.is_neg():
                n = length[row]  # the last None: commit_tensor does nothing (resolves_columns)
                want = None if checked and MetadataIndex(fqn, offsets) in checked else crc[row]
                add((fqn, offsets, dest, memory_at(dest.data_ptr(), n), names[file_no[row]], begin[row], n, want, None))
            else:  # another dtype, or memory not writable in place: the general path, through a buffer
                index = MetadataIndex(fqn, offsets, 0)
                zeros = torch.Size([0] * len(size))
                self.by_chunk[index].append(ReadItem(LoadItemType.TENSOR, MetadataIndex(fqn, at), zeros, index, zeros,
                                                     torch.Size(size)))
                self.add_chunk(index)
        in_order = len(direct)  # the column items, already in file order (by number, not by name)
        for index, info in sorted(self.infos.items(), key=lambda kv: (kv[1].file, kv[1].offset)):
            if (info.file, info.offset) in self.shared:
                continue  # sent to this rank, or read here and sent: by exchange()
            items, shape = self.by_chunk[index], self.chunk_shapes[index]
            if (items[0].type == LoadItemType.TENSOR and len(items) == 1 and tuple(items[0].lengths) == shape
                    and self.codecs[index].identity):
                dest = self.planner.resolve_tensor(items[0])
                same = dest.dtype == sdm[index.fqn].properties.dtype and tuple(dest.shape) == shape
                view = writable_bytes(dest) if same else None
                if view is not None:
                    want = None if index in checked else info.crc32c
                    add((index.fqn, index.offset, dest, view, info.file, info.offset, info.length, want, items[0]))
                    continue
            if self.row_ranges(index, items, shape, add):
                continue
            buffered.append(index)
        if len(direct) > in_order:  # runs of adjacent chunks are found in this order (tasks)
            direct.sort(key=itemgetter(_FILE, _BEGIN))
        return direct, buffered

    def row_ranges(self, index: MetadataIndex, items: list[ReadItem], shape: tuple, add) -> bool:
        """Where nothing of a chunk is checked on this rank (no checksum recorded, or another rank verifies it) and
        each item wants whole rows into host memory of the stored dtype, read each item's rows straight into its
        destination, as direct jobs without a checksum: no buffer, no copy, no byte read that is not needed.
        Returns whether it did."""
        if (self.verify and index not in self.verified_elsewhere) or not self.codecs[index].identity or not shape:
            return False
        if items[0].type != LoadItemType.TENSOR or any(
                any(item.storage_offsets[1:]) or tuple(item.lengths[1:]) != shape[1:] for item in items):
            return False
        info = self.infos[index]
        row_bytes = info.length // shape[0] if shape[0] else 0
        dtype = self.md.state_dict_metadata[index.fqn].properties.dtype
        jobs = []
        for item in items:
            dest = self.planner.resolve_tensor(item)
            view = writable_bytes(dest) if dest.dtype == dtype and tuple(dest.shape) == tuple(item.lengths) else None
            if view is None:
                return False
            begin = info.offset + item.storage_offsets[0] * row_bytes
            jobs.append((index.fqn, index.offset, dest, view, info.file, begin, len(view), None, item))
        for job in jobs:
            add(job)
        return True

    def tasks(self) -> list[tuple]:
        """(step, argument) pairs: runs of adjacent direct chunks up to ``io_batch_bytes``, then each buffered chunk."""
        direct, buffered = self.split_direct()
        tasks: list = []
        limit = knobs.io_batch_bytes()
        run: list = []
        total = 0
        for job in direct:
            if run:
                prev = run[-1]
                if prev[_FILE] != job[_FILE] or prev[_BEGIN] + prev[_LENGTH] != job[_BEGIN] or total + job[_LENGTH] > limit:
                    tasks.append((self.run_direct, run))
                    run, total = [], 0
            run.append(job)
            total += job[_LENGTH]
        if run:
            tasks.append((self.run_direct, run))
        tasks.extend((self.run_buffered, index) for index in buffered)
        return tasks

    def task_bytes(self, task: tuple, delivered: bool = False) -> int:
        """Bytes a task reads (or, ``delivered``, brings into destinations)."""
        fn, arg = task
        if fn == self.run_direct:
            return sum(job[_LENGTH] for job in arg)
        if delivered:
            return _item_bytes(self.md, self.by_chunk[arg], self.infos[arg])
        return self.infos[arg].length

    # ------------------------------------------------------------ execution

    def execute(self, threads: int, is_coordinator: bool, progress: Optional[Progress] = None) -> None:
        """Run every task in lanes: each file front to back on one thread at a time (see run_lanes)."""
        self.threads = max(1, threads)
        tasks = self.tasks()
        places = [(arg[0][_FILE], arg[0][_BEGIN]) if fn == self.run_direct else (self.infos[arg].file, self.infos[arg].offset)
                  for fn, arg in tasks]
        order = sorted(range(len(tasks)), key=places.__getitem__)
        lanes = split_lanes([places[i][0] for i in order], [self.task_bytes(tasks[i]) for i in order], threads)
        lanes = [(name, [order[i] for i in lane]) for name, lane in lanes]
        if progress is None and knobs.progress_mode() != "off":
            sizes = [self.task_bytes(t, delivered=True) for t in tasks]
            progress = Progress("load", sum(sizes), is_coordinator)
        elif progress is not None:
            sizes = [self.task_bytes(t) for t in tasks]
        if progress is None:
            progress = Progress("load", 0, is_coordinator)
            if events.observing():  # the phase's bytes, without counting each task as a progress report would
                events.add_bytes(sum(self.task_bytes(t, delivered=True) for t in tasks))
        else:
            tasks = [(_counted(fn, progress, n), arg) for (fn, arg), n in zip(tasks, sizes)]
        # a file read by several lanes gets a reader per lane: the kernel keeps read-ahead state per open file
        seen: set = set()
        self.own_reader = []
        for name, _ in lanes:
            self.own_reader.append(name in seen)
            seen.add(name)
        self.lanes = lanes
        weight = lambda arg: len(arg) if isinstance(arg, list) else len(self.by_chunk[arg])  # noqa: E731
        run_lanes([[(tasks[i][0], tasks[i][1], weight(tasks[i][1])) for i in lane] for _, lane in lanes], threads,
                  "distckpt-read", self.start_lane)
        progress.close()

    def start_lane(self, i: int) -> None:
        self.per_thread.readers = self.per_thread.cached = None
        if self.own_reader[i]:
            name = self.lanes[i][0]
            blob = self.store.open(name)
            with self.lock:
                self.extra.append(blob)
            if blob.size != self.blobs[name].size or blob.identity() != self.blobs[name].identity():
                raise CorruptCheckpointError(f"{self.where}, file {name!r}: changed while it was being read; it was replaced")
            self.per_thread.readers = {name: blob}

    def reader(self, name: str) -> BlobReader:
        """This lane's own reader of ``name`` where it has one, else the shared one."""
        own = getattr(self.per_thread, "readers", None)
        return own[name] if own and name in own else self.blobs[name]

    def slab_buffer(self, n: int, pinned: bool) -> torch.Tensor:
        """This thread's reusable read buffer: fresh pages for every chunk would cost page faults.

        Pinned when the bytes go on to a CUDA device, so that the copy there runs at the bus's speed.
        """
        name = "pinned" if pinned else "buf"
        buf = getattr(self.per_thread, name, None)
        if buf is None or buf.numel() < n:  # at its full size at once: grown step by step, the allocator (glibc's
            # arenas, torch's pinned cache, which also rounds up to a power of two) would keep every step
            buf = host_buffer(max(n, self.slab_bytes()), pinned)
            setattr(self.per_thread, name, buf)
        return buf[:n]

    def slab_bytes(self) -> int:
        """The size of each thread's kept slab buffer: its share of half the budget, at most DISTCKPT_READ_SLAB_BYTES,
        a power of two (as torch's pinned host allocator would round it up to)."""
        share = min(knobs.read_slab_bytes(), max(1, self.slab_limit // self.threads))
        return 1 << (share.bit_length() - 1)

    # ------------------------------------------------------------ the steps

    def direct_window(self, blob: BlobReader, views: list[memoryview], position: int) -> int:
        """How many bytes to read at a time into a direct batch.

        Where reads are cheap, a cache-sized window is read and checksummed while still in cache; where a
        lane's file is not in the page cache, each batch is one read: small reads that each wait for the
        disk leave it idle in between (docs/performance.md). Whether it is cached is asked once per lane:
        a non-blocking read starts read-ahead of its own.
        """
        total = sum(len(v) for v in views)
        if not (self.verify and blob.small_reads_are_cheap):
            return total
        if getattr(self.per_thread, "cached", None) is None:
            probe = [piece for _, piece in next(windows(views, WINDOW_BYTES))]
            got = blob.readv_cached(probe, position)
            self.per_thread.cached = got is None or got == sum(len(p) for p in probe)
        return WINDOW_BYTES if self.per_thread.cached else total

    def run_direct(self, batch: list[_Direct]) -> None:
        """Read adjacent chunks straight into their destinations with vectored reads, checksumming on the way."""
        first = batch[0]
        blob = self.reader(first[_FILE])
        views = [job[3] for job in batch]
        crcs = [0] * len(views)
        checked = self.verify and any(job[_CRC] is not None for job in batch)  # None: read partly, checked elsewhere
        position = first[_BEGIN]
        # unchecked bytes (a prefetch checked them) go in one read: windows only keep what a checksum reads in cache
        window = self.direct_window(blob, views, position) if checked else sum(len(v) for v in views)
        for pieces in windows(views, window):
            want = sum(len(piece) for _, piece in pieces)
            got = blob.readv([piece for _, piece in pieces], position)
            if got != want:
                here = self.here(MetadataIndex(first[0], first[1]))
                raise CorruptCheckpointError(f"{here}: file {first[_FILE]!r} ends at {position + got}, "
                                             f"before offset {position + want}; it is truncated")
            if checked:
                for j, piece in pieces:
                    if batch[j][_CRC] is not None:
                        crcs[j] = crc32c(piece, crcs[j])
            position += want
        if checked and crcs != [job[_CRC] or 0 for job in batch]:
            bad = [(job, crc) for job, crc in zip(batch, crcs) if job[_CRC] is not None and crc != job[_CRC]]
            job, got = bad[0]  # every chunk of the batch that failed is zeroed, not only the first
            check_checksum(self.verify, got, StorageInfo(job[_FILE], job[_BEGIN], job[_LENGTH], job[_CRC]),
                           self.here(MetadataIndex(job[0], job[1])), [job[2] for job, _ in bad])
        committed = [job for job in batch if job[8] is not None]
        if committed:
            with self.lock:
                for job in committed:
                    self.planner.commit_tensor(job[8], job[2])

    def run_buffered(self, index: MetadataIndex) -> None:
        """Read one chunk through a buffer into every destination that needs part of it."""
        items, info = self.by_chunk[index], self.infos[index]
        check = self.verify and index not in self.verified_elsewhere
        if items[0].type == LoadItemType.BYTE_IO:
            data = read_exact(self.reader(info.file), info.length, info.offset, self.here(index), info.file)
            check_checksum(check, crc32c(data), info, self.here(index))
            if not self.codecs[index].identity:
                data = bytes(self.codecs[index].decode(memoryview(data), -1, self.here(index)))
            with self.lock:
                self.planner.load_bytes(items[0], io.BytesIO(data))
            return
        dests = self.destinations(index)
        if not self.codecs[index].identity:
            self.decode_chunk(index, dests, check)
        elif info.length:  # nothing stored, nothing to copy
            self.stream_chunk(index, dests, check)
        with self.lock:
            for item, dest in zip(items, dests):
                self.planner.commit_tensor(item, dest)

    def destinations(self, index: MetadataIndex) -> list[torch.Tensor]:
        """The destination tensor of each read item of a chunk, checked to be real and of the item's shape."""
        items = self.by_chunk[index]
        with self.lock:
            dests = [self.preset[id(item)] if id(item) in self.preset else self.planner.resolve_tensor(item)
                     for item in items]
        length = self.fsd.items[index].length if index not in self.infos else self.infos[index].length
        for item, dest in zip(items, dests):
            if length and dest.device.type == "meta":  # planning on meta is fine; loading would drop data
                raise UnsupportedTensorError(
                    f"{self.here(index)}: the destination is on the meta device and has no memory to load into; "
                    "materialise it first (for a module: .to_empty(device=...)), or return a real tensor from resolve_tensor")
            if length and tuple(dest.shape) != tuple(item.lengths):
                raise CheckpointError(f"{self.here(index)}: resolve_tensor returned shape {tuple(dest.shape)}, the read "
                                      f"item needs {tuple(item.lengths)}")
        return dests

    def decode_chunk(self, index: MetadataIndex, dests: list[torch.Tensor], check: bool) -> None:
        """Read a chunk stored through a codec whole, check the stored bytes, decode, and copy out."""
        info, shape, items = self.infos[index], self.chunk_shapes[index], self.by_chunk[index]
        dtype = self.md.state_dict_metadata[index.fqn].properties.dtype
        nbytes = volume(shape) * itemsize(dtype)
        with self.budget.hold(info.length + nbytes):
            stored = read_exact(self.reader(info.file), info.length, info.offset, self.here(index), info.file)
            check_checksum(check, crc32c(stored), info, self.here(index), dests)
            whole = _whole_destination(items, dests, shape, dtype)
            if whole is not None:  # one destination, the whole chunk, in host memory: decoded straight into it
                self.codecs[index].decode_into(memoryview(stored), whole, self.here(index))
                return
            raw = self.codecs[index].decode(memoryview(stored), nbytes, self.here(index))
            raw = raw if isinstance(raw, memoryview) and not raw.readonly else bytearray(raw)  # the read buffer: no copy
            chunk = torch.frombuffer(raw, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
            chunk = chunk.view(dtype).reshape(shape)
            pending = PendingCopies(self.streams) if any(uses_pinned(d.device) for d in dests) else None
            for item, dest in zip(items, dests):
                copy_rows(item, dest, chunk, 0, shape[0] if shape else 1, shape, pending)
            if pending:
                pending.wait()

    def stream_chunk(self, index: MetadataIndex, dests: list[torch.Tensor], check: bool) -> None:
        """Stream a chunk through one reused buffer, a slab of whole rows at a time: every byte is read once,
        the checksum is computed on the way, memory stays bounded. With ``check`` off, only the rows some
        item needs are read."""
        items, info, shape = self.by_chunk[index], self.infos[index], self.chunk_shapes[index]
        rows, row_bytes = (shape[0], info.length // shape[0]) if shape else (1, info.length)
        slab_rows = max(1, min(rows, self.slab_bytes() // max(1, row_bytes)))
        kept = slab_rows * row_bytes <= self.slab_bytes()  # else a row larger than a thread's share: a buffer alone
        to_gpu = any(uses_pinned(dest.device) for dest in dests)
        pending = PendingCopies(self.streams) if to_gpu else None
        first, end = 0, rows
        if not check and shape:
            first = min(item.storage_offsets[0] for item in items)
            end = max(item.storage_offsets[0] + item.lengths[0] for item in items)
        crc = 0
        with self.budget.hold(0 if kept else slab_rows * row_bytes):
            buf = self.slab_buffer(slab_rows * row_bytes, to_gpu) if kept else host_buffer(slab_rows * row_bytes, to_gpu)
            for a in range(first, end, slab_rows):
                b = min(end, a + slab_rows)
                wanted = [(item, dest) for item, dest in zip(items, dests) if rows_meet(item, a, b, shape)]
                if wanted or check:
                    crc = self.read_slab(index, buf, a, b, row_bytes, wanted, check, crc, pending)
        check_checksum(check, crc, info, self.here(index), dests)

    def read_slab(self, index: MetadataIndex, buf: torch.Tensor, a: int, b: int, row_bytes: int, wanted: list,
                  check: bool, crc: int, pending: Optional[PendingCopies]) -> int:
        """Read rows [a, b) of a chunk into ``buf`` and copy them out; return the running checksum.

        Always into a buffer, never out of a mapping of the file: a file truncated by another process while
        mapped kills the process with SIGBUS instead of raising an error.
        """
        info, shape = self.infos[index], self.chunk_shapes[index]
        dtype = self.md.state_dict_metadata[index.fqn].properties.dtype
        n = (b - a) * row_bytes
        raw = memoryview(buf.numpy()).cast("B")[:n] if n else memoryview(bytearray(0))
        read_into(self.reader(info.file), raw, info.offset + a * row_bytes, self.here(index), info.file)
        try:
            data = buf[:n]
            slab = data.view(dtype).reshape(((b - a),) + tuple(shape[1:])) if shape else data.view(dtype).reshape(())
            # checksum a cache-sized run of rows, then copy from it while it is still in cache; not on the way
            # to a GPU, whose copy is DMA from the pinned slab, where smaller copies only add launches
            step = max(1, WINDOW_BYTES // max(1, row_bytes)) if check and shape and pending is None else b - a
            for c in range(a, b, step):
                d = min(b, c + step)
                if check:
                    crc = crc32c(raw[(c - a) * row_bytes:(d - a) * row_bytes], crc)
                part = slab.narrow(0, c - a, d - c) if shape else slab
                for item, dest in wanted:
                    if rows_meet(item, c, d, shape):
                        copy_rows(item, dest, part, c, d, shape, pending)
        finally:
            if pending:  # the next slab reuses the buffer
                pending.wait()
        return crc


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


def _whole_destination(items: list, dests: list, shape: tuple, dtype: torch.dtype) -> Optional[memoryview]:
    """The bytes of the one destination of a chunk, where it is the whole chunk in host memory, of its dtype."""
    if len(items) != 1 or not shape or tuple(items[0].lengths) != tuple(shape):
        return None
    dest = dests[0]
    if dest.dtype != dtype or tuple(dest.shape) != tuple(shape) or not dest.numel():
        return None
    return writable_bytes(dest)
