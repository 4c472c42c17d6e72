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

from typing import Iterable

import numpy as np
import torch

from ..metadata import Metadata, TensorStorageMetadata
from .datafile import VALUE_FORM, entry_name, expected_lead, stored_form
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
        f = int(file_no[part[0]])
        name, info = locations.file_list[f]
        entries = describe.entries(part.tolist())
        if entries is None:
            continue
        lead = expected_lead(entries, fsd.save_id, info.rank)
        if lead is None:
            continue
        ends = np.cumsum(length[part])
        if int(begin[part[0]]) != len(lead) or not np.array_equal(begin[part[1:]], len(lead) + ends[:-1]):
            continue  # not back to back from the data section's start: not the writer's layout
        out[name] = lead
    return out


class _Rows:
    """Each row's data-file entry ``(name, code, shape, nbytes)``, from the table of whole tensors or the
    keys' entries."""

    def __init__(self, md: Metadata, locations: ChunkLocations, rows: np.ndarray) -> None:
        self.md, self.locations = md, locations
        self.table = locations.table
        self.first = locations.whole_first
        self.count = len(self.table) if self.table is not None else 0
        self.length = locations.length
        if self.table is not None:
            self.codes = [safetensors_code(fields[0]) for fields in self.table.fields]
            self.raw = [code == "U8" and fields[0] != torch.uint8 for code, fields in zip(self.codes, self.table.fields)]
        outside = rows[(rows < self.first) | (rows >= self.first + self.count)]
        self.others = self._other_rows(outside) if outside.size else {}

    def _other_rows(self, rows: np.ndarray) -> dict:
        """Row -> (key, chunk offsets and sizes, or None for a value) of the rows not in the table."""
        wanted = bytearray(len(self.length))
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

    def entries(self, rows: list[int]):
        """The entries of ``rows`` (in file order), or None where one cannot be told."""
        table, first, count, length, codecs = self.table, self.first, self.count, self.length, self.locations.codecs
        out = []
        add = out.append
        for r in rows:
            nbytes = length[r]
            i = r - first
            if 0 <= i < count:
                p = table.property[i]
                s, n = table.start[i], table.ndim[i]
                shape = (nbytes,) if self.raw[p] else table.size[s:s + n]
                add((table.keys[i] + _ZERO_NAMES[n], self.codes[p], shape, nbytes))
                continue
            other = self.others.get(r)
            if other is None:
                return None
            if other[1] is None:
                add((other[0], VALUE_FORM, (nbytes,), nbytes))
            elif r in codecs:
                add((entry_name(other[0], other[1][0]), VALUE_FORM, (nbytes,), nbytes))
            else:
                add((entry_name(other[0], other[1][0]), *stored_form(other[2], other[1][1], nbytes), nbytes))
        return out
