"""Lazy reads: parts of stored tensors and values of one checkpoint, read on demand by one process, with no
process group (``distckpt.open``, ``distckpt cat``, ``distckpt diff``).

Each data file is opened and validated as a load validates it (size, header, save id: :func:`open_and_validate`)
the first time a read needs it, and kept open. Each chunk read is checked against its file's header (dtype,
shape, place) before anything is allocated for it. A chunk whose rows are all read is checksummed; one read in
part cannot be (its CRC-32C covers the whole chunk), so only the rows a selection needs are read, with one
ranged read per run of rows (within the slab size) unless the caller asks for whole chunks. A chunk stored
through a codec (the zstd chunk codec, DCP's stream transforms, another program's layout) is read whole and
decoded.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator, Optional

import torch

from .. import knobs
from ..errors import CheckpointClosedError, CheckpointError, CorruptCheckpointError
from ..format.checksum import crc32c
from ..format.chunk_codec import ChunkCodec
from ..format.datafile import VALUE_FORM, check_header_entry, stored_form
from ..format.dtypes import itemsize
from ..format.expected_headers import expected_leads
from ..format.records import FileStorageData, ForeignStorageData, StorageInfo
from ..format.stream_transforms import codec_for
from ..metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from ..planning.resharding import volume
from ..planning.slices import Axis, Selection, chunk_part, row_runs
from .blobs import BlobReader, BlobStore
from .chunk_reads import check_checksum, read_into
from .data_files import open_and_validate
from .tensor_bytes import flat_bytes, writable_bytes

__all__ = ["LazyReads", "GAP_BYTES", "named"]


def named(exc: CheckpointError, where: str, name: str) -> CheckpointError:
    """``exc``, naming the checkpoint (``where``) if its message does not name it (``name``) already: a store
    names a file it refuses by its name alone ("data-00000.safetensors is a FIFO"), and `distckpt diff` reads
    two checkpoints."""
    if name in str(exc):
        return exc
    try:
        again = type(exc)(f"{where}: {exc}")
    except Exception:  # noqa: BLE001 - an error class that takes other arguments: kept as it is
        return exc
    again.__dict__.update(exc.__dict__)
    return again

GAP_BYTES = 1 << 20
"""Rows skipped by a step of dimension 0 are read along with the rows around them up to this many bytes of gap,
where one longer read costs less than another request."""


class LazyReads:
    """The reads of one opened checkpoint: its metadata ``md``, its data files on ``store``.

    ``verify``: check the CRC-32C of every chunk and value read whole (chunks read in part cannot be checked).
    ``registry`` rebuilds the stream transforms items were written through (None: the default one).
    ``bytes_read`` counts the bytes of chunks and values read (file headers, read once per file, not included).
    """

    def __init__(self, store: BlobStore, md: Metadata, where: str, *, verify: bool = True, registry: Any = None,
                 name: Optional[str] = None) -> None:
        if not isinstance(md.storage_data, FileStorageData):
            raise CorruptCheckpointError(f"{where}: metadata has no data-file table")
        self.store, self.md, self.where, self.verify, self.registry = store, md, where, verify, registry
        self.name = where if name is None else name  # how errors name the checkpoint (its path, its URL)
        self.fsd: FileStorageData = md.storage_data
        self.foreign = isinstance(self.fsd, ForeignStorageData)
        self.blobs: dict[str, BlobReader] = {}
        self.spans: dict[str, Optional[dict]] = {}
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)  # notified when the last read in flight ends
        self.in_flight = 0
        self.bytes_read = 0
        self.closed = False

    def here(self, fqn: str, offsets: Optional[tuple] = None) -> str:
        chunk = f", chunk {list(offsets)}" if offsets is not None else ""
        return f"{self.where}: key {fqn!r}{chunk}"

    def close(self) -> None:
        """Refuse further reads, wait for those in flight (another thread's), then close the files: a file closed
        under a read would give its descriptor's number to the next file the process opens, and the read would
        take that file's bytes."""
        with self.lock:
            self.closed = True
            while self.in_flight:
                self.idle.wait()
            blobs, self.blobs = list(self.blobs.values()), {}
        for blob in blobs:
            blob.close()

    # ------------------------------------------------------------ files and chunks, checked before any read

    def blob(self, name: str) -> BlobReader:
        """Data file ``name``, opened and validated on first use."""
        with self.lock:
            if self.closed:
                raise CheckpointClosedError(f"{self.where} was closed; open it again (distckpt.open) to read from it")
            blob = self.blobs.get(name)
            if blob is None:
                spans: dict = {}
                leads = {} if self.foreign else expected_leads(self.md, [name])
                try:
                    self.blobs.update(open_and_validate(self.store, self.fsd, [name], self.where, spans, leads))
                except CheckpointError as exc:
                    raise named(exc, self.where, self.name) from None
                self.spans[name] = spans[name]
                blob = self.blobs[name]
            return blob

    def stored(self, fqn: str, offsets: Optional[tuple], sizes: Optional[tuple],
               dtype: Optional[torch.dtype]) -> tuple[StorageInfo, ChunkCodec]:
        """Where a chunk (``offsets`` and ``sizes``; None for a value) is stored, and its codec; its file opened
        and validated, its length and its entry in the file's header checked against the metadata."""
        index = MetadataIndex(fqn, offsets)
        here = self.here(fqn, offsets)
        info = self.fsd.items.get(index)
        if info is None:
            raise CorruptCheckpointError(f"{here} has no storage entry in the metadata; the metadata is damaged")
        if self.foreign and info.codec != "identity":
            codec = self.fsd.decoder(index, info, here)
        else:
            codec = codec_for(info.codec, self.registry, here)
        if sizes is not None and codec.identity and info.length != volume(sizes) * itemsize(dtype):
            raise CorruptCheckpointError(f"{here}: the metadata stores {info.length} bytes for a chunk of {list(sizes)} "
                                         f"{dtype}, which holds {volume(sizes) * itemsize(dtype)}; the metadata is damaged")
        self.blob(info.file)
        spans = self.spans[info.file]
        if spans is not None:
            tensor = sizes is not None and codec.identity
            form = stored_form(dtype, sizes, info.length) if tensor else (VALUE_FORM, (info.length,))
            check_header_entry(spans, info.offset, info.length, form, f"{here}, file {info.file!r}")
        return info, codec

    def read_into(self, info: StorageInfo, view: memoryview, offset: int, here: str) -> None:
        """``len(view)`` bytes at ``offset`` of the item ``info`` (relative to the item)."""
        blob = self.blob(info.file)
        with self.lock:
            if self.closed:
                raise CheckpointClosedError(f"{self.where} was closed; open it again (distckpt.open) to read from it")
            self.in_flight += 1
        try:
            read_into(blob, view, info.offset + offset, here, info.file)
        finally:
            with self.lock:
                self.in_flight -= 1
                if not self.in_flight:
                    self.idle.notify_all()
        with self.lock:
            self.bytes_read += len(view)

    def read_stored(self, info: StorageInfo, codec: ChunkCodec, nbytes: int, here: str) -> memoryview:
        """An item read whole, its checksum checked, decoded (``nbytes``: its decoded size; -1 for a value)."""
        stored = bytearray(info.length)
        self.read_into(info, memoryview(stored), 0, here)
        check_checksum(self.verify and info.crc32c is not None, crc32c(stored), info, here)
        return memoryview(stored) if codec.identity else codec.decode(memoryview(stored), nbytes, here)

    # ------------------------------------------------------------ values

    def read_value(self, fqn: str) -> bytes:
        """The bytes of value ``fqn`` (as the save planner stored them; decode with format.values.decode_value)."""
        info, codec = self.stored(fqn, None, None, None)
        return bytes(self.read_stored(info, codec, -1, self.here(fqn)))

    # ------------------------------------------------------------ tensors

    def read_block(self, fqn: str, entry: TensorStorageMetadata, sel: Selection, whole: bool = False) -> torch.Tensor:
        """The elements ``sel`` selects of tensor ``fqn``, as a tensor of ``sel.block_shape``.

        Every chunk that holds some of them is checked first; then each is read, whole (and checksummed) where
        all its rows are needed or ``whole`` is set, else only the rows needed.
        """
        dtype = entry.properties.dtype
        parts = []
        for chunk in entry.chunks:
            part = chunk_part(sel.axes, chunk.offsets, chunk.sizes)
            if part is not None:
                info, codec = self.stored(fqn, tuple(chunk.offsets), tuple(chunk.sizes), dtype)
                parts.append((info.file, info.offset, chunk, part, info, codec))
        block = _empty(sel.block_shape, dtype, self.here(fqn))
        for _, _, chunk, part, info, codec in sorted(parts, key=lambda p: p[:2]):
            self.read_part(fqn, chunk, part, info, codec, sel.axes, block, whole)
        return block

    def read_part(self, fqn: str, chunk: ChunkStorageMetadata, part: list, info: StorageInfo, codec: ChunkCodec,
                  axes: tuple[Axis, ...], block: torch.Tensor, whole: bool) -> None:
        """Copy the part ``part`` (see planning/slices.chunk_part) of one chunk into ``block``."""
        sizes, dtype = tuple(chunk.sizes), block.dtype
        here = self.here(fqn, tuple(chunk.offsets))
        if not codec.identity or not sizes:
            raw = self.read_stored(info, codec, volume(sizes) * itemsize(dtype), here)
            data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if len(raw) else torch.empty(0, dtype=torch.uint8)
            _copy_part(data.view(dtype).reshape(sizes), 0, part, axes, block)
            return
        rows, row_bytes = sizes[0], info.length // sizes[0]
        k_lo, k_hi, first = part[0]
        needed = row_runs(first, k_hi - k_lo, axes[0].step, row_bytes, GAP_BYTES)
        runs = [(0, rows)] if whole else needed
        checked = runs == [(0, rows)] and self.verify and info.crc32c is not None
        direct = runs == needed and _direct_rows(part, axes, sizes, block)
        # straight into the block, a run is one read (no buffer to bound); through a buffer, a slab at a time
        slab_rows = rows if direct else max(1, _slab_bytes() // max(1, row_bytes))
        buf = None if direct else torch.empty(min(slab_rows, max(b - a for a, b in runs)) * row_bytes, dtype=torch.uint8)
        crc = 0
        for a, b in runs:
            for sa in range(a, b, slab_rows):
                sb = min(b, sa + slab_rows)
                if direct:  # rows straight into the block: they are a contiguous run of its bytes
                    view = writable_bytes(block.narrow(0, k_lo + sa - first, sb - sa))
                    self.read_into(info, view, sa * row_bytes, here)
                else:
                    view = flat_bytes(buf)[:(sb - sa) * row_bytes]
                    self.read_into(info, view, sa * row_bytes, here)
                    slab = buf[:(sb - sa) * row_bytes].view(dtype).reshape((sb - sa,) + sizes[1:])
                    _copy_part(slab, sa, part, axes, block)
                if checked:
                    crc = crc32c(view, crc)
        check_checksum(checked, crc, info, here)

    def chunk_slabs(self, fqn: str, entry: TensorStorageMetadata, chunk: ChunkStorageMetadata,
                    max_bytes: int) -> Iterator[tuple[int, torch.Tensor]]:
        """One whole chunk, as (first row, slab of whole rows) of at most ``max_bytes`` each (one slab for a 0-d
        chunk or one stored through a codec), through one reused buffer: use each slab before taking the next.
        The chunk's checksum is checked before its last slab is given."""
        dtype, sizes = entry.properties.dtype, tuple(chunk.sizes)
        here = self.here(fqn, tuple(chunk.offsets))
        info, codec = self.stored(fqn, tuple(chunk.offsets), sizes, dtype)
        if not codec.identity or not sizes or not info.length:
            raw = self.read_stored(info, codec, volume(sizes) * itemsize(dtype), here) if info.length else b""
            data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if len(raw) else torch.empty(0, dtype=torch.uint8)
            yield 0, data.view(dtype).reshape(sizes)
            return
        rows, row_bytes = sizes[0], info.length // sizes[0]
        slab_rows = max(1, min(rows, max_bytes // max(1, row_bytes)))
        buf = torch.empty(slab_rows * row_bytes, dtype=torch.uint8)
        check = self.verify and info.crc32c is not None
        crc = 0
        for a in range(0, rows, slab_rows):
            b = min(rows, a + slab_rows)
            view = flat_bytes(buf)[:(b - a) * row_bytes]
            self.read_into(info, view, a * row_bytes, here)
            if check:
                crc = crc32c(view, crc)
            if b == rows:
                check_checksum(check, crc, info, here)
            yield a, buf[:(b - a) * row_bytes].view(dtype).reshape((b - a,) + sizes[1:])


def _slab_bytes() -> int:
    return min(knobs.read_slab_bytes(), knobs.memory_budget_bytes())


def _empty(shape: tuple, dtype: torch.dtype, here: str) -> torch.Tensor:
    try:
        return torch.empty(shape, dtype=dtype)
    except (RuntimeError, MemoryError):
        raise CheckpointError(f"{here}: cannot allocate {volume(shape) * itemsize(dtype)} bytes for {list(shape)} "
                              f"{dtype}; read a smaller slice of it") from None


def _direct_rows(part: list, axes: tuple[Axis, ...], sizes: tuple, block: torch.Tensor) -> bool:
    """Whether the rows a part reads land in ``block`` as they are stored: dimension 0 taken with step 1, every
    other dimension of the chunk taken whole and filling the block's."""
    if axes[0].step != 1 or not block.is_contiguous():
        return False
    for (k_lo, k_hi, first), axis, size, out in zip(part[1:], axes[1:], sizes[1:], block.shape[1:]):
        if first != 0 or axis.step != 1 or k_hi - k_lo != size or k_lo != 0 or k_hi != out:
            return False
    return True


def _copy_part(slab: torch.Tensor, row0: int, part: list, axes: tuple[Axis, ...], block: torch.Tensor) -> None:
    """Copy what ``slab`` (the chunk's rows from ``row0``, or the whole chunk) holds of ``part`` into ``block``."""
    src, dst = [], []
    for dim, ((k_lo, k_hi, first), axis) in enumerate(zip(part, axes)):
        step, length = axis.step, slab.shape[dim]
        origin = row0 if dim == 0 else 0
        # the positions k in [k_lo, k_hi) whose chunk index first + (k - k_lo) * step lies in [origin, origin + length)
        i0 = max(0, -(-(origin - first) // step))
        i1 = min(k_hi - k_lo, -(-(origin + length - first) // step))
        if i0 >= i1:
            return
        start = first + i0 * step - origin
        src.append(slice(start, start + (i1 - i0 - 1) * step + 1, step))
        dst.append(slice(k_lo + i0, k_lo + i1))
    block[tuple(dst)].copy_(slab[tuple(src)])
