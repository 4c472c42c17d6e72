"""Where a metadata document says each stored item lives, decoded and checked.

Format 2.x keeps each chunk's location inline, as ``[offsets, sizes, file,
begin, crc]``, beside a table of data files; format 1.x lists locations apart
from the entries. Every location must name a listed file, lie inside it,
carry a well-formed checksum, appear once and overlap no other: a document
that breaks any of these is a CorruptCheckpointError naming the key.
"""

from __future__ import annotations

import bisect
import math
from array import array
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any, Optional

import numpy as np
import torch

from ..errors import CorruptCheckpointError
from ..metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from .checksum import format_crc
from .chunk_codec import CODEC_SEPARATOR, DECODED_CRC
from .dtypes import itemsize
from .fields import MAX_INT, ints
from .names import SAVE_ID, check_file_name
from .records import REFERENCE_SEPARATOR, FileInfo, FileStorageData, StorageInfo, split_reference


def checked_chunk(chunk: ChunkStorageMetadata, size: torch.Size, here: str) -> ChunkStorageMetadata:
    """``chunk``, once its box is known to lie inside a tensor of ``size``."""
    offsets, sizes, ndim = chunk.offsets, chunk.sizes, len(size)
    if len(offsets) != ndim or len(sizes) != ndim:
        raise CorruptCheckpointError(f"{here}: chunk {list(offsets)}+{list(sizes)} does not have the tensor's {ndim} dimensions")
    for o, n, d in zip(offsets, sizes, size):
        if o + n > d:
            raise CorruptCheckpointError(f"{here}: chunk {list(offsets)}+{list(sizes)} lies outside tensor of size {list(size)}")
    return chunk


def check_cover(chunks: list, size: torch.Size, here: str, boxes: Optional[tuple[list, list]] = None) -> None:
    """The chunks, each already known to lie inside the tensor, cover every element of it exactly once.

    ``boxes`` holds the chunks' offsets and sizes (two lists of one list per chunk) where the caller
    has them. Equal element counts plus pairwise disjoint boxes is an exact cover; disjointness is
    checked on the grid the chunks' own boundaries draw (a chunk of an ordinary sharding is one
    cell of it).
    """
    total = math.prod(size)
    ndim = len(size)
    if len(chunks) < 2:
        held = sum(math.prod(c.sizes) for c in chunks)
        off = end = pair = None
    elif len(chunks) <= _FEW_CHUNKS:
        if boxes is None:
            boxes = ([list(c.offsets) for c in chunks], [list(c.sizes) for c in chunks])
        held = sum(math.prod(s) for s in boxes[1])
        pair = _overlapping_pair_few(*boxes) if held == total and total else None
        off = end = None
    else:
        if boxes is None:
            boxes = ([list(c.offsets) for c in chunks], [list(c.sizes) for c in chunks])
        off = np.array(boxes[0], dtype=np.int64).reshape(len(chunks), ndim)
        extent = np.array(boxes[1], dtype=np.int64).reshape(len(chunks), ndim)
        held = int(extent.prod(axis=1).sum()) if ndim else len(chunks)  # each size <= MAX_INT: products stay exact
        end = off + extent
        pair = None
    if held != total:
        raise CorruptCheckpointError(
            f"{here}: its chunks hold {held} of the tensor's {total} elements; a checkpoint stores every element "
            "exactly once. It was written by a faulty planner or edited; restore it from a copy.")
    if off is not None and total:
        pair = _overlapping_pair(off, end)
    if pair is not None:
        a, b = chunks[pair[0]], chunks[pair[1]]
        raise CorruptCheckpointError(
            f"{here}: chunks {list(a.offsets)}+{list(a.sizes)} and {list(b.offsets)}+{list(b.sizes)} overlap, so "
            "other elements are stored nowhere. It was written by a faulty planner or edited; restore it from a copy.")


# up to this many chunks, comparing every pair in Python beats the grid in numpy, whose calls cost
# microseconds each on arrays this small (a tensor sharded over a few ranks, the common case)
_FEW_CHUNKS = 8


def _overlapping_pair_few(offs: list, sizes: list) -> Optional[tuple[int, int]]:
    """As :func:`_overlapping_pair`, for a few boxes given as lists of offsets and sizes."""
    boxes = [(i, o, s) for i, (o, s) in enumerate(zip(offs, sizes)) if all(s)]
    for a in range(len(boxes)):
        i, oi, si = boxes[a]
        for j, oj, sj in boxes[a + 1:]:
            if all(x < y + m and y < x + n for x, n, y, m in zip(oi, si, oj, sj)):
                return i, j
    return None


MAX_GRID_CELLS = 1 << 24  # a grid of boxes' cuts is drawn (an int64 per cell) up to this many cells, else swept


def _overlapping_pair(off: np.ndarray, end: np.ndarray) -> Optional[tuple[int, int]]:
    """Indices of two boxes ``[off, end)`` (rows) that share an element, or None; empty boxes share none."""
    keep = np.flatnonzero((end > off).all(axis=1))
    if len(keep) < 2:
        return None
    off, end = off[keep], end[keep]
    n, ndim = off.shape
    split = [k for k in range(ndim) if (off[:, k] != off[0, k]).any() or (end[:, k] != end[0, k]).any()]
    if len(split) <= 1:  # boxes that differ along one dimension only (row or column shards): intervals
        k = split[0] if split else 0
        order = np.argsort(off[:, k], kind="stable") if ndim else np.arange(n)
        if not ndim:
            return int(keep[0]), int(keep[1])
        meet = np.flatnonzero(off[order[1:], k] < end[order[:-1], k])
        return None if not meet.size else (int(keep[order[meet[0]]]), int(keep[order[meet[0] + 1]]))
    lo, hi, dims = [], [], []
    for k in range(ndim):
        cuts = np.unique(np.concatenate([off[:, k], end[:, k]]))
        lo.append(np.searchsorted(cuts, off[:, k]))
        hi.append(np.searchsorted(cuts, end[:, k]))
        dims.append(len(cuts) - 1)
    if all((h - lo_k == 1).all() for lo_k, h in zip(lo, hi)):  # every box is one cell: disjoint iff the cells differ
        cell = np.ravel_multi_index(tuple(lo), tuple(dims)) if ndim else np.zeros(n, dtype=np.int64)
        order = np.argsort(cell, kind="stable")
        same = np.flatnonzero(cell[order][1:] == cell[order][:-1])
        return None if not same.size else (int(keep[order[same[0]]]), int(keep[order[same[0] + 1]]))
    if math.prod(dims) <= MAX_GRID_CELLS:
        seen = np.full(tuple(dims), -1, dtype=np.int64)
        for i in range(n):
            box = tuple(slice(int(lo[k][i]), int(hi[k][i])) for k in range(ndim))
            taken = seen[box]
            if (taken >= 0).any():
                return int(keep[int(taken[taken >= 0].flat[0])]), int(keep[i])
            seen[box] = i
        return None
    pair = _overlapping_pair_sweep(off, end, split)  # a grid too fine to draw
    return None if pair is None else (int(keep[pair[0]]), int(keep[pair[1]]))


def _overlapping_pair_sweep(off: np.ndarray, end: np.ndarray, split: list[int]) -> Optional[tuple[int, int]]:
    """As :func:`_overlapping_pair`, for non-empty boxes, by a sweep along one dimension of ``split`` (those in
    which the boxes differ): two boxes share an element only while both are open in the sweep, and then only if
    they meet in the other dimensions. Boxes open at once are kept pairwise disjoint (the first pair that is not
    is the answer), so with two dimensions that differ a new box is compared with its two neighbours in the other
    dimension only: n log n, where comparing every pair took minutes for a few hundred thousand chunks of an
    irregular tiling (a brick wall: its grid is too fine to draw and no box is one cell of it)."""
    sweep = max(split, key=lambda k: len(np.unique(off[:, k])))
    others = [k for k in split if k != sweep]
    n = len(off)
    # events in order of position; at one position closings (0) before openings (1): boxes are half-open
    kind = np.concatenate([np.ones(n, dtype=np.int64), np.zeros(n, dtype=np.int64)])
    where = np.concatenate([off[:, sweep], end[:, sweep]])
    which = np.concatenate([np.arange(n), np.arange(n)])
    order = np.lexsort((kind, where))
    events = zip(kind[order].tolist(), which[order].tolist())
    if len(others) == 1:
        k = others[0]
        lo, hi = off[:, k].tolist(), end[:, k].tolist()
        begins: list[int] = []  # the open boxes' intervals in dimension k, disjoint, sorted by begin
        owners: list[int] = []
        for opening, i in events:
            at = bisect.bisect_left(begins, lo[i])
            if not opening:
                del begins[at], owners[at]  # disjoint non-empty intervals: each begin is one box's
                continue
            if at and hi[owners[at - 1]] > lo[i]:
                return owners[at - 1], i
            if at < len(begins) and begins[at] < hi[i]:
                return i, owners[at]
            begins.insert(at, lo[i])
            owners.insert(at, i)
        return None
    open_: dict[int, None] = {}  # three or more dimensions differ: a new box against every open one
    for opening, i in events:
        if not opening:
            del open_[i]
            continue
        if open_:
            rows = np.fromiter(open_, dtype=np.int64, count=len(open_))
            meet = ((off[rows][:, others] < end[i, others]) & (end[rows][:, others] > off[i, others])).all(axis=1)
            if meet.any():
                return int(rows[int(np.flatnonzero(meet)[0])]), i
        open_[i] = None
    return None


class ChunkLocations(Mapping):
    """``FileStorageData.items`` of a decoded format-2.x document: MetadataIndex -> StorageInfo.

    A document at thousands of ranks lists millions of chunks, and a load
    looks up only those it reads. So locations are kept as columns (file,
    begin, length, checksum; one row per chunk or value, in document order)
    with a table per key from chunk offsets to row, and a StorageInfo is
    built when asked for. Read-only; compares equal to the dict it stands for.
    """

    def __init__(self, file_list: list) -> None:
        self.file_list = file_list  # [(name, FileInfo)], in the document's order
        self.file_sizes = [info.size for _, info in file_list]
        self.keys_: dict[str, tuple[int, Optional[dict]]] = {}  # fqn -> (first row, chunk offsets -> row - first) or None for values
        # signed 64-bit columns: every value is checked to lie in [0, MAX_INT] before it is appended
        self.file_no = array("q")
        self.begin = array("q")
        self.length = array("q")
        self.crc = array("q")
        self.codecs: dict[int, str] = {}  # row -> codec name, for the rows not stored as they are (format 2.1)
        # the rows of a table of whole tensors (format 3.0): key -> row, each row one chunk at the origin
        self.whole_: dict[str, int] = {}
        self.whole_first = 0
        self.whole_ndim: list[int] = []
        self.table: Any = None  # the decoded table itself (format/tensor_table.py), rows from ``whole_first``

    def add_whole(self, keys: list, file_no: np.ndarray, begin: np.ndarray, length: np.ndarray, crc: np.ndarray,
                  ndim: np.ndarray, where: str) -> int:
        """The rows of a table of whole tensors, already checked; returns the row of the first."""
        if self.whole_ or not self.keys_.keys().isdisjoint(keys):
            raise CorruptCheckpointError(f"{where}: a key of the tensors table is listed twice")
        first = self.whole_first = len(self.begin)
        for column, values in ((self.file_no, file_no), (self.begin, begin), (self.length, length), (self.crc, crc)):
            column.frombytes(np.ascontiguousarray(values, dtype=np.int64).tobytes())
        self.whole_ = dict(zip(keys, range(first, first + len(keys))))
        self.whole_ndim = ndim.tolist()
        return first

    def _whole_row(self, fqn: str, offsets: Any) -> Optional[int]:
        row = self.whole_.get(fqn)
        if row is None or offsets is None or len(offsets) != self.whole_ndim[row - self.whole_first] or any(offsets):
            return None
        return row

    def tensor_rows(self, fqn: str, here: str) -> dict:
        """The offsets table of tensor ``fqn``, whose chunks are then appended to the columns in order."""
        entry = self.keys_.get(fqn)
        if entry is None:
            if fqn in self.whole_:
                raise CorruptCheckpointError(f"{here}: key is listed twice (also in the tensors table)")
            entry = self.keys_[fqn] = (len(self.begin), {})
        elif entry[1] is None or entry[0] + len(entry[1]) != len(self.begin):
            raise CorruptCheckpointError(f"{here}: key is listed twice")
        return entry[1]

    def add(self, fqn: str, offsets: Optional[torch.Size], file_no: int, begin: int, length: int, crc: int, here: str,
            codec: Optional[str] = None) -> None:
        """One location whose fields are already checked: a chunk of ``fqn`` at ``offsets``, or its value if None;
        ``codec`` names how its bytes are stored, if not as they are."""
        if offsets is None:
            if fqn in self.keys_ or fqn in self.whole_:
                raise CorruptCheckpointError(f"{here}: key is listed twice")
            self.keys_[fqn] = (len(self.begin), None)
        else:
            rows = self.tensor_rows(fqn, here)
            count = len(rows)
            rows[offsets] = count
            if len(rows) == count:
                raise CorruptCheckpointError(f"{here}: chunk {list(offsets)} is listed twice")
        if codec is not None:
            self.codecs[len(self.begin)] = codec
        self.file_no.append(file_no)
        self.begin.append(begin)
        self.length.append(length)
        self.crc.append(crc)

    def _row(self, index: Any) -> int:
        fqn = getattr(index, "fqn", None)
        entry = self.keys_.get(fqn)
        if entry is None and self.whole_:
            row = self._whole_row(fqn, getattr(index, "offset", None))
            if row is not None:
                return row
        if entry is not None:
            first, rows = entry
            offset = index.offset
            if rows is None:
                if offset is None:
                    return first
            elif offset is not None:
                at = rows.get(offset)
                if at is not None:
                    return first + at
        raise KeyError(index)

    def __getitem__(self, index: MetadataIndex) -> StorageInfo:
        return self.info(self._row(index))

    def row(self, fqn: str, offsets: tuple) -> Optional[int]:
        """The row of the chunk of tensor ``fqn`` at ``offsets``, or None if the document has none."""
        entry = self.keys_.get(fqn)
        if entry is None or entry[1] is None:
            return self._whole_row(fqn, offsets) if entry is None and self.whole_ else None
        at = entry[1].get(offsets)
        return None if at is None else entry[0] + at

    def rows(self, fqns: list[str], offsets: list[tuple]) -> list[Optional[int]]:
        """:meth:`row` of each pair, the keys of the table of whole tensors looked up in one pass."""
        whole, first, ndims = self.whole_, self.whole_first, self.whole_ndim
        out = list(map(whole.get, fqns)) if whole else [None] * len(fqns)
        for i, (row, at) in enumerate(zip(out, offsets)):
            if row is None or len(at) != ndims[row - first] or any(at):
                out[i] = self.row(fqns[i], at)
        return out

    def info(self, row: int) -> StorageInfo:
        """Where the chunk of ``row`` is stored."""
        info = StorageInfo(self.file_list[self.file_no[row]][0], self.begin[row], self.length[row], self.crc[row])
        return info if not self.codecs or row not in self.codecs else replace(info, codec=self.codecs[row])

    def __contains__(self, index: object) -> bool:
        try:
            self._row(index)
        except KeyError:
            return False
        return True

    def __iter__(self) -> Iterator[MetadataIndex]:
        ndims = self.whole_ndim
        for fqn, row in self.whole_.items():
            yield MetadataIndex(fqn, torch.Size([0] * ndims[row - self.whole_first]))
        for fqn, (_, rows) in self.keys_.items():
            if rows is None:
                yield MetadataIndex(fqn)
            else:
                for offsets in rows:
                    yield MetadataIndex(fqn, offsets)

    def __len__(self) -> int:
        return len(self.begin)

    def __repr__(self) -> str:
        return f"ChunkLocations({len(self)} items in {len(self.file_list)} files)"

    def check_no_overlap(self, where: str) -> None:
        """No two locations share a byte of a data file (zero-length ones included, as :func:`check_no_overlap`)."""
        n = len(self.begin)
        if n < 2:
            return
        f = np.frombuffer(self.file_no, dtype=np.int64)
        b = np.frombuffer(self.begin, dtype=np.int64)  # begin + length <= a file size <= MAX_INT: no overflow
        e = b + np.frombuffer(self.length, dtype=np.int64)
        order = np.lexsort((e, b, f))
        f, b, e = f[order], b[order], e[order]
        bad = np.flatnonzero((f[1:] == f[:-1]) & (b[1:] < e[:-1]))
        if bad.size:
            i = int(bad[0])
            k0, k1 = self._fqn_of_row(int(order[i])), self._fqn_of_row(int(order[i + 1]))
            raise CorruptCheckpointError(f"{where}: items {k0!r} and {k1!r} overlap in data file {self.file_list[int(f[i])][0]!r}")

    def _fqn_of_row(self, row: int) -> str:
        if self.whole_first <= row < self.whole_first + len(self.whole_):
            return list(self.whole_)[row - self.whole_first]
        for fqn, (first, rows) in self.keys_.items():
            if first <= row < first + (1 if rows is None else len(rows)):
                return fqn
        raise IndexError(row)


def inline_chunk(c: Any, fqn: str, size: torch.Size, width: int, locations: ChunkLocations, here: str) -> ChunkStorageMetadata:
    """One format-2.x chunk ``[offsets, sizes, file, begin, crc]`` (format 2.1: and ``{"codec": [...], "length":
    n}`` when stored through a codec), checked field by field: the reference for :func:`inline_chunks`, and what
    names the fault when its fast checks fail."""
    if type(c) is not list or len(c) not in (5, 6):
        raise CorruptCheckpointError(f"{here}: malformed chunk {c!r:.200}")
    chunk = checked_chunk(ChunkStorageMetadata(ints(c[0], here), ints(c[1], here)), size, here)
    length, codec = math.prod(chunk.sizes) * width, None
    if len(c) == 6:
        codec, length = stored_codec(c[5], True, here)
    add_item(locations, fqn, chunk.offsets, c[2], c[3], length, c[4], here, codec)
    return chunk


def stored_codec(data: Any, tensor: bool, here: str) -> tuple[str, Optional[int]]:
    """The codec record of an item (format 2.1): its codec's name and, for a tensor chunk, its stored length; format 4.0:
    the name bound to the CRC-32C of the decoded bytes, where the record holds one."""
    want = {"codec", "length"} if tensor else {"codec"}
    names = data.get("codec") if type(data) is dict and set(data) in (want, want | {"crc32c"}) else None
    if not (type(names) is list and 0 < len(names) <= 16
            and all(type(n) is str and 0 < len(n) <= 200 and CODEC_SEPARATOR not in n for n in names)):
        raise CorruptCheckpointError(f"{here}: malformed codec record {data!r:.200}")
    length = data.get("length")
    if tensor and not (type(length) is int and 0 <= length <= MAX_INT):
        raise CorruptCheckpointError(f"{here}: malformed stored length {length!r:.40}")
    name = CODEC_SEPARATOR.join(names)
    if "crc32c" in data:  # the CRC-32C of the decoded bytes (format 4.0): carried in the name, as the writer names it
        if not is_crc(data["crc32c"]):
            raise CorruptCheckpointError(f"{here}: malformed decoded checksum {data['crc32c']!r:.40} in codec record")
        name = f"{name}{DECODED_CRC}{format_crc(data['crc32c'])}"
    return name, length


_new = object.__new__


def inline_chunks(chunks_raw: list, fqn: str, size: torch.Size, width: int, locations: ChunkLocations, here: str) -> list:
    """The chunks of one tensor entry, their locations appended to ``locations``.

    The hot loop of decoding metadata at thousands of ranks: the checks of
    :func:`inline_chunk`, fused, and chunks built without their constructor's
    call. Anything the fast checks do not accept goes through
    :func:`inline_chunk`, which raises the precise error.
    """
    ndim = len(size)
    dims = tuple(size)
    file_sizes = locations.file_sizes
    nfiles = len(file_sizes)
    rows = locations.tensor_rows(fqn, here)
    if len(chunks_raw) == 1 and not rows:  # the common case of one chunk as large as the tensor, checked in one go
        c = chunks_raw[0]
        if type(c) is list and len(c) == 5:
            o_raw, s_raw, file_no, begin, crc = c
            if (type(o_raw) is list and type(s_raw) is list and len(s_raw) == ndim and list(dims) == s_raw
                    and o_raw == [0] * ndim and all(type(x) is int for x in s_raw) and all(type(x) is int for x in o_raw)):
                nbytes = width * math.prod(dims)
                if (type(file_no) is int and 0 <= file_no < nfiles and type(begin) is int and 0 <= begin
                        and type(crc) is int and 0 <= crc <= 0xFFFFFFFF and begin + nbytes <= file_sizes[file_no]):
                    chunk = _new(ChunkStorageMetadata)
                    chunk.offsets = torch.Size(o_raw)
                    chunk.sizes = size if type(size) is torch.Size else torch.Size(s_raw)
                    rows[chunk.offsets] = 0
                    locations.file_no.append(file_no)
                    locations.begin.append(begin)
                    locations.length.append(nbytes)
                    locations.crc.append(crc)
                    return [chunk]
    add_file, add_begin, add_length, add_crc = (locations.file_no.append, locations.begin.append, locations.length.append,
                                                locations.crc.append)
    chunks = []
    offs: list = []  # each chunk's offsets and sizes lists, by reference: arrays are built once, after the loop
    sizes: list = []
    for c in chunks_raw:
        if type(c) is list and len(c) == 5:
            o_raw, s_raw, file_no, begin, crc = c
            if type(o_raw) is list and type(s_raw) is list and len(o_raw) == ndim and len(s_raw) == ndim:
                nbytes = width
                for o, n, d in zip(o_raw, s_raw, dims):
                    # d <= MAX_INT was checked with the size, so o + n <= d bounds o and n too
                    if type(o) is not int or type(n) is not int or o < 0 or n < 0 or o + n > d:
                        break
                    nbytes *= n
                else:
                    if (type(file_no) is int and 0 <= file_no < nfiles and type(begin) is int and 0 <= begin
                            and type(crc) is int and 0 <= crc <= 0xFFFFFFFF and begin + nbytes <= file_sizes[file_no]):
                        offsets = torch.Size(o_raw)
                        chunk = _new(ChunkStorageMetadata)
                        chunk.offsets = offsets
                        chunk.sizes = torch.Size(s_raw)
                        count = len(rows)
                        rows[offsets] = count
                        if len(rows) == count:
                            raise CorruptCheckpointError(f"{here}: chunk {list(offsets)} is listed twice")
                        add_file(file_no)
                        add_begin(begin)
                        add_length(nbytes)
                        add_crc(crc)
                        chunks.append(chunk)
                        offs.append(o_raw)
                        sizes.append(s_raw)
                        continue
        chunk = inline_chunk(c, fqn, size, width, locations, here)  # raises the precise error
        chunks.append(chunk)
        offs.append(list(chunk.offsets))
        sizes.append(list(chunk.sizes))
    if not (len(chunks) == 1 and sizes[0] == list(dims)):  # one chunk as large as the tensor covers it exactly
        check_cover(chunks, size, here, (offs, sizes))
    return chunks


def decode_file_table(data: Any, where: str) -> FileStorageData:
    """The ``$files`` member of format 2.x: save id and data-file table; ``items`` is an empty
    :class:`ChunkLocations` that the entries fill in."""

    if not isinstance(data, dict) or set(data) != {"save_id", "files"}:
        raise CorruptCheckpointError(f"{where}: malformed storage data")
    save_id, files_raw = data["save_id"], data["files"]
    if not isinstance(save_id, str) or not isinstance(files_raw, list):
        raise CorruptCheckpointError(f"{where}: malformed storage data")
    files = {}
    for info in files_raw:
        if not (isinstance(info, list) and len(info) in (4, 5)):
            raise CorruptCheckpointError(f"{where}: malformed data-file entry {info!r:.200}")
        name = check_file_name(info[0], where) if len(info) == 4 else check_reference(info[0], info[4], save_id, where)
        if not (all(type(x) is int and 0 <= x <= MAX_INT for x in info[1:3]) and is_crc(info[3])):
            raise CorruptCheckpointError(f"{where}: malformed entry for data file {name!r}")
        if name in files:
            raise CorruptCheckpointError(f"{where}: data file {name!r} is listed twice")
        files[name] = FileInfo(info[1], info[2], info[3], None if len(info) == 4 else info[4])
    return FileStorageData(save_id, files, ChunkLocations(list(files.items())))


def check_reference(key: Any, save_id: Any, own_save_id: str, where: str) -> str:
    """A referenced data file's table entry (format 4.0): ``<checkpoint>/<file name>``, both plain names (a sibling
    checkpoint of the same run, never a path that leaves it), and the id of the save that stored it."""
    parts = split_reference(key) if isinstance(key, str) else None
    if parts is None or REFERENCE_SEPARATOR in parts[1]:
        raise CorruptCheckpointError(f"{where}: referenced data file {key!r:.200} is not <checkpoint>/<file name>; the "
                                     "metadata is damaged or hostile")
    check_file_name(parts[0], f"{where}: reference {key!r:.200}")
    check_file_name(parts[1], f"{where}: reference {key!r:.200}")
    if not (isinstance(save_id, str) and SAVE_ID.match(save_id)) or save_id == own_save_id:
        raise CorruptCheckpointError(f"{where}: referenced data file {key!r:.200} names save {save_id!r:.80}, which is not the "
                                     "id of another save (1 to 64 of [0-9A-Za-z_-]); the metadata is damaged or hostile")
    return key


def is_crc(value: Any) -> bool:
    return type(value) is int and 0 <= value <= 0xFFFFFFFF


def add_item(locations: ChunkLocations, fqn: str, offsets: Optional[torch.Size], file_no: Any, begin: Any, length: int,
             crc: Any, where: str, codec: Optional[str] = None) -> None:
    """Check one location's fields and add it: a chunk of ``fqn`` at ``offsets``, or its value if None."""
    file_list = locations.file_list
    if type(file_no) is not int or not 0 <= file_no < len(file_list):
        raise CorruptCheckpointError(f"{where}: location names data file #{file_no!r:.20}, which the file table lacks")
    name, info = file_list[file_no]
    if not (type(begin) is int and type(length) is int and 0 <= begin <= MAX_INT and 0 <= length and begin + length <= info.size):
        raise CorruptCheckpointError(f"{where}: stored bytes {begin!r:.20}+{length} lie outside data file {name!r}")
    if type(crc) is not int or not 0 <= crc <= 0xFFFFFFFF:
        raise CorruptCheckpointError(f"{where}: malformed checksum {crc!r:.20}")
    locations.add(fqn, offsets, file_no, begin, length, crc, where, codec)


def cross_check(md: Metadata, fsd: FileStorageData, where: str) -> None:
    """Every stored chunk and value has exactly one storage item of the right length."""
    expected = 0
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            size = itemsize(entry.properties.dtype)
            for c in entry.chunks:
                si = fsd.items.get(MetadataIndex(fqn, c.offsets))
                if si is None:
                    raise CorruptCheckpointError(f"{where}: key {fqn!r} chunk {list(c.offsets)} has no storage item")
                want = math.prod(c.sizes) * size
                if si.length != want:
                    raise CorruptCheckpointError(
                        f"{where}: key {fqn!r} chunk {list(c.offsets)}: {si.length} bytes stored, shape {list(c.sizes)} "
                        f"of {entry.properties.dtype} needs {want}")
                expected += 1
        else:
            if MetadataIndex(fqn) not in fsd.items:
                raise CorruptCheckpointError(f"{where}: value {fqn!r} has no storage item")
            expected += 1
    if expected != len(fsd.items):
        raise CorruptCheckpointError(f"{where}: {len(fsd.items)} storage items for {expected} chunks and values")


def check_no_overlap(items: dict, files: dict, where: str) -> None:
    spans: dict[str, list] = {name: [] for name in files}
    for index, si in items.items():
        spans[si.file].append((si.offset, si.offset + si.length, index.fqn))
    for name, lst in spans.items():
        lst.sort()
        for (b0, e0, k0), (b1, _, k1) in zip(lst, lst[1:]):
            if b1 < e0:
                raise CorruptCheckpointError(f"{where}: items {k0!r} and {k1!r} overlap in data file {name!r}")
