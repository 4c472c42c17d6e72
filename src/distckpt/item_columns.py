"""The one schema of plan items as columns, from the planner's local plan to the committed document.

A state dict of tens of thousands of small tensors spends its save time per
item, and most of it building objects (a WriteItem, its index, its chunk, its
properties, three sizes) that the default planner, the coordinator and the
storage writer only read field by field. The columns keep those fields in
lists or arrays, one entry per item:

- :class:`WriteColumns`: a rank's local save plan, next to the data each item
  writes; it stands in for ``SavePlan.items``;
- :class:`PlanColumns`: the same plan as the coordinator receives it (per key
  once, per item only the key number and the chunk), in numpy arrays;
- :class:`ResultColumns`: where a rank's written items landed, with the codec
  each was stored through as a column, and :class:`ColumnResults` standing in
  for the list of WriteResults ``write_data`` returns;
- :class:`ReadColumns`: a load plan's whole-chunk items.

The item types have one code each (:data:`TENSOR`, :data:`SHARD`, :data:`BYTES`)
here and nowhere else. ``wire/`` only encodes these classes; ``planning/``
plans on them; the object path is fed from them (``to_plan``, ``build``).

Reading one item of :class:`WriteColumns` or :class:`ReadColumns` (indexing,
iterating) builds the item objects once, and from then on they are the plan:
a planner may change them in place, as the protocol allows (an fp16 planner
rewrites ``properties.dtype``), so the columns are no longer trusted
(``intact`` turns false) and every later step takes the protocol's object
path. Code that knows the columns asks ``intact`` first and reads the lists.
"""

from __future__ import annotations

import copy
from collections.abc import MutableSequence, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np
import torch

from .errors import CorruptCheckpointError
from .format.chunk_codec import IDENTITY
from .format.codec import opaque_from
from .format.properties import dec_props
from .format.records import FileInfo, FileResult, StorageInfo
from .metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from .planner import BytesIOWriteData, LoadItemType, ReadItem, SavePlan, TensorWriteData, WriteItem, WriteItemType
from .storage import WriteResult

__all__ = ["WriteColumns", "ReadColumns", "PlanColumns", "ResultColumns", "ColumnResults", "TENSOR", "SHARD", "BYTES",
           "item_type", "type_code"]

TENSOR, SHARD, BYTES = 0, 1, 2  # an item's WriteItemType, as every column schema stores it
_TYPES = (WriteItemType.TENSOR, WriteItemType.SHARD, WriteItemType.BYTE_IO)
_CODES = {t: code for code, t in enumerate(_TYPES)}
_UNSET = object()


def item_type(code: int) -> WriteItemType:
    """The WriteItemType of a type code."""
    return _TYPES[code]


def type_code(kind: WriteItemType) -> Optional[int]:
    """The type code of a WriteItemType (None for a type the columns do not hold)."""
    return _CODES.get(kind)


class _ColumnItems(MutableSequence):
    """A plan's items as columns; a list of item objects to anyone who reads it as one (see the module's text).

    Subclasses keep their columns and say how many items they hold (``column_count``) and how to build them
    (``build``)."""

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: Optional[list] = None

    @property
    def intact(self) -> bool:
        """Whether the columns still are the plan (no item was handed out, so none can have changed)."""
        return self._items is None

    def column_count(self) -> int:
        raise NotImplementedError

    def build(self) -> list:
        raise NotImplementedError

    def items(self) -> list:
        """The item objects (built on first call; from then on they, not the columns, are the plan)."""
        if self._items is None:
            self._items = self.build()
        return self._items

    def __len__(self) -> int:
        return self.column_count() if self._items is None else len(self._items)

    def __getitem__(self, i):
        return self.items()[i]

    def __setitem__(self, i, value) -> None:
        self.items()[i] = value

    def __delitem__(self, i) -> None:
        del self.items()[i]

    def insert(self, i: int, value) -> None:
        self.items().insert(i, value)

    def __iter__(self) -> Iterator:
        return iter(self.items())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, _ColumnItems)):
            return self.items() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __add__(self, other: Iterable) -> list:
        return self.items() + list(other)

    def __radd__(self, other: Iterable) -> list:
        return list(other) + self.items()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} items)"

    def __deepcopy__(self, memo: dict) -> list:
        return copy.deepcopy(self.items(), memo)  # items, not the data they refer to

    def __reduce__(self):
        return list, (self.items(),)


class WriteColumns(_ColumnItems):
    """Write items, one entry per item in each list.

    ``fqn``; ``code`` (TENSOR, SHARD or BYTES); for tensor items ``dtype``,
    ``requires_grad``, ``size`` (the global size), ``offsets`` and ``sizes``
    (the chunk) as tuples; ``nbytes`` (the stored bytes of a chunk, the
    encoded length of a value); ``data``: what ``resolve_data`` would return
    before its transform (the local tensor of the chunk, or the value's bytes).
    """

    __slots__ = ("fqn", "code", "dtype", "requires_grad", "size", "offsets", "sizes", "nbytes", "data")

    def __init__(self) -> None:
        super().__init__()
        self.fqn: list[str] = []
        self.code: list[int] = []
        self.dtype: list[Optional[torch.dtype]] = []
        self.requires_grad: list[bool] = []
        self.size: list[tuple] = []
        self.offsets: list[tuple] = []
        self.sizes: list[tuple] = []
        self.nbytes: list[int] = []
        self.data: list[Any] = []

    def add_tensor(self, fqn: str, code: int, data: torch.Tensor, dtype: torch.dtype, requires_grad: bool,
                   size: tuple, offsets: tuple, sizes: tuple, nbytes: int) -> None:
        self.fqn.append(fqn)
        self.code.append(code)
        self.dtype.append(dtype)
        self.requires_grad.append(requires_grad)
        self.size.append(size)
        self.offsets.append(offsets)
        self.sizes.append(sizes)
        self.nbytes.append(nbytes)
        self.data.append(data)

    def add_bytes(self, fqn: str, raw: bytes) -> None:
        self.fqn.append(fqn)
        self.code.append(BYTES)
        self.dtype.append(None)
        self.requires_grad.append(False)
        self.size.append(())
        self.offsets.append(())
        self.sizes.append(())
        self.nbytes.append(len(raw))
        self.data.append(raw)

    def select(self, keep: list[bool]) -> "WriteColumns":
        """The items whose ``keep`` is true, as columns (this object itself when all are kept)."""
        if not self.intact:
            raise ValueError("the columns were given up for items; select on the items instead")
        if all(keep):
            return self
        out = WriteColumns()
        for name in ("fqn", "code", "dtype", "requires_grad", "size", "offsets", "sizes", "nbytes", "data"):
            setattr(out, name, [v for v, k in zip(getattr(self, name), keep) if k])
        return out

    # ------------------------------------------------------------ the sequence of WriteItems

    def column_count(self) -> int:
        return len(self.fqn)

    def build(self) -> list[WriteItem]:
        return list(self._build())

    def _build(self) -> Iterator[WriteItem]:
        for fqn, code, dtype, rg, size, offs, sizes, nbytes in zip(self.fqn, self.code, self.dtype, self.requires_grad,
                                                                    self.size, self.offsets, self.sizes, self.nbytes):
            if code == BYTES:
                yield WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO, BytesIOWriteData(nbytes))
                continue
            offsets = torch.Size(offs)
            yield WriteItem(MetadataIndex(fqn, offsets), _TYPES[code], tensor_data=TensorWriteData(
                ChunkStorageMetadata(offsets, torch.Size(sizes)), TensorProperties(dtype=dtype, requires_grad=rg),
                torch.Size(size)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, WriteColumns) and self.intact and other.intact:
            return (self.fqn == other.fqn and self.code == other.code and self.dtype == other.dtype
                    and self.requires_grad == other.requires_grad and self.size == other.size
                    and self.offsets == other.offsets and self.sizes == other.sizes and self.nbytes == other.nbytes)
        if isinstance(other, (list, WriteColumns)):
            return self.items() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


class ReadColumns(_ColumnItems):
    """Read items of a load plan: whole stored chunks into whole destinations as columns, the rest as ReadItems.

    Column items, one entry per item in each list: ``fqn``; ``code`` (TENSOR or BYTES); for tensors
    ``dest_offsets`` (where the destination sits in the global tensor: its ``dest_index``), ``chunk_offsets``
    and ``chunk_index`` (the stored chunk: its ``storage_index``), ``size`` (the chunk's and the destination's
    shape: the item copies all of it) and ``dest`` (the destination tensor ``resolve_tensor`` would return).
    ``general`` holds every other item as a ReadItem. As with :class:`WriteColumns`, reading an item builds
    them all, and from then on the objects are the plan (``intact`` is false).
    """

    __slots__ = ("fqn", "code", "dest_offsets", "chunk_offsets", "chunk_index", "size", "dest", "general")

    def __init__(self) -> None:
        super().__init__()
        self.fqn: list[str] = []
        self.code: list[int] = []
        self.dest_offsets: list[tuple] = []
        self.chunk_offsets: list[tuple] = []
        self.chunk_index: list[int] = []
        self.size: list[tuple] = []
        self.dest: list[Optional[torch.Tensor]] = []
        self.general: list[ReadItem] = []

    def add_whole(self, fqn: str, dest: torch.Tensor, dest_offsets: tuple, chunk_offsets: tuple, chunk_index: int,
                  size: tuple) -> None:
        self.fqn.append(fqn)
        self.code.append(TENSOR)
        self.dest_offsets.append(dest_offsets)
        self.chunk_offsets.append(chunk_offsets)
        self.chunk_index.append(chunk_index)
        self.size.append(size)
        self.dest.append(dest)

    def add_bytes(self, fqn: str) -> None:
        self.fqn.append(fqn)
        self.code.append(BYTES)
        self.dest_offsets.append(())
        self.chunk_offsets.append(())
        self.chunk_index.append(0)
        self.size.append(())
        self.dest.append(None)

    def column_item(self, i: int) -> ReadItem:
        """The ReadItem of column item ``i``, built alone (the columns stay the plan)."""
        fqn = self.fqn[i]
        if self.code[i] == BYTES:
            index, empty = MetadataIndex(fqn), torch.Size([0])
            return ReadItem(LoadItemType.BYTE_IO, index, empty, index, empty, empty)
        zeros = torch.Size([0] * len(self.size[i]))
        return ReadItem(LoadItemType.TENSOR, MetadataIndex(fqn, self.dest_offsets[i]), zeros,
                        MetadataIndex(fqn, self.chunk_offsets[i], self.chunk_index[i]), zeros, torch.Size(self.size[i]))

    def column_count(self) -> int:
        return len(self.fqn) + len(self.general)

    def build(self) -> list[ReadItem]:
        return [self.column_item(i) for i in range(len(self.fqn))] + self.general


class PlanColumns:
    """One rank's save plan as the coordinator plans on it.

    ``keys`` is the rank's key table, one row per distinct key in order of
    first use: ``[fqn, type code, encoded properties or None, global size or
    None, value bytes or None]``. ``key_blob`` is its encoded form (equal
    blobs mean equal tables, so the coordinator reads a table that many ranks
    share once; ``keys`` and ``planner_json`` are decoded on first use, by
    ``unpack``, the decoder of the encoding they came in). Per item:
    ``item_key`` (row in ``keys``), ``offsets`` and ``sizes`` (n x D,
    zero-padded past the key's ndim).
    """

    def __init__(self, key_blob: bytes, item_key: np.ndarray, offsets: np.ndarray, sizes: np.ndarray,
                 planner_blob: bytes, storage_data: Any, usable: bool, where: str = "save plan",
                 unpack: Optional[Callable[[bytes, str], Any]] = None, keys: Optional[list] = None, planner_json: Any = _UNSET):
        self.key_blob, self.item_key, self.offsets, self.sizes = key_blob, item_key, offsets, sizes
        self.planner_blob, self.storage_data, self.usable, self.where = planner_blob, storage_data, usable, where
        self._unpack = unpack
        self._keys = keys
        self._planner = planner_json

    @property
    def keys(self) -> list:
        if self._keys is None:
            keys = self._unpack(self.key_blob, self.where)
            if (not isinstance(keys, list) or (self.item_key.size and int(self.item_key.max()) >= len(keys))
                    or not all(_key_row(row) for row in keys)):
                raise CorruptCheckpointError(f"{self.where}: malformed column plan (its key table)")
            self._keys = keys
        return self._keys

    @property
    def planner_json(self) -> Any:
        if self._planner is _UNSET:
            self._planner = self._unpack(self.planner_blob, self.where)
        return self._planner

    def __len__(self) -> int:
        return len(self.item_key)

    def to_plan(self) -> SavePlan:
        """The SavePlan these columns stand for, item for item (the object path's input)."""
        items = []
        props_cache: dict = {}
        for k, offs, sizes in zip(self.item_key.tolist(), self.offsets.tolist(), self.sizes.tolist()):
            fqn, code, props, gsize, nbytes = self.keys[k]
            if code == BYTES:
                items.append(WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO, BytesIOWriteData(nbytes)))
                continue
            p = props_cache.get(k)
            if p is None:
                p = props_cache[k] = dec_props(props, "save plan")
            nd = len(gsize)
            off = torch.Size(offs[:nd])
            items.append(WriteItem(MetadataIndex(fqn, off), item_type(code), tensor_data=TensorWriteData(
                ChunkStorageMetadata(off, torch.Size(sizes[:nd])), p, torch.Size(gsize))))
        planner_data = None if self.planner_json is None else opaque_from(self.planner_json, "save plan", True)
        return SavePlan(items, self.storage_data, planner_data, self.usable)


def _key_row(row: Any) -> bool:
    """A row of a key table: [fqn, type code, properties, global size, value bytes], as the encoder writes it."""
    if type(row) is not list or len(row) != 5 or type(row[0]) is not str or row[1] not in (TENSOR, SHARD, BYTES) \
            or type(row[1]) is not int:
        return False
    if row[1] == BYTES:
        return type(row[4]) is int and row[4] >= 0
    return type(row[2]) is list and type(row[3]) is list and all(type(n) is int and n >= 0 for n in row[3])


@dataclass
class ResultColumns:
    """One rank's write results relative to its central plan: item i of the plan is ``length[i]`` stored
    bytes at ``offset[i]`` of ``files[file_no[i]]`` with checksum ``crc[i]``, stored through the codec
    ``codecs[codec[i]]`` (a codec name, :mod:`distckpt.format.chunk_codec`); ``files`` holds [name, size,
    rank, header crc] of each file the rank wrote."""

    files: list
    file_no: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    crc: np.ndarray
    codecs: list = field(default_factory=lambda: [IDENTITY.name])
    codec: Optional[np.ndarray] = None  # None: every item is stored as it is

    def codec_column(self) -> np.ndarray:
        """``codec``, with the all-identity default spelled out."""
        return np.zeros(len(self.file_no), dtype=np.int64) if self.codec is None else self.codec

    def to_results(self, plan_items: list) -> list[WriteResult]:
        codec_names = [self.codecs[c] for c in self.codec_column().tolist()]
        out = [WriteResult(it.index, ln, StorageInfo(self.files[f][0], off, ln, c, name))
               for it, f, off, ln, c, name in zip(plan_items, self.file_no.tolist(), self.offset.tolist(), self.length.tolist(),
                                                  self.crc.tolist(), codec_names)]
        out += [FileResult.of(row[0], FileInfo(*row[1:])) for row in self.files]
        return out


class ColumnResults(Sequence):
    """A rank's write results as :class:`ResultColumns`, standing in for the list of WriteResults
    ``write_data`` returns: the objects are built (once) when someone reads them."""

    def __init__(self, columns: ResultColumns, items: WriteColumns) -> None:
        self.columns, self._plan_items = columns, items
        self._results: Optional[list[WriteResult]] = None

    def results(self) -> list[WriteResult]:
        if self._results is None:
            self._results = self.columns.to_results(list(self._plan_items))
        return self._results

    def __len__(self) -> int:
        return len(self.columns.file_no) + len(self.columns.files)

    def __getitem__(self, i):
        return self.results()[i]

    def __iter__(self):
        return iter(self.results())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, (list, ColumnResults)) and self.results() == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __add__(self, other) -> list:
        return self.results() + list(other)

    def __radd__(self, other) -> list:
        return list(other) + self.results()

    def __repr__(self) -> str:
        return f"ColumnResults({len(self.columns.file_no)} items, {len(self.columns.files)} files)"
