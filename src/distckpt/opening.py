"""distckpt.open(): a checkpoint as a read-only mapping of lazily read tensors and values, in one process.

Like ``safetensors.safe_open``: nothing but the metadata is read when it opens; a value is read when it is
looked up, a tensor's bytes when it is indexed. No process group is needed, and inside one no collective is
made.

    with distckpt.open("/ckpt/step-1000") as ckpt:
        ckpt["progress.step"]              # a value: read, checked and decoded now
        wte = ckpt["model.wte"]            # a LazyTensor: shape and dtype, nothing read yet
        rows = wte[1000:2000]              # reads only those rows' bytes, from whichever chunks hold them
        whole = wte.read()                 # the whole tensor, every chunk checked against its CRC-32C
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from typing import Any, Iterator, Optional, Union

import torch

from . import knobs
from .backends.blob_storage import BlobStorageReader
from .backends.foreign import LayoutReader
from .backends.registry import pick_storage
from .engine.lazy_reads import LazyReads, named
from .errors import CheckpointClosedError, CheckpointError, CheckpointIndexError, MissingKeyError, UnsafeValueError
from .format.values import decode_value
from .metadata import Metadata, TensorStorageMetadata
from .planning.slices import select
from .storage import StorageReader

__all__ = ["open", "OpenCheckpoint", "LazyTensor", "summarize"]

def open(checkpoint_id: Union[str, os.PathLike, None] = None, *, storage_reader: Optional[StorageReader] = None,
         verify_checksums: bool = True, verify_slices: bool = False, allow_pickle: bool = False) -> "OpenCheckpoint":
    """Open a checkpoint for lazy reads: a read-only mapping from its keys (as :func:`read_metadata` lists them,
    flattened: ``"model.wte"``, ``"progress.step"``) to values and :class:`LazyTensor` objects.

    Works on every store ``load`` reads (a path, ``s3://bucket/prefix``, ``memory://name``) and on checkpoints
    other programs wrote that ``load`` reads (a DCP directory, a Hugging Face directory, a torch.save file).
    Data files are opened and validated as ``load`` validates them when first needed, and stay open until
    :meth:`OpenCheckpoint.close` (or the end of a ``with`` block).

    Args:
        verify_checksums: check the CRC-32C of every value and every chunk read whole.
        verify_slices: read every stored chunk a slice touches whole, so that it is checked too (a chunk read in
            part cannot be: its CRC-32C covers all of it). Off by default: a slice reads only its own rows.
        allow_pickle: values stored pickled (saved with ``allow_pickle=True``) may be unpickled.
    """
    reader = pick_storage("reader", checkpoint_id, storage_reader)
    name = os.fspath(checkpoint_id) if checkpoint_id is not None else type(reader).__name__
    where = f"checkpoint {name!r}"
    try:
        md = reader.read_metadata()
    except CheckpointError as exc:
        raise named(exc, where, name) from None
    if isinstance(reader, BlobStorageReader):
        store = reader.data_store(md)
        verify = verify_checksums and reader.verify_checksums
        registry = reader.extension_registry
    elif isinstance(reader, LayoutReader):
        reader.set_up_storage_reader(md, True)
        store, verify, registry = reader.store, verify_checksums, None
    else:
        raise CheckpointError(f"distckpt.open reads through distckpt's storage readers; {where} was given a "
                              f"{type(reader).__name__}. Leave storage_reader= out, or pass a distckpt reader "
                              "(FileSystemReader, S3Reader, MemoryReader, DCPReader...)")
    reads = LazyReads(store, md, where, verify=verify, registry=registry, name=name)
    return OpenCheckpoint(md, reads, verify_slices, allow_pickle)


class OpenCheckpoint(Mapping):
    """A checkpoint opened by :func:`open`: ``ckpt[key]`` is a value (read when looked up) or a
    :class:`LazyTensor`. Iterating, ``len`` and ``in`` read only the metadata; ``values()`` and ``items()``
    read every value.

    It holds its data files open: ``close()`` it, or use it in a ``with`` block; after that, every read raises
    CheckpointClosedError. ``metadata`` is the checkpoint's :class:`~distckpt.Metadata`; ``bytes_read``
    counts the bytes of chunks and values read so far (data-file headers, read once per file, not included).
    """

    def __init__(self, md: Metadata, reads: LazyReads, verify_slices: bool = False, allow_pickle: bool = False) -> None:
        self.metadata, self._reads = md, reads
        self.verify_slices, self.allow_pickle = verify_slices, allow_pickle

    @property
    def where(self) -> str:
        return self._reads.where

    @property
    def bytes_read(self) -> int:
        return self._reads.bytes_read

    @property
    def closed(self) -> bool:
        return self._reads.closed

    def _check_open(self) -> None:
        if self._reads.closed:
            raise CheckpointClosedError(f"{self.where} was closed; open it again (distckpt.open) to read from it")

    def __getitem__(self, key: str) -> Any:
        self._check_open()
        entry = self.metadata.state_dict_metadata.get(key) if isinstance(key, str) else None
        if entry is None:
            raise MissingKeyError(self._missing(key))
        if isinstance(entry, TensorStorageMetadata):
            return LazyTensor(self, key, entry)
        raw = self._reads.read_value(key)
        try:
            return decode_value(raw, allow_pickle=self.allow_pickle, where=self._reads.here(key))
        except UnsafeValueError as exc:  # its fix names load's argument; here it is open's (and cat has none)
            raise UnsafeValueError(f"{exc}. Here: distckpt.open(..., allow_pickle=True) unpickles it; "
                                   "`distckpt cat` and `distckpt diff` never do") from None

    def _missing(self, key: Any) -> str:
        keys = self.metadata.state_dict_metadata
        text = f"{self.where} has no key {key!r}"
        if not isinstance(key, str):
            return f"{text}: keys are strings, as distckpt.read_metadata lists them"
        close = difflib.get_close_matches(key, list(keys), n=3)
        under = sorted(k for k in keys if k.startswith(key + "."))[:3]
        hint = close or under
        if hint:
            return f"{text}; did you mean {', '.join(repr(k) for k in hint)}?"
        return f"{text} ({len(keys)} keys; `distckpt inspect` lists them)"

    def __iter__(self) -> Iterator[str]:
        return iter(self.metadata.state_dict_metadata)

    def __len__(self) -> int:
        return len(self.metadata.state_dict_metadata)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self.metadata.state_dict_metadata

    def close(self) -> None:
        """Close the data files; reads after this raise CheckpointClosedError. Closing twice does nothing."""
        self._reads.close()

    def __enter__(self) -> "OpenCheckpoint":
        self._check_open()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self)} keys"
        return f"<distckpt.OpenCheckpoint {self.where}, {state}>"


class LazyTensor:
    """A stored tensor of an :class:`OpenCheckpoint`, read when indexed.

    ``shape``, ``dtype``, ``ndim``, ``numel()``, ``nbytes`` and ``chunks`` (each stored chunk's offsets and
    sizes) come from the metadata. ``t[index]`` takes torch's basic indexing (ints, slices with positive steps,
    ``...``, ``None``, over any dimensions) and returns a new CPU tensor equal to ``t.read()[index]``, reading
    only the rows of dimension 0 that it needs from each chunk that holds some of it (one ranged read per run
    of rows). A chunk whose rows are all read is checked against its CRC-32C; a chunk read in part cannot be
    (open with ``verify_slices=True`` to read such chunks whole and check them). ``read()`` reads the whole
    tensor, checking every chunk. Out-of-range ints raise CheckpointIndexError, an IndexError.
    """

    def __init__(self, opened: OpenCheckpoint, key: str, entry: TensorStorageMetadata) -> None:
        self._opened, self.key, self._entry = opened, key, entry

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._entry.size)

    @property
    def dtype(self) -> torch.dtype:
        return self._entry.properties.dtype

    @property
    def ndim(self) -> int:
        return len(self._entry.size)

    def dim(self) -> int:
        return self.ndim

    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        return self.numel() * self.dtype.itemsize

    @property
    def chunks(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [(tuple(c.offsets), tuple(c.sizes)) for c in self._entry.chunks]

    def __len__(self) -> int:
        if not self.ndim:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __getitem__(self, index: Any) -> torch.Tensor:
        self._opened._check_open()
        reads = self._opened._reads
        sel = select(index, self.shape, reads.here(self.key))
        block = reads.read_block(self.key, self._entry, sel, whole=self._opened.verify_slices)
        return block[sel.view]

    def read(self) -> torch.Tensor:
        """The whole tensor, every chunk checked against its checksum."""
        return self[...]

    def pieces(self, max_bytes: int, chunks: Optional[list] = None) -> Iterator[tuple[tuple[int, ...], torch.Tensor]]:
        """The stored chunks (all, as stored, or ``chunks``: (offsets, sizes) pairs of ``self.chunks`` in the order
        wanted), whole rows at a time: (offsets of the piece in the tensor, piece), pieces of at most ``max_bytes``
        (a chunk stored through a codec, or 0-d, comes whole). Each piece lives in a reused buffer until the next
        is taken; each chunk's checksum is checked before its last piece is given."""
        reads = self._opened._reads
        stored = {(tuple(c.offsets), tuple(c.sizes)): c for c in self._entry.chunks}
        for key in (list(stored) if chunks is None else [(tuple(o), tuple(s)) for o, s in chunks]):
            chunk, offsets = stored.get(key), key[0]
            if chunk is None:
                raise CheckpointIndexError(f"{reads.here(self.key)} has no stored chunk at {list(offsets)} of {list(key[1])}")
            for row, piece in reads.chunk_slabs(self.key, self._entry, chunk, max_bytes):
                self._opened._check_open()
                yield ((offsets[0] + row,) + offsets[1:] if offsets else ()), piece

    def __repr__(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        return f"<distckpt.LazyTensor {self.key!r} {dtype} {list(self.shape)}, {len(self._entry.chunks)} chunk(s)>"


def summarize(tensor: LazyTensor, head: int = 8) -> dict:
    """A tensor's summary, read chunk by chunk in pieces within the memory budget (every chunk checksummed):
    key, dtype, shape, chunks, its first ``head`` elements in row-major order, and for real dtypes min, max and
    mean (float dtypes: over the elements that are not NaN, with ``nan``, their count, and the L2 ``norm``)."""
    out: dict = {"key": tensor.key, "kind": "tensor", "dtype": str(tensor.dtype).replace("torch.", ""),
                 "shape": list(tensor.shape), "chunks": len(tensor.chunks)}
    first = tensor[_head_index(tuple(tensor.shape), head)].reshape(-1)[:head] if tensor.numel() else None
    out["head"] = [] if first is None else _plain(first.tolist() if not _is_float8(first) else first.float().tolist())
    if tensor.dtype.is_complex or not tensor.numel():
        return out
    floating = tensor.dtype.is_floating_point
    low, high, total, squares, count, nans = math.inf, -math.inf, 0.0, 0.0, 0, 0
    piece_bytes = max(1, min(knobs.read_slab_bytes(), knobs.memory_budget_bytes()) // 4)
    step = max(1, piece_bytes // 8)  # elements converted at a time: a piece may be one row larger than piece_bytes
    for _, piece in tensor.pieces(piece_bytes):
        flat = piece.reshape(-1)
        for at in range(0, flat.numel(), step):
            part = flat[at:at + step]
            values = part.double()
            if floating:
                is_nan = torch.isnan(values)
                found = int(is_nan.sum())
                nans += found
                values = values[~is_nan] if found else values
            if not values.numel():
                continue
            if floating:
                lo, hi = values.min().item(), values.max().item()
            elif part.dtype == torch.uint64:  # no min or max in torch: in int64 with the top bit flipped, same order
                flipped = part.view(torch.int64) ^ _TOP_BIT
                lo, hi = flipped.min().item() - _TOP_BIT, flipped.max().item() - _TOP_BIT
            else:
                exact = part.long()  # integers beyond 2**53 keep their value
                lo, hi = exact.min().item(), exact.max().item()
            low, high = min(low, lo), max(high, hi)
            total += float(values.sum())
            squares += float(values.square().sum()) if floating else 0.0
            count += values.numel()
    out.update(min=_plain(low if count else None), max=_plain(high if count else None),
               mean=_plain(total / count if count else None))
    if floating:
        out.update(norm=_plain(math.sqrt(squares)), nan=nans)
    return out


_TOP_BIT = -(1 << 63)


def _head_index(shape: tuple, n: int) -> tuple:
    """An index reading at least the first ``n`` elements (row-major) of a tensor of ``shape``, and at most
    about twice that many: whole innermost rows, from the outermost dimension that holds ``n``."""
    inner = 1
    for dim in range(len(shape) - 1, -1, -1):
        if inner * shape[dim] >= n or dim == 0:
            return (0,) * dim + (slice(0, min(shape[dim], -(-n // inner))),)
        inner *= shape[dim]
    return ()


def _is_float8(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point and t.dtype.itemsize == 1


def _plain(x: Any) -> Any:
    """``x`` as JSON can hold it: NaN and infinities as strings, complex numbers as text."""
    if isinstance(x, list):
        return [_plain(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, complex):
        return str(x)
    return x
