"""The table of whole tensors (format 3.0): every tensor stored as one chunk as large as itself, as columns.

Most keys of a state dict are such tensors, and a document of tens of
thousands of them spent most of its decoding on one small JSON object per key
(docs/performance.md). As columns, the document decodes in a few C calls,
is checked with array operations, and builds a key's protocol objects
(TensorStorageMetadata and its parts) only when someone asks for that key.
docs/format.md, section 3.1, is the specification.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any, Optional

import numpy as np
import torch

from ..errors import CorruptCheckpointError
from ..metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata
from .dtypes import itemsize
from .locations import ChunkLocations
from .properties import props_fields

__all__ = ["TableWriter", "TensorTable", "TableEntries", "decode_table", "table_of", "stored_dtypes", "MEMBERS"]

MEMBERS = ("keys", "properties", "property", "ndim", "size", "file", "offset", "crc32c")
MAX_PROPERTIES = 1024
MAX_TABLE_KEYS = 10_000_000
_INT = {int}
_ORIGINS = [torch.Size([0] * n) for n in range(65)]
_new = object.__new__


class TableWriter:
    """The ``tensors`` member being written: one row per whole tensor, added in the document's key order."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.properties: list[list] = []
        self.numbers: dict[tuple, int] = {}  # a properties list -> its number in ``properties``
        self.property: list[int] = []
        self.ndim: list[int] = []
        self.size: list[int] = []
        self.file: list[int] = []
        self.offset: list[int] = []
        self.crc: list[int] = []

    def add(self, fqn: str, size: list, properties: list, file_no: int, offset: int, crc: int) -> None:
        """A tensor of ``size`` stored as one chunk at ``offset`` of file ``file_no``; ``properties`` as encoded."""
        key = tuple(properties)
        number = self.numbers.get(key)
        if number is None:
            number = self.numbers[key] = len(self.properties)
            self.properties.append(list(properties))
        self.keys.append(fqn)
        self.property.append(number)
        self.ndim.append(len(size))
        self.size.extend(size)
        self.file.append(file_no)
        self.offset.append(offset)
        self.crc.append(crc)

    def __len__(self) -> int:
        return len(self.keys)

    def member(self, dumps) -> bytes:
        """``"tensors":{...}`` as JSON bytes (``dumps`` is the document's JSON encoder)."""
        columns = (self.keys, self.properties, self.property, self.ndim, self.size, self.file, self.offset, self.crc)
        return b'"tensors":{' + b",".join(b'"' + name.encode() + b'":' + dumps(col) for name, col in zip(MEMBERS, columns)) + b"}"


class TensorTable:
    """A decoded, checked ``tensors`` member; :meth:`entry` builds the protocol object of one row.

    ``keys``, ``property``, ``ndim``, ``start`` (where a row's sizes begin in ``size``) are lists, one entry per
    row; ``fields`` holds the TensorProperties fields of each distinct properties list; ``first`` is the row of
    the table's first key in the document's ChunkLocations.
    """

    def __init__(self, keys: list, fields: list, prop: list, ndim: list, start: list, size: list, first: int) -> None:
        self.keys, self.fields, self.property, self.ndim, self.start, self.size = keys, fields, prop, ndim, start, size
        self.first = first
        self.row_of: dict[str, int] = dict(zip(keys, range(len(keys))))

    def __len__(self) -> int:
        return len(self.keys)

    def entry(self, i: int) -> TensorStorageMetadata:
        """Row ``i`` as the TensorStorageMetadata the protocol knows (a new object each call)."""
        s, n = self.start[i], self.ndim[i]
        size = torch.Size(self.size[s:s + n])
        chunk = _new(ChunkStorageMetadata)
        chunk.offsets = _ORIGINS[n]  # a Size is immutable: one per dimension count serves every chunk
        chunk.sizes = size
        return TensorStorageMetadata(TensorProperties(*self.fields[self.property[i]]), size, [chunk])


class TableEntries(MutableMapping):
    """``state_dict_metadata`` of a document with a table of whole tensors: the table's keys, then ``rest``.

    The entry of a table key is built when someone asks for it, and from then on is that key's entry (a
    planner may change it in place, or replace it); a key nobody has asked for or changed (in ``rows``, not in
    ``built``) is still exactly its row, so that a planner and a reader may use the table's columns instead
    (:func:`table_of`, :func:`stored_dtypes`). Compares equal to the dict it stands for, and pickles as one.
    """

    def __init__(self, table: TensorTable, rest: dict) -> None:
        self.table, self.rest = table, rest
        self.rows: dict[str, int] = dict(table.row_of)  # the table's keys still present, in order
        self.built: dict[str, Any] = {}

    def __getitem__(self, fqn: str) -> Any:
        entry = self.built.get(fqn)
        if entry is not None:
            return entry
        row = self.rows.get(fqn)
        if row is None:
            return self.rest[fqn]
        entry = self.built[fqn] = self.table.entry(row)
        return entry

    def __setitem__(self, fqn: str, entry: Any) -> None:
        if fqn in self.rows:
            self.built[fqn] = entry
        else:
            self.rest[fqn] = entry

    def __delitem__(self, fqn: str) -> None:
        if fqn in self.rows:
            del self.rows[fqn]
            self.built.pop(fqn, None)
        else:
            del self.rest[fqn]

    def __contains__(self, fqn: object) -> bool:
        return fqn in self.rows or fqn in self.rest

    def __iter__(self) -> Iterator[str]:
        yield from self.rows
        yield from self.rest

    def __len__(self) -> int:
        return len(self.rows) + len(self.rest)

    def __repr__(self) -> str:
        return f"TableEntries({len(self.rows)} table keys, {len(self.rest)} others)"

    def __reduce__(self):
        return dict, (dict(self.items()),)


def table_of(entries: Any) -> Optional[TensorTable]:
    """The table of whole tensors behind ``entries`` (a state_dict_metadata), or None. A key's row holds its entry
    while the key is in ``entries.rows`` and not in ``entries.built`` (see :class:`TableEntries`)."""
    return entries.table if type(entries) is TableEntries else None


def stored_dtypes(entries: Any, fqns: list[str]) -> list[torch.dtype]:
    """The dtype ``entries`` (a state_dict_metadata) records for each tensor of ``fqns``, building no entry of
    the table of whole tensors."""
    if type(entries) is not TableEntries:
        return [entries[fqn].properties.dtype for fqn in fqns]
    table, rows, built = entries.table, entries.rows, entries.built
    dtypes = [fields[0] for fields in table.fields]
    prop = table.property
    out = []
    add = out.append
    for fqn, row in zip(fqns, map(rows.get, fqns)):
        add(dtypes[prop[row]] if row is not None and fqn not in built else entries[fqn].properties.dtype)
    return out


def _int_column(data: dict, name: str, count: Optional[int], where: str) -> np.ndarray:
    values = data[name]
    if type(values) is not list or (count is not None and len(values) != count) or not set(map(type, values)) <= _INT:
        want = "integers" if count is None else f"{count} integers, one per key"
        raise CorruptCheckpointError(f"{where}: tensors table: {name!r} must be a list of {want}")
    try:
        return np.array(values, dtype=np.int64)
    except OverflowError:
        raise CorruptCheckpointError(f"{where}: tensors table: {name!r} holds an integer out of range") from None


def _first_bad(mask: np.ndarray) -> Optional[int]:
    bad = np.flatnonzero(mask)
    return int(bad[0]) if bad.size else None


def decode_table(data: Any, where: str, locations: ChunkLocations) -> TensorTable:
    """Check the ``tensors`` member of a document whose file table is ``locations`` and add its rows there.

    Every rule of docs/format.md for a chunk holds for each row: a listed file, bytes inside it, a checksum
    of 32 bits, a size of at most 64 dimensions each at most MAX_INT; keys appear once (here and, through
    ``locations``, in ``state_dict_metadata``). The first row that breaks one is named.
    """
    if type(data) is not dict or set(data) != set(MEMBERS):
        raise CorruptCheckpointError(f"{where}: malformed tensors table: it must have exactly the members {', '.join(MEMBERS)}")
    keys = data["keys"]
    if type(keys) is not list or not set(map(type, keys)) <= {str}:
        raise CorruptCheckpointError(f"{where}: tensors table: 'keys' must be a list of strings")
    n = len(keys)
    if n > MAX_TABLE_KEYS:
        raise CorruptCheckpointError(f"{where}: tensors table: more than {MAX_TABLE_KEYS} keys")
    if len(set(keys)) != n:
        seen: set = set()
        twice = next(k for k in keys if k in seen or seen.add(k))
        raise CorruptCheckpointError(f"{where}: key {twice!r}: listed twice in the tensors table")
    props_raw = data["properties"]
    if type(props_raw) is not list or len(props_raw) > MAX_PROPERTIES:
        raise CorruptCheckpointError(f"{where}: tensors table: 'properties' must be a list of at most {MAX_PROPERTIES} entries")
    fields = [props_fields(p, f"{where}: tensors table, properties #{i}") for i, p in enumerate(props_raw)]
    prop = _int_column(data, "property", n, where)
    ndim = _int_column(data, "ndim", n, where)
    file_no = _int_column(data, "file", n, where)
    offset = _int_column(data, "offset", n, where)
    crc = _int_column(data, "crc32c", n, where)

    def fault(i: Optional[int], what: str) -> None:
        if i is not None:
            raise CorruptCheckpointError(f"{where}: key {keys[i]!r}: {what}")

    fault(_first_bad((ndim < 0) | (ndim > 64)), "a tensor has 0 to 64 dimensions")
    total = int(ndim.sum())
    size = _int_column(data, "size", total, where)
    start = np.cumsum(ndim) - ndim
    bad_size = _first_bad(size < 0)
    if bad_size is not None:
        fault(int(np.searchsorted(start + ndim, bad_size, "right")), f"negative size {int(size[bad_size])}")
    fault(_first_bad((prop < 0) | (prop >= len(fields))), "its properties number is not in the properties list")
    fault(_first_bad((file_no < 0) | (file_no >= len(locations.file_list))), "its location names a data file the file table lacks")
    fault(_first_bad((crc < 0) | (crc > 0xFFFFFFFF)), "malformed checksum")
    width = np.array([itemsize(f[0]) for f in fields] or [0], dtype=np.int64)[prop]
    file_size = np.array(locations.file_sizes or [0], dtype=np.int64)[file_no]
    # the product of a row's sizes: as floats first (exact enough to bound it without overflow), then exactly
    padded = np.append(size, 1)
    approx = np.multiply.reduceat(padded.astype(np.float64), start) if n else np.zeros(0)
    approx[ndim == 0] = 1.0
    outside = (approx * width + offset > file_size) | (approx * width > 2.0**62)  # no data file is 4 EiB
    exact = np.multiply.reduceat(padded, start) if n else np.zeros(0, dtype=np.int64)
    exact[ndim == 0] = 1
    nbytes = np.where(outside, 0, exact * width)
    outside |= (offset < 0) | (nbytes + offset > file_size)
    i = _first_bad(outside)
    if i is not None:
        fault(i, f"stored bytes at {int(offset[i])} of a tensor of size {list(size[start[i]:start[i] + ndim[i]].tolist())} lie "
              f"outside data file {locations.file_list[int(file_no[i])][0]!r}")
    first = locations.add_whole(keys, file_no, offset, nbytes, crc, ndim, where)
    table = locations.table = TensorTable(keys, fields, prop.tolist(), ndim.tolist(), start.tolist(), size.tolist(), first)
    return table
