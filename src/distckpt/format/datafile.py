"""Data files: each is a valid safetensors file.

Layout: 8-byte little-endian header length N, N bytes of JSON header (padded
with spaces so that the data section starts at a multiple of DATA_ALIGN),
then the items back to back. The header is written first, from the plan, so
items can be written in parallel at known offsets. ``__metadata__`` binds the
file to its save (``save_id``).
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Callable, NamedTuple, Optional

import torch

from .. import knobs
from ..errors import CorruptCheckpointError
from . import DATA_FILE_VERSION_STR, FORMAT_NAME
from .checksum import crc32c
from .dtypes import ITEMSIZE, SAFETENSORS_CODES, safetensors_code

__all__ = ["Entry", "build_header", "read_header", "HeaderInfo"]

quote = json.encoder.encode_basestring  # a JSON string literal, as json.dumps(..., ensure_ascii=False) writes it

_MAX_ENTRIES = 50_000_000
_INT = {int}

# The data section starts on a page boundary: copies between the page cache and
# tensor memory (64-byte aligned) are slower when source and destination are
# not equally aligned within a cache line, and direct I/O needs block alignment.
DATA_ALIGN = knobs.PAGE_BYTES


class Entry(NamedTuple):
    """One item of a data file: a tensor chunk or a value stored as bytes (a tuple: one per item of a save)."""

    name: str
    code: str  # safetensors dtype code
    shape: tuple[int, ...]
    nbytes: int


def build_header(entries: list[Entry], save_id: str, rank: int) -> tuple[bytes, list[int]]:
    """Return the file's leading bytes (length + header) and each entry's absolute offset.

    The header is the text ``json.dumps`` gives the dict of entries (compact separators, UTF-8), written
    entry by entry: a data file of tens of thousands of small items spent most of its header time building
    and serialising one dict per entry. :func:`header_json` is the reference it is tested against."""
    meta = _file_meta(save_id, rank)
    if any(e.name == "__metadata__" for e in entries):  # an entry replaces the file's own metadata, as in the dict
        return _lead(header_json(entries, meta), entries)
    return _lead(header_text(meta, [quote(e.name) for e in entries], [e.code for e in entries],
                             [dims_text(e.shape) for e in entries], [e.nbytes for e in entries]), entries)


def _file_meta(save_id: str, rank: int) -> dict:
    return {"format": FORMAT_NAME, "format_version": DATA_FILE_VERSION_STR, "save_id": save_id, "rank": str(rank)}


def dims_text(shape) -> str:
    """A shape as the header writes it between its brackets."""
    return str(shape[0]) if len(shape) == 1 else ",".join(map(str, shape))


def header_text(meta: dict, names: list[str], codes: list[str], dims: list[str], sizes: list[int]) -> bytes:
    """The header text of entries given as columns (each name as its JSON string literal, each shape as
    :func:`dims_text`), back to back from the data section's start, under ``meta``; no name ``__metadata__``."""
    ends = list(accumulate(sizes))
    entries = [f'{name}:{{"dtype":"{code}","shape":[{d}],"data_offsets":[{begin},{end}]}}'
               for name, code, d, begin, end in zip(names, codes, dims, [0] + ends[:-1], ends)]
    head = '{"__metadata__":' + json.dumps(meta, separators=(",", ":"), ensure_ascii=False)
    return (",".join([head] + entries) + "}").encode("utf-8")


def expected_lead(columns: tuple[list, list, list, list], save_id: str, rank: int) -> bytes:
    """The leading bytes (length prefix and padded header) that :func:`build_header` writes for entries given
    as :func:`header_text`'s columns, in file order, whose names are distinct and not ``__metadata__`` (for
    any others it writes something else). A reader whose file begins with exactly these bytes has a header
    that passes every check of :func:`read_header` and lists exactly these entries, without parsing it."""
    return _lead(header_text(_file_meta(save_id, rank), *columns), ())[0]


def header_json(entries: list[Entry], meta: dict) -> bytes:
    """The header text of ``entries`` through a dict and ``json.dumps``: what :func:`build_header` writes."""
    header: dict = {"__metadata__": meta}
    pos = 0
    for e in entries:
        header[e.name] = {"dtype": e.code, "shape": list(e.shape), "data_offsets": [pos, pos + e.nbytes]}
        pos += e.nbytes
    return json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _lead(text: bytes, entries: list[Entry]) -> tuple[bytes, list[int]]:
    """The length prefix and padded header ``text``, and each entry's absolute offset."""
    text += b" " * (-(8 + len(text)) % DATA_ALIGN)  # a multiple of 8 too, as safetensors asks
    lead = struct.pack("<Q", len(text)) + text
    offsets, pos = [], len(lead)
    for e in entries:
        offsets.append(pos)
        pos += e.nbytes
    return lead, offsets


@dataclass(frozen=True)
class HeaderInfo:
    save_id: str
    rank: int
    data_start: int
    entries: dict[str, tuple[str, tuple[int, ...], int, int]]  # name -> (code, shape, begin, end) absolute
    lead_crc32c: int  # CRC-32C of the length prefix and header bytes


def read_header(pread: Callable[[int, int], bytes], file_size: int, where: str) -> HeaderInfo:
    """Read and validate a data file's header. Every bound is checked before allocation.

    ``pread(n, offset)`` returns up to ``n`` bytes of the file from ``offset``.
    """
    if file_size < 8:
        raise CorruptCheckpointError(f"{where}: file is {file_size} bytes, too short for a header; it is truncated")
    prefix = pread_exact(pread, 8, 0, where)
    (n,) = struct.unpack("<Q", prefix)
    cap = knobs.max_header_bytes()
    if n > cap or 8 + n > file_size:
        raise CorruptCheckpointError(f"{where}: header length {n} exceeds the file ({file_size} bytes) or the cap ({cap}); "
                                     "the file is truncated or damaged")
    raw = pread_exact(pread, n, 8, where)
    lead_crc = crc32c(raw, crc32c(prefix))
    try:
        header = loads_json(raw)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where}: header is not valid JSON: {exc}") from None
    if not isinstance(header, dict) or len(header) > _MAX_ENTRIES:
        raise CorruptCheckpointError(f"{where}: header is not a JSON object of entries")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME or not isinstance(meta.get("save_id"), str):
        raise CorruptCheckpointError(f"{where}: header lacks the distckpt __metadata__ (format, save_id)")
    rank = _header_rank(meta.get("rank", "-1"), where)
    data_start = 8 + n
    data_len = file_size - data_start
    entries = {}
    spans = []
    for name, e in header.items():
        fine = _fine_entry(e, data_len)
        if fine is not None:
            code, shape, b, end = fine
            entries[name] = (code, shape, data_start + b, data_start + end)
            spans.append((b, end))
            continue
        if not isinstance(e, dict) or not isinstance(e.get("dtype"), str) or e["dtype"] not in SAFETENSORS_CODES:
            raise CorruptCheckpointError(f"{where}: entry {name!r:.80} has a missing or disallowed dtype")
        shape, offs = e.get("shape"), e.get("data_offsets")
        if not (isinstance(shape, list) and len(shape) <= 64 and all(type(x) is int and x >= 0 for x in shape)):
            raise CorruptCheckpointError(f"{where}: entry {name!r:.80} has a malformed shape")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(x) is int for x in offs) and 0 <= offs[0] <= offs[1] <= data_len):
            raise CorruptCheckpointError(f"{where}: entry {name!r:.80} has data offsets outside the file")
        if math.prod(shape) * ITEMSIZE[e["dtype"]] != offs[1] - offs[0]:
            raise CorruptCheckpointError(f"{where}: entry {name!r:.80}: shape {shape} x itemsize does not equal its byte length")
        entries[name] = (e["dtype"], tuple(shape), data_start + offs[0], data_start + offs[1])
        spans.append((offs[0], offs[1]))
    spans.sort()
    for (b0, e0), (b1, _) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CorruptCheckpointError(f"{where}: entries overlap in the data section")
    return HeaderInfo(meta["save_id"], rank, data_start, entries, lead_crc)


_RANK = re.compile(r"-1|[0-9]{1,18}")


def _header_rank(value: Any, where: str) -> int:
    """The rank ``__metadata__`` records: the decimal string the writer gives it (an integer, from older hands)."""
    if type(value) is int and -1 <= value <= 1 << 62:
        return value
    if type(value) is str and _RANK.fullmatch(value):
        return int(value)
    # not int(value): a JSON number 1e999 is a float infinity, which int() rejects with OverflowError
    raise CorruptCheckpointError(f"{where}: header rank {value!r:.40} is not an integer; the file is damaged or was not "
                                 "written by distckpt: restore it from a copy")


def _fine_entry(e: Any, data_len: int) -> Optional[tuple[str, tuple[int, ...], int, int]]:
    """``(code, shape, begin, end)`` of a header entry that passes every check of :func:`read_header`, fused
    into one test (a file of many small items has as many entries); None for any other, which the checks one
    by one then reject with the precise error."""
    if type(e) is not dict:
        return None
    code, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
    width = ITEMSIZE.get(code) if type(code) is str else None
    if (width is None or type(shape) is not list or len(shape) > 64 or type(offs) is not list or len(offs) != 2
            or (shape and (set(map(type, shape)) != _INT or min(shape) < 0))):
        return None
    b, end = offs
    if type(b) is int and type(end) is int and 0 <= b <= end <= data_len and math.prod(shape) * width == end - b:
        return code, tuple(shape), b, end
    return None


def pread_exact(pread: Callable[[int, int], bytes], n: int, offset: int, where: str) -> bytes:
    chunks = []
    got = 0
    while got < n:
        b = pread(min(n - got, 64 << 20), offset + got)
        if not b:
            raise CorruptCheckpointError(f"{where}: unexpected end of file at offset {offset + got}; the file is truncated")
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def loads_json(raw: bytes) -> Any:
    """``raw`` (UTF-8) parsed as JSON whose objects name each member once and whose strings are Unicode text;
    ``ValueError`` (or ``RecursionError``, for nesting past the interpreter's limit) otherwise.

    JSON's ``\\ud800`` escapes can write a lone UTF-16 surrogate, which ``json.loads`` returns in a str that no
    UTF-8 text can hold: a key or value read so could not be written again, nor printed. distckpt never writes one."""
    value = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_members)
    check_text(raw, value)
    return value


def check_text(raw: bytes, value: Any) -> None:
    """Raise ``ValueError`` where a string of ``value``, parsed from the JSON ``raw``, holds a lone UTF-16 surrogate."""
    if _SURROGATE_ESCAPE.search(raw) is not None:  # rare: only then look at every string
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("a string holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which is not "
                             "Unicode text") from None


def unique_members(pairs: list) -> dict:
    """A JSON object's members as a dict; a name given twice is an error (readers that keep the first
    and readers that keep the last would otherwise see two different documents in the same bytes)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"member name {twice!r:.80} appears twice in one object")
    return out


def stored_form(dtype: torch.dtype, sizes: tuple, nbytes: int) -> tuple[str, tuple[int, ...]]:
    """The safetensors dtype code and shape a data file's header gives a chunk of ``dtype`` and ``sizes``
    (``nbytes`` long): its own, or bytes (U8 of the length) for dtypes safetensors has no code for."""
    code = safetensors_code(dtype)
    return code, (tuple(sizes) if code != "U8" or dtype == torch.uint8 else (nbytes,))


VALUE_FORM = "U8"  # a non-tensor value: its bytes, shape (length,)


def check_header_entry(spans: dict, begin: int, length: int, form: tuple[str, tuple[int, ...]], here: str) -> None:
    """The header of the data file (``spans``: (begin, end) -> [(code, shape)]) stores ``length`` bytes at
    ``begin`` in the same form as the metadata says."""
    found = spans.get((begin, begin + length))
    if not found:
        raise CorruptCheckpointError(f"{here}: the data file's header lists no entry at bytes {begin}-{begin + length}; "
                                     "file and metadata do not belong together. Restore the checkpoint from a copy.")
    if form not in found:
        code, shape = found[0]
        raise CorruptCheckpointError(
            f"{here}: the data file's header stores it as {code} {list(shape)}, the metadata as {form[0]} {list(form[1])}; "
            "file and metadata disagree (one was edited). Restore the checkpoint from a copy.")


def header_spans(header: "HeaderInfo") -> dict:
    """``header``'s entries by (begin, end): [(code, shape)], for :func:`check_header_entry`."""
    spans: dict = {}
    for code, shape, begin, end in header.entries.values():
        spans.setdefault((begin, end), []).append((code, shape))
    return spans


def entry_name(fqn: str, offsets: Optional[tuple[int, ...]]) -> str:
    """The name of an item inside a data file."""
    if offsets is None:
        return fqn
    return f"{fqn}@{','.join(str(o) for o in offsets)}"
