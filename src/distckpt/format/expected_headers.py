"""The header a data file has when distckpt's writer wrote it for a given metadata document.

A load checks every chunk it reads against its data file's header (dtype,
shape, place), and a file of tens of thousands of small items made that a
JSON parse, a check and a lookup per entry. The metadata already says, for
every item of a file, its name, dtype, shape and place; the writer writes the
header from exactly those, in file order, in one text form. So a reader
writes the header it expects and compares bytes: a file that begins with
them has a header that passes every rule of docs/format.md, section 4, and
agrees with the metadata on every item. A file that differs in any byte (an
older writer, another page size, damage, a forgery) is parsed and checked
entry by entry as before, which names what is wrong.
"""

from __future__ import annotations

from typing import Iterable, Optional

import numpy as np
import torch

from ..metadata import Metadata, TensorStorageMetadata
from .datafile import VALUE_FORM, dims_text, entry_name, expected_lead, quote, stored_form
from .dtypes import safetensors_code
from .locations import ChunkLocations
from .records import FileStorageData

__all__ = ["expected_leads"]

_ZERO_NAMES = ["@" + ",".join(["0"] * n) for n in range(65)]  # the entry-name suffix of a chunk at the origin


def expected_leads(md: Metadata, names: Iterable[str]) -> dict[str, bytes]:
    """The leading bytes (length prefix and header) of each named data file, as distckpt's writer wrote them
    for ``md``; files it cannot tell (metadata of another layout, items not back to back) are left out."""
    fsd = md.storage_data
    if not isinstance(fsd, FileStorageData) or not isinstance(fsd.items, ChunkLocations):
        return {}
    locations = fsd.items
    number = {name: i for i, (name, _) in enumerate(locations.file_list)}
    wanted = [number[n] for n in names if n in number]
    if not wanted or len(locations) == 0:
        return {}
    file_no = np.frombuffer(locations.file_no, dtype=np.int64)
    begin = np.frombuffer(locations.begin, dtype=np.int64)
    length = np.frombuffer(locations.length, dtype=np.int64)
    rows = np.flatnonzero(np.isin(file_no, wanted))
    # file order; an empty item is written before the item that then starts at its offset (it moved nothing),
    # and empty items at one offset in the document's order, as the writer mostly wrote them
    rows = rows[np.lexsort((rows, length[rows] > 0, begin[rows], file_no[rows]))]
    describe = _Rows(md, locations, rows)
    out: dict[str, bytes] = {}
    cuts = np.flatnonzero(np.diff(file_no[rows])) + 1
    for part in np.split(rows, cuts):
        if not part.size:
            continue
        name, info = locations.file_list[int(file_no[part[0]])]
        columns = describe.columns(part)
        if columns is None:
            continue
        lead = expected_lead(columns, info.save_id or fsd.save_id, info.rank)
        ends = np.cumsum(length[part])
        if int(begin[part[0]]) != len(lead) or not np.array_equal(begin[part[1:]], len(lead) + ends[:-1]):
            continue  # not back to back from the data section's start: not the writer's layout
        out[name] = lead
    return out


class _Rows:
    """The data-file entries of rows, as :func:`header_text`'s columns: from the table of whole tensors, or
    from the keys' entries."""

    def __init__(self, md: Metadata, locations: ChunkLocations, rows: np.ndarray) -> None:
        self.md, self.locations = md, locations
        self.table = locations.table
        self.first = locations.whole_first
        self.count = len(self.table) if self.table is not None else 0
        if self.table is not None:
            self.codes = [safetensors_code(fields[0]) for fields in self.table.fields]
            self.raw = [code == "U8" and fields[0] != torch.uint8 for code, fields in zip(self.codes, self.table.fields)]
        outside = rows[(rows < self.first) | (rows >= self.first + self.count)]
        self.others = self._other_rows(outside) if outside.size else {}

    def _other_rows(self, rows: np.ndarray) -> dict:
        """Row -> (key, chunk offsets and sizes, or None for a value) of the rows not in the table."""
        wanted = bytearray(len(self.locations))
        for r in rows.tolist():
            wanted[r] = 1
        sdm = self.md.state_dict_metadata
        out = {}
        for fqn, (first, chunk_rows) in self.locations.keys_.items():
            count = 1 if chunk_rows is None else len(chunk_rows)
            if wanted.find(1, first, first + count) < 0:
                continue
            if chunk_rows is None:
                out[first] = (fqn, None)
                continue
            entry = sdm.get(fqn)
            if not isinstance(entry, TensorStorageMetadata) or len(entry.chunks) != count:
                return {}
            for at, chunk in enumerate(entry.chunks):
                out[first + at] = (fqn, (tuple(chunk.offsets), tuple(chunk.sizes)), entry.properties.dtype)
        return out

    def columns(self, rows: np.ndarray) -> Optional[tuple[list, list, list, list]]:
        """Names (as JSON strings), codes, shapes (as text) and sizes of ``rows`` (in file order), or None where an
        entry cannot be told or the writer would have renamed one."""
        sizes = np.frombuffer(self.locations.length, dtype=np.int64)[rows].tolist()
        at = rows - self.first
        if self.count and bool(((at >= 0) & (at < self.count)).all()):
            # rows of the table only: names <key>@0,...,0 are distinct as the keys are (a name's last "@" ends its key)
            table, codes = self.table, self.codes
            keys, prop, ndim, start, size = table.keys, table.property, table.ndim, table.start, table.size
            at = at.tolist()
            names = [quote(keys[i] + _ZERO_NAMES[ndim[i]]) for i in at]
            dims = [str(size[start[i]]) if ndim[i] == 1 else ",".join(map(str, size[start[i]:start[i] + ndim[i]])) for i in at]
            if any(self.raw):
                dims = [str(n) if self.raw[prop[i]] else d for i, d, n in zip(at, dims, sizes)]
            return names, [codes[prop[i]] for i in at], dims, sizes
        entries = self._entries(rows.tolist(), sizes)
        if entries is None or len({e[0] for e in entries}) != len(entries) or any(e[0] == "__metadata__" for e in entries):
            return None
        return [quote(e[0]) for e in entries], [e[1] for e in entries], [dims_text(e[2]) for e in entries], sizes

    def _entries(self, rows: list[int], sizes: list[int]) -> Optional[list[tuple]]:
        """``(name, code, shape)`` of each row, or None where one cannot be told."""
        table, first, count, codecs = self.table, self.first, self.count, self.locations.codecs
        out = []
        add = out.append
        for r, nbytes in zip(rows, sizes):
            i = r - first
            if 0 <= i < count:
                p = table.property[i]
                s, n = table.start[i], table.ndim[i]
                add((table.keys[i] + _ZERO_NAMES[n], self.codes[p], (nbytes,) if self.raw[p] else table.size[s:s + n]))
                continue
            other = self.others.get(r)
            if other is None:
                return None
            if other[1] is None:
                add((other[0], VALUE_FORM, (nbytes,)))
            elif r in codecs:
                add((entry_name(other[0], other[1][0]), VALUE_FORM, (nbytes,)))
            else:
                add((entry_name(other[0], other[1][0]), *stored_form(other[2], other[1][1], nbytes)))
        return out
