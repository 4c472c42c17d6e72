"""The write pipeline: one rank's items into data files over any BlobStore, from several threads."""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Container, Optional

import numpy as np
import torch

from .. import knobs
from ..capabilities import resolves_in_bulk
from ..errors import CheckpointError
from ..format.checksum import crc32c
from ..format.chunk_codec import IDENTITY, ChunkCodec
from ..format.datafile import VALUE_FORM, Entry, build_header, entry_name, stored_form
from ..format.dtypes import itemsize
from ..format.records import FileInfo, FileResult, StorageInfo
from ..item_columns import BYTES, ColumnResults, ResultColumns, WriteColumns
from ..planner import SavePlan, SavePlanner, WriteItemType
from ..planning.resharding import volume
from ..progress import Progress
from ..storage import WriteResult
from .blobs import BlobStore, BlobWriter
from .budget import ByteBudget
from .device_copy import PendingCopies, caller_streams, to_host
from .encoding import Encoding
from .filling import Filling
from .reuse import Reuse, Stored, chunk_key, digests, new_hasher
from .tensor_bytes import flat_bytes, host_bytes, is_lazy_view, memory_at
from .windows import windows

__all__ = ["write_file", "split_runs"]


_LINE = 64  # bytes: a cache line, and the alignment of torch's CPU allocations


def identity_codec(fqn: str) -> ChunkCodec:
    """Every item stored as it is (format 2.0)."""
    return IDENTITY


def write_file(store: BlobStore, name: str, save_id: str, rank: int, plan: SavePlan, planner: SavePlanner,
               *, threads: int, sync: bool, is_coordinator: bool = True,
               codec_of: Callable[[str], ChunkCodec] = identity_codec, reuse: Optional[Reuse] = None,
               filling: Optional[Filling] = None) -> list[WriteResult]:
    """Write one rank's items into data files; return a WriteResult per item, plus a FileResult per file.

    Items keep plan order and are split into up to ``threads`` contiguous runs
    of similar size (at least ``min_file_bytes`` each), one file per run, each
    written by its own thread: threads sharing one file contend on it in the
    kernel. Within a file, adjacent items go out in batches of about
    ``io_batch_bytes`` with one vectored write each, straight from tensor memory.
    An item whose key's ``codec_of`` is not the identity is encoded whole first, and stored as a byte entry.

    This is the engine's entry, where the save forks: a plan whose items are intact :class:`WriteColumns`,
    from a planner that declares :func:`~distckpt.capabilities.resolves_columns`, is written from the
    columns, through any codec: no item object is built, and the results come as :class:`ColumnResults`
    (the same WriteResults, built when read). Any other plan is written item by item.

    With ``reuse`` (an incremental save, :mod:`.reuse`), an item whose bytes hash as its fingerprint from the
    previous save is not written: its result points at the stored bytes, in a data file of another checkpoint.

    With ``filling``, the staged tensors are still being copied in by another process (:mod:`.filling`): each is
    read once its buffer is filled, and the results are returned once the whole fill has ended.
    """
    write = _RankWrite(store, save_id, rank, plan, planner, threads, sync, is_coordinator, codec_of, reuse, filling)
    results = write.run(name)
    if filling is not None:  # a copy that failed on this rank fails the save, whatever this rank wrote
        filling.wait_all()
    return results


def _entries(plan: SavePlan, planner: SavePlanner, codecs: list[ChunkCodec], threads: int,
             skip: Container[int] = ()) -> Encoding:
    """Each item's data-file entry, and the bytes of each item stored as a byte entry (None for tensors
    written from their memory); ``codecs`` becomes what each item is recorded as stored through. A tensor
    stored through a codec is encoded later, by the thread that writes its file (:meth:`_RankWrite.encode`)."""
    encoding = Encoding(codecs, threads)
    for i, (item, codec) in enumerate(zip(plan.items, codecs)):
        fqn, offsets = item.index.fqn, tuple(item.index.offset or ())
        if i in skip:
            encoding.plain(i, _UNWRITTEN)
        elif item.type == WriteItemType.BYTE_IO:
            encoding.value(i, fqn, planner.resolve_data(item).getvalue(), codec)
        elif not codec.identity:
            td = item.tensor_data
            encoding.later(i, entry_name(fqn, offsets), td.properties.dtype, tuple(td.chunk.sizes))
        else:
            td = item.tensor_data
            nbytes = volume(td.chunk.sizes) * itemsize(td.properties.dtype)
            encoding.plain(i, Entry(entry_name(fqn, offsets), *stored_form(td.properties.dtype, tuple(td.chunk.sizes), nbytes), nbytes))
    return encoding


def _column_entries(cols: WriteColumns, codecs: list[ChunkCodec], threads: int, skip: Container[int] = ()) -> Encoding:
    """:func:`_entries` of a plan's columns."""
    encoding = Encoding(codecs, threads)
    for i, (fqn, code, dtype, offsets, sizes, nbytes, data, codec) in enumerate(zip(
            cols.fqn, cols.code, cols.dtype, cols.offsets, cols.sizes, cols.nbytes, cols.data, codecs)):
        if i in skip:
            encoding.plain(i, _UNWRITTEN)
        elif code == BYTES:
            encoding.value(i, fqn, data, codec)
        elif not codec.identity:
            encoding.later(i, entry_name(fqn, offsets), dtype, tuple(sizes))
        else:
            encoding.plain(i, Entry(entry_name(fqn, offsets), *stored_form(dtype, sizes, nbytes), nbytes))
    return encoding


_UNWRITTEN = Entry("", VALUE_FORM, (0,), 0)  # an item an incremental save references instead of writing


def _file_entries(entries: list[Entry], members: list[int]) -> list[Entry]:
    """The entries of one file: a key may itself look like "<key>@<offsets>", so names are made unique."""
    local, names = [], set()
    for i in members:
        e = entries[i]
        if e.name in names:
            e = Entry(f"{e.name}#{i}", e.code, e.shape, e.nbytes)
        names.add(e.name)
        local.append(e)
    return local


class _RankWrite:
    """One rank's write: its entries, how they split into files, and where each item landed."""

    def __init__(self, store: BlobStore, save_id: str, rank: int, plan: SavePlan, planner: SavePlanner,
                 threads: int, sync: bool, is_coordinator: bool, codec_of: Callable[[str], ChunkCodec],
                 reuse: Optional[Reuse] = None, filling: Optional[Filling] = None) -> None:
        self.store, self.save_id, self.rank, self.plan, self.planner, self.sync = store, save_id, rank, plan, planner, sync
        items = plan.items
        self.columns = items if isinstance(items, WriteColumns) and items.intact and resolves_in_bulk(planner) else None
        self.codecs = [codec_of(fqn) for fqn in (self.columns.fqn if self.columns is not None else
                                                 (item.index.fqn for item in items))]
        self.reuse, self.keys, self.digests, self.reused = reuse, [], [], {}
        self.hashers: dict = {}  # item -> the content hash of its bytes, taken as they are written (from cache, as the CRC)
        self.filling = filling  # staging another process is still copying into (a writer process's save)
        if filling is not None and self.columns is None:
            filling.wait_all()  # items resolved one by one may be made from the staged tensors (a transform): whole
            self.filling = None
        if reuse is not None:
            self.find_unchanged(reuse, threads)
        if self.columns is not None:
            self.encoding = _column_entries(self.columns, self.codecs, threads, self.reused)
        else:
            self.encoding = _entries(plan, planner, self.codecs, threads, self.reused)
        self.entries, self.payloads = self.encoding.entries, self.encoding.payloads
        n = len(self.entries)
        self.crcs, self.offsets, self.item_file = [0] * n, [0] * n, [""] * n
        total = sum(e.nbytes for e in self.entries)
        written = [i for i in range(n) if i not in self.reused]
        parts = max(1, min(threads, total // knobs.min_file_bytes()))
        if self.encoding.later_:  # files of about min_file_bytes each, written `threads` at a time: one encodes as another writes
            parts = max(parts, min(len(written), sum(self.entries[i].nbytes for i in self.encoding.later_) // knobs.min_file_bytes()))
        runs = split_runs([self.entries[i].nbytes for i in written], parts)
        # a rank whose every item is unchanged writes no file at all
        self.groups = [[written[j] for j in run] for run in runs] if written or not self.reused else []
        # the files' writers split half the memory budget for their buffers (direct I/O's bounce buffers, an object
        # store's parts); host copies of tensors get what the writers leave
        limit = knobs.memory_budget_bytes()
        # files written at the same time; one more where files are encoded first, so that one writes while others encode
        self.at_once = max(1, min(threads + bool(self.encoding.later_), len(self.groups)))
        self.share = limit // (2 * self.at_once)
        self.budget = ByteBudget(limit - self.at_once * store.write_buffer_bytes(self.share))
        self.streams = caller_streams()  # device copies happen in worker threads, ordered on the caller's stream
        self.progress = Progress("save", total, is_coordinator)

    def find_unchanged(self, reuse: Reuse, threads: int) -> None:
        """Mark the items whose fingerprint from the previous save matches (``self.reused``): those it kept one for
        are hashed now; the others as they are written (``self.hashers``), where their bytes pass through the cache.
        A value, or an item stored through a codec, is hashed now too: its stored bytes are not the ones hashed."""
        plain = []
        if self.columns is not None:
            cols = self.columns
            self.keys = [chunk_key(f, None if c == BYTES else o, None if c == BYTES else s, None if c == BYTES else d)
                         for f, c, o, s, d in zip(cols.fqn, cols.code, cols.offsets, cols.sizes, cols.dtype)]
            data = list(zip(cols.data, cols.dtype))
            plain = [c != BYTES and codec.identity for c, codec in zip(cols.code, self.codecs)]
        else:
            data = []
            for item, codec in zip(self.plan.items, self.codecs):
                value = self.planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    self.keys.append(chunk_key(item.index.fqn, None, None, None))
                    data.append((value, None))
                    plain.append(False)
                else:
                    td = item.tensor_data
                    self.keys.append(chunk_key(item.index.fqn, tuple(item.index.offset or ()), tuple(td.chunk.sizes),
                                               td.properties.dtype))
                    data.append((value, td.properties.dtype))
                    plain.append(codec.identity)
        now = [i for i, key in enumerate(self.keys) if key in reuse.previous or not plain[i]]
        if self.filling is not None:
            for i in now:
                if isinstance(data[i][0], torch.Tensor):
                    self.filling.wait(data[i][0])
        self.digests = [None] * len(self.keys)
        for i, digest in zip(now, digests([data[i] for i in now], threads)):
            self.digests[i] = digest
            before = reuse.previous.get(self.keys[i])
            if before is not None and before.digest == digest:
                self.reused[i] = before
        self.hashers = {i: new_hasher() for i, digest in enumerate(self.digests) if digest is None}

    def run(self, name: str) -> list[WriteResult]:
        stem = name[: -len(".safetensors")] if name.endswith(".safetensors") else name
        names = [name] + [f"{stem}-{g}.safetensors" for g in range(1, len(self.groups))]
        try:
            if len(self.groups) == 1:
                files = [self.write_one_file(name, self.groups[0])]
            else:
                with ThreadPoolExecutor(self.at_once, thread_name_prefix="distckpt-write") as pool:
                    futures = [pool.submit(self.write_one_file, n, g) for n, g in zip(names, self.groups)]
                    files = [f.result() for f in futures]
        finally:
            self.encoding.close()
        self.progress.close()
        rows = [[file_name, size, self.rank, lead_crc] for file_name, size, lead_crc in files]
        lengths = [e.nbytes for e in self.entries]
        codec_names = [c.name for c in self.codecs]
        for i, st in self.reused.items():  # unchanged since the previous save: where its bytes are stored already
            self.item_file[i], self.offsets[i], lengths[i], self.crcs[i], codec_names[i] = (
                st.table_name(), st.offset, st.length, st.crc32c, st.codec)
        referenced = {st.table_name(): st.file_info() for st in self.reused.values()}
        rows += [[n, info.size, info.rank, info.header_crc32c, info.save_id] for n, info in sorted(referenced.items())]
        if self.reuse is not None:
            self.remember(rows, lengths, codec_names)
        if self.columns is not None:
            number = {row[0]: i for i, row in enumerate(rows)}
            codec_no: dict[str, int] = {}
            codec = np.array([codec_no.setdefault(c, len(codec_no)) for c in codec_names], dtype=np.int64)
            return ColumnResults(ResultColumns(
                rows, np.array([number[f] for f in self.item_file], dtype=np.int64), np.array(self.offsets, dtype=np.int64),
                np.array(lengths, dtype=np.int64), np.array(self.crcs, dtype=np.int64),
                list(codec_no) or [IDENTITY.name], codec), self.columns)
        results: list[WriteResult] = [
            WriteResult(item.index, ln, StorageInfo(f, off, ln, c, codec))
            for item, ln, off, c, f, codec in zip(self.plan.items, lengths, self.offsets, self.crcs, self.item_file, codec_names)]
        results += [FileResult.of(row[0], FileInfo(*row[1:])) for row in rows]
        return results

    def remember(self, rows: list, lengths: list[int], codec_names: list[str]) -> None:
        """This save's fingerprints, for the next save of the run once this one commits."""
        reuse = self.reuse
        own = {row[0]: FileInfo(row[1], row[2], row[3]) for row in rows if len(row) == 4}
        fingerprints = {}
        for i, key in enumerate(self.keys):
            st = self.reused.get(i)
            if st is None:
                name = self.item_file[i]
                digest = self.digests[i] if self.digests[i] is not None else self.hashers[i].digest()
                st = Stored(reuse.checkpoint, name, self.save_id, own[name], self.offsets[i], lengths[i], self.crcs[i],
                            codec_names[i], digest)
                reuse.written_bytes += lengths[i]
            else:
                reuse.referenced_bytes += lengths[i]
            fingerprints[key] = st
        reuse.fingerprints = fingerprints

    def write_one_file(self, file_name: str, members: list[int]) -> tuple[str, int, int]:
        """Write the items ``members`` into ``file_name``; return its name, size and header checksum."""
        later = [i for i in members if i in self.encoding.later_]
        if later:
            self.encode(later)
        # items whose size is a multiple of a cache line first: one odd-sized item (a 4-byte step
        # counter) would otherwise leave every item after it misaligned, and copies slower
        members = sorted(members, key=lambda i: self.entries[i].nbytes % _LINE != 0)
        lead, local_offsets = build_header(_file_entries(self.entries, members), self.save_id, self.rank)
        for i, off in zip(members, local_offsets):
            self.offsets[i] = off
            self.item_file[i] = file_name
        blob = self.store.create(file_name, self.share)
        try:
            blob.pwrite(memoryview(lead), 0)
            for batch in _batches([self.entries[i].nbytes for i in members], knobs.io_batch_bytes()):
                self.write_batch(blob, [members[j] for j in batch])
        except BaseException:
            blob.abort()
            raise
        blob.close(self.sync)
        return file_name, len(lead) + sum(self.entries[i].nbytes for i in members), crc32c(lead)

    def encode(self, items: list[int]) -> None:
        """Encode the tensor items ``items`` through their codecs, from their host bytes (copied there as for
        writing, within the memory budget), at most two items a worker in flight."""
        flight: deque = deque()

        def land() -> None:
            i, data, _owner, copied, job = flight.popleft()
            try:
                self.encoding.finish_one(i, data, job)
            finally:
                if copied:
                    self.budget.release(copied)

        try:
            for i in items:
                pending = PendingCopies(self.streams)
                data, owner, copied = self.item_bytes(i, pending)
                try:
                    pending.wait()
                    job = self.encoding.start(i, data)
                except BaseException:
                    if copied:
                        self.budget.release(copied)
                    raise
                flight.append((i, data, owner, copied, job))
                while len(flight) >= 2 * self.encoding.threads:
                    land()
            while flight:
                land()
        finally:
            for i, data, owner, copied, job in flight:  # after a failure: wait for what runs, then release its memory
                if not isinstance(job, tuple):
                    job.cancel() or job.exception()
                if copied:
                    self.budget.release(copied)

    def write_batch(self, blob: BlobWriter, batch: list[int]) -> None:
        """Write the adjacent items ``batch`` with vectored writes, checksumming each window just written."""
        views, owners, held = [], [], 0
        pending = PendingCopies(self.streams)
        try:
            for i in batch:  # device-to-host copies of the whole batch are queued together
                data, owner, copied = self.item_bytes(i, pending)
                held += copied
                owners.append(owner)  # keeps the memory behind each view alive until written
                views.append(data)
            pending.wait()
            position = self.offsets[batch[0]]
            for pieces in windows(views):  # checksum from cache
                blob.pwritev([piece for _, piece in pieces], position)
                for j, piece in pieces:
                    self.crcs[batch[j]] = crc32c(piece, self.crcs[batch[j]])
                    hasher = self.hashers.get(batch[j])
                    if hasher is not None:
                        hasher.update(piece)
                position += sum(len(piece) for _, piece in pieces)
            self.progress.advance(sum(len(v) for v in views))
        finally:
            if held:
                self.budget.release(held)

    def item_bytes(self, i: int, pending: PendingCopies) -> tuple[memoryview, object, int]:
        """The bytes of item ``i``, the object that owns them, and how many are a transient copy.

        A device tensor's bytes are only queued for copying into ``pending``: wait for it before reading them.
        """
        if self.payloads[i] is not None:
            return memoryview(self.payloads[i]), None, 0
        if self.columns is not None:
            fqn, tensor, want = self.columns.fqn[i], self.columns.data[i], self.columns.dtype[i]
            if self.filling is not None and isinstance(tensor, torch.Tensor):
                self.filling.wait(tensor)
            if (type(tensor) is torch.Tensor and tensor.dtype is want and want is not torch.bool and tensor.is_cpu
                    and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()):
                n = self.entries[i].nbytes  # the common case, checked in one go: host memory of the stored form
                if tensor.nbytes == n:
                    return memory_at(tensor.data_ptr(), n), tensor, 0
        else:
            item = self.plan.items[i]
            fqn, tensor, want = item.index.fqn, self.planner.resolve_data(item), item.tensor_data.properties.dtype
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"resolve_data for tensor item {fqn!r} returned {type(tensor).__name__}")
        copied = 0
        if tensor.dtype == torch.bool and want == torch.bool and tensor.numel():
            raw = tensor.view(torch.uint8)
            if bool(raw.gt(1).any()):  # bools stored as other bytes than 0 and 1 (format.md, section 4): make them so
                tensor = raw.ne(0)
        if tensor.dtype != want or tensor.device.type != "cpu" or not tensor.is_contiguous() or is_lazy_view(tensor):
            copied = self.entries[i].nbytes
            self.budget.acquire(copied)
            try:
                tensor = to_host(tensor, want, pending)
            except BaseException:
                self.budget.release(copied)
                raise
        data, owner = host_bytes(tensor) if copied else (flat_bytes(tensor), tensor)
        if len(data) != self.entries[i].nbytes:
            self.budget.release(copied)
            raise CheckpointError(f"key {fqn!r}: resolve_data returned {len(data)} bytes, the plan expects "
                                  f"{self.entries[i].nbytes}")
        return data, owner, copied


def split_runs(sizes: list[int], parts: int) -> list[list[int]]:
    """Split indices into at most ``parts`` contiguous runs of similar total size (never empty)."""
    total = sum(sizes)
    if parts <= 1 or not sizes:
        return [list(range(len(sizes)))]
    target = total / parts
    out: list[list[int]] = [[]]
    acc = 0
    for i, n in enumerate(sizes):
        if out[-1] and acc + n / 2 > target * len(out) and len(out) < parts:
            out.append([])
        out[-1].append(i)
        acc += n
    return out


def _batches(sizes: list[int], limit: int) -> list[list[int]]:
    """Group consecutive indices into runs of at most ``limit`` bytes (a larger item stands alone)."""
    out: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for i, n in enumerate(sizes):
        if cur and total + n > limit:
            out.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += n
    if cur:
        out.append(cur)
    return out
