"""A compact binary container for data that ranks exchange while planning a save.

A frame is ``MAGIC`` (4 bytes, names what the frame holds), a little-endian
u32 count of sections, then per section a u8 kind, a u64 length and the
payload:

- kind 0: raw bytes (for example a zlib-compressed JSON document);
- kind 1: a numpy array, payload = dtype code (1 byte) + ndim (1 byte) +
  ndim little-endian u64 dimensions + the elements, C order, little-endian.

Frames never travel to disk. They are what lets the coordinator handle the
plans of thousands of ranks with array operations instead of one Python
object per item; docs/format.md does not cover them, and their layout may
change between releases (every rank of a job runs the same distckpt).
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any, Union

import numpy as np

from ..errors import CorruptCheckpointError

__all__ = ["encode_frame", "decode_frame", "frame_kind", "smallest_uint", "pack_json", "unpack_json"]

_DTYPES = [np.dtype(x).newbyteorder("<") for x in ("u1", "u2", "u4", "u8", "i1", "i2", "i4", "i8", "?")]
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}
_HEAD = struct.Struct("<4sI")
_SECTION = struct.Struct("<BQ")


def smallest_uint(values: np.ndarray) -> np.ndarray:
    """``values`` (non-negative integers) in the narrowest unsigned dtype that holds them."""
    top = int(values.max()) if values.size else 0
    for dt in (np.uint8, np.uint16, np.uint32, np.uint64):
        if top <= np.iinfo(dt).max:
            return values.astype(dt, copy=False)
    raise ValueError("value too large for a frame")


def pack_json(value: Any) -> bytes:
    return zlib.compress(json.dumps(value, separators=(",", ":"), allow_nan=False).encode(), 1)


def unpack_json(raw: Union[bytes, memoryview], where: str) -> Any:
    try:
        return json.loads(zlib.decompress(raw))
    except (zlib.error, ValueError) as exc:
        raise CorruptCheckpointError(f"{where}: damaged frame section ({exc})") from None


def encode_frame(magic: bytes, sections: list[Union[bytes, np.ndarray]]) -> bytes:
    parts = [_HEAD.pack(magic, len(sections))]
    for s in sections:
        if isinstance(s, np.ndarray):
            arr = np.ascontiguousarray(s, dtype=s.dtype.newbyteorder("<"))
            head = bytes([_CODE[arr.dtype], arr.ndim]) + struct.pack(f"<{arr.ndim}Q", *arr.shape)
            parts += [_SECTION.pack(1, len(head) + arr.nbytes), head, arr.tobytes()]
        else:
            parts += [_SECTION.pack(0, len(s)), bytes(s)]
    return b"".join(parts)


def frame_kind(raw: bytes) -> bytes:
    """The magic of a frame, or b"" when ``raw`` is not one."""
    return raw[:4] if len(raw) >= _HEAD.size and raw[:1] == b"\x00" else b""


def decode_frame(raw: bytes, magic: bytes, where: str) -> list[Union[memoryview, np.ndarray]]:
    """The sections of a frame; raises CorruptCheckpointError on anything malformed."""
    view = memoryview(raw)
    if len(raw) < _HEAD.size:
        raise CorruptCheckpointError(f"{where}: truncated frame")
    got, count = _HEAD.unpack_from(view, 0)
    if got != magic:
        raise CorruptCheckpointError(f"{where}: expected a {magic!r} frame, got {got!r}")
    pos, out = _HEAD.size, []
    for _ in range(count):
        if pos + _SECTION.size > len(raw):
            raise CorruptCheckpointError(f"{where}: truncated frame")
        kind, length = _SECTION.unpack_from(view, pos)
        pos += _SECTION.size
        if pos + length > len(raw):
            raise CorruptCheckpointError(f"{where}: truncated frame")
        body = view[pos:pos + length]
        pos += length
        if kind == 0:
            out.append(body)
            continue
        if kind != 1 or length < 2 or body[0] >= len(_DTYPES):
            raise CorruptCheckpointError(f"{where}: malformed frame section")
        dt, ndim = _DTYPES[body[0]], body[1]
        if length < 2 + 8 * ndim:
            raise CorruptCheckpointError(f"{where}: malformed frame section")
        shape = struct.unpack_from(f"<{ndim}Q", body, 2)
        data = body[2 + 8 * ndim:]
        if int(np.prod(shape, dtype=np.float64)) * dt.itemsize != len(data):
            raise CorruptCheckpointError(f"{where}: frame array of shape {shape} does not match its {len(data)} bytes")
        out.append(np.frombuffer(data, dtype=dt).reshape(shape))
    if pos != len(raw):
        raise CorruptCheckpointError(f"{where}: trailing bytes after the frame")
    return out
