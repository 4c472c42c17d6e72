"""Byte-grouped zstd: the lossless compression codec of format 4.0 (docs/format.md, "Compressed chunks").

The bytes of a floating-point number are not alike: in bf16 weights the high
byte (sign, exponent, one mantissa bit) takes a few dozen values and zstd
shrinks it to about a third, while the low byte is nearly random. Compressing
the interleaved bytes hides that structure from zstd; splitting each
element's bytes into planes (byte ``i`` of every element together) exposes
it. So an item is stored as its planes, cut into frames of a fixed number of
elements, each piece compressed on its own or, where zstd would not shrink it
(the low mantissa planes), stored as it is: zstd on random bytes only spends
the writer's CPU.

Decoding refuses a decompression bomb before it allocates: the decoded length
in the header must be the item's exact size (a value's at most the value
limit), the frame table must fit in the stored bytes, and every piece's size
is checked against its zstd frame header and against zstd's greatest possible
expansion before any output exists.
"""

from __future__ import annotations

import struct
from typing import Optional

import numpy as np
import zstandard

from ..errors import CheckpointError, CorruptCheckpointError
from .chunk_codec import ChunkCodec, register_codec, too_large, value_limit

__all__ = ["ByteGroupZstd", "NAME", "MAGIC", "HEADER", "COMPRESSIONS", "compression_codec", "encode_planes", "decoded_planes"]

NAME = "bytegroup.zstd/1"
MAGIC = b"DCBG"
HEADER = struct.Struct("<4sBBHQI4x")  # magic, layout version, width, reserved, decoded length, elements per frame
LAYOUT_VERSION = 1
MAX_WIDTH = 16  # complex128 is grouped as its float64 halves; nothing wider is stored
MIN_FRAME = 1 << 12  # the fewest elements a frame may hold, unless it is the only one (docs/format.md, 3.5)
FRAME_ELEMENTS = 1 << 20  # elements per frame: each piece is 1 MiB, large enough for zstd's ratio, small for memory
MAX_RATIO = 32768  # zstd's greatest expansion: a 3-byte block header and one byte give a 128 KiB RLE block
_RAW_AT = 0.97  # a plane whose first piece zstd shrinks by less than 3% is stored as it is
_SAMPLE = 64 << 10  # bytes of a plane's first piece compressed to judge it, where the piece is larger


def _compressor(level: Optional[int]) -> zstandard.ZstdCompressor:
    """zstd at ``level``; by default (None) zstd's fast strategy with a 64-entry hash table and matches of at least
    7 bytes. A byte plane is mostly a stream of independent symbols (exponents, high bytes), which zstd shrinks by
    entropy coding its literals; searching for matches finds little there and costs most of the time. On bf16
    weights this stores the exponent plane at 0.34 of its size where level 1 stores 0.37, at about 3 times the
    speed (docs/performance.md, "Compressed checkpoints")."""
    if level is not None:
        return zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)
    params = zstandard.ZstdCompressionParameters(window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7,
                                                 target_length=0, strategy=zstandard.STRATEGY_FAST,
                                                 write_content_size=True, write_checksum=False)
    return zstandard.ZstdCompressor(compression_params=params)


def encode_planes(data: memoryview, width: int, level: Optional[int] = None, frame: int = FRAME_ELEMENTS) -> memoryview:
    """The stored bytes of ``data``, elements of ``width`` bytes, grouped into planes and compressed at ``level``
    (None: :func:`_compressor`'s parameters for byte planes).

    Written into one buffer as large as ``data`` and the table (no piece is stored larger than its plane), a
    plane stored as it is gathered straight into its place: one pass over the bytes for those planes."""
    view = np.frombuffer(data, dtype=np.uint8)
    if not 1 <= width <= MAX_WIDTH or len(view) % width:
        raise ValueError(f"{len(view)} bytes are not elements of {width} bytes")
    count = len(view) // width
    planes = _Planes(view, width)
    frames = -(-count // frame)
    table = HEADER.size + 4 * width * frames
    out = np.empty(table + len(view), dtype=np.uint8)
    compressor = _compressor(level)
    raw_planes: set[int] = set()
    lengths: list[int] = []
    at = table
    for first in range(0, count, frame):
        n = min(frame, count - first)
        for p in range(width):
            if p in raw_planes:
                planes.take(first, n, p, out[at: at + n])
                lengths.append(n)
                at += n
                continue
            plane = planes.take(first, n, p)
            if first == 0 and n > 2 * _SAMPLE and len(compressor.compress(plane[:_SAMPLE])) >= _RAW_AT * _SAMPLE:
                raw_planes.add(p)  # judged by a sample: zstd on a near-random plane only spends the writer's CPU
                out[at: at + n] = plane
                lengths.append(n)
                at += n
                continue
            piece = compressor.compress(plane)
            if first == 0 and len(piece) >= _RAW_AT * n:
                raw_planes.add(p)
            if len(piece) >= n:  # stored as it is: its length says so, a zstd frame is always shorter
                out[at: at + n] = plane
            else:
                out[at: at + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
            lengths.append(min(n, len(piece)))
            at += lengths[-1]
    HEADER.pack_into(out, 0, MAGIC, LAYOUT_VERSION, width, 0, len(view), frame)
    struct.pack_into(f"<{len(lengths)}I", out, HEADER.size, *lengths)
    return memoryview(out[:at])


def decoded_planes(stored: memoryview, nbytes: int, where: str, limit: Optional[int] = None, *, name: str = NAME,
                   into: Optional[np.ndarray] = None) -> memoryview:
    """The bytes ``stored`` decodes to: exactly ``nbytes`` for a chunk, at most the value limit for a value
    (``nbytes`` -1); every size checked before the output is allocated (or, with ``into``, written)."""
    layout = _Layout(stored, nbytes, where, limit, name)
    out = np.empty(layout.length, dtype=np.uint8) if into is None else into
    planes = _Planes(out, layout.width)
    decompressor = zstandard.ZstdDecompressor()
    at = layout.table_end
    for f, first in enumerate(range(0, layout.count, layout.frame)):
        n = min(layout.frame, layout.count - first)
        pieces = []
        for p in range(layout.width):
            size = layout.lengths[f * layout.width + p]
            piece = stored[at: at + size]
            at += size
            if size != n:
                try:
                    piece = decompressor.decompress(piece, max_output_size=n, allow_extra_data=False)
                except zstandard.ZstdError as exc:
                    raise CorruptCheckpointError(f"{where}: frame {f} of byte plane {p} does not decode through {name} "
                                                 f"({exc})") from None
                if len(piece) != n:
                    raise CorruptCheckpointError(f"{where}: frame {f} of byte plane {p} decodes to {len(piece)} bytes, "
                                                 f"not {n}")
            pieces.append(np.frombuffer(piece, dtype=np.uint8))
        planes.put(first, n, pieces)
    return memoryview(out)


class _Planes:
    """Byte planes of little-endian elements of ``width`` bytes, taken from or put into ``data`` (uint8) a frame
    at a time: as shifts of 2-, 4- and 8-byte words, several times faster than strided byte copies."""

    def __init__(self, data: np.ndarray, width: int) -> None:
        self.data, self.width = data, width
        self.words = width in (2, 4, 8) and data.ctypes.data % width == 0
        self.scratch: Optional[np.ndarray] = None  # shifted words, reused frame after frame

    def take(self, first: int, n: int, p: int, out: Optional[np.ndarray] = None) -> np.ndarray:
        """Plane ``p`` of elements ``first`` to ``first + n``, into ``out`` if given."""
        w = self.width
        out = np.empty(n, dtype=np.uint8) if out is None else out
        part = self.data[first * w: (first + n) * w]
        if w == 1:
            out[:] = part
        elif self.words:
            words = part.view(f"<u{w}")
            if p:
                if self.scratch is None or len(self.scratch) < n:
                    self.scratch = np.empty(n, dtype=words.dtype)
                words = np.right_shift(words, 8 * p, out=self.scratch[:n])
            np.copyto(out, words, casting="unsafe")
        else:
            out[:] = part.reshape(n, w)[:, p]
        return out

    def put(self, first: int, n: int, pieces: list) -> None:
        """Elements ``first`` to ``first + n`` from their planes' ``pieces``."""
        w = self.width
        part = self.data[first * w: (first + n) * w]
        if w == 1:
            part[:] = pieces[0]
        elif self.words:
            words = part.view(f"<u{w}")
            np.copyto(words, pieces[-1])
            for piece in reversed(pieces[:-1]):
                np.left_shift(words, 8, out=words)
                np.bitwise_or(words, piece, out=words)
        else:
            grid = part.reshape(n, w)
            for p, piece in enumerate(pieces):
                grid[:, p] = piece


class _Layout:
    """The checked header and frame table of stored bytes: nothing here allocates by what they claim."""

    def __init__(self, stored: memoryview, nbytes: int, where: str, limit: Optional[int], name: str) -> None:
        if len(stored) < HEADER.size:
            raise CorruptCheckpointError(f"{where}: {len(stored)} stored bytes are too few for a {name} header")
        magic, version, width, reserved, length, frame = HEADER.unpack_from(stored)
        if magic != MAGIC or version != LAYOUT_VERSION or reserved or any(stored[HEADER.size - 4: HEADER.size]):
            raise CorruptCheckpointError(f"{where}: the stored bytes do not start with a {name} header "
                                         f"(magic {bytes(magic)!r}, layout {version})")
        if nbytes >= 0 and length != nbytes:
            if length > nbytes:
                raise too_large(where, name, nbytes, chunk=True)
            raise CorruptCheckpointError(f"{where}: the stored bytes decode through {name} to {length} bytes, "
                                         f"not the {nbytes} of the item")
        if nbytes < 0 and length > value_limit(limit):
            raise too_large(where, name, value_limit(limit), limit)
        # frames of fewer than MIN_FRAME elements only where one frame holds them all: a forged tiny E would make
        # the decode loop take a step per few stored bytes
        if not 1 <= width <= MAX_WIDTH or length % width or frame < 1 or (frame < MIN_FRAME and frame < length // width):
            raise CorruptCheckpointError(f"{where}: malformed {name} header: element width {width}, decoded length "
                                         f"{length}, {frame} elements a frame")
        self.width, self.length, self.frame = width, length, frame
        self.count = length // width
        frames = -(-self.count // frame)
        self.table_end = HEADER.size + 4 * width * frames
        if self.table_end > len(stored):
            raise CorruptCheckpointError(f"{where}: a {name} table of {width * frames} pieces does not fit in "
                                         f"{len(stored)} stored bytes")
        self.lengths = struct.unpack_from(f"<{width * frames}I", stored, HEADER.size)
        if HEADER.size + 4 * len(self.lengths) + sum(self.lengths) != len(stored):
            raise CorruptCheckpointError(f"{where}: the {name} pieces hold {sum(self.lengths)} bytes, the stored bytes "
                                         f"{len(stored) - self.table_end} after the table")
        at = self.table_end
        for f in range(frames):
            n = min(frame, self.count - f * frame)
            for p in range(width):
                size = self.lengths[f * width + p]
                if size != n:
                    self._check_frame(stored[at: at + size], n, f, p, where, name)
                at += size

    @staticmethod
    def _check_frame(piece: memoryview, n: int, f: int, p: int, where: str, name: str) -> None:
        """A compressed piece's frame header must record exactly its ``n`` bytes, and they must be within
        zstd's reach of the piece's size, before anything is decompressed."""
        try:
            content = zstandard.frame_content_size(piece)
        except zstandard.ZstdError as exc:
            raise CorruptCheckpointError(f"{where}: frame {f} of byte plane {p} is not a zstd frame ({exc})") from None
        if content != n or n > MAX_RATIO * len(piece):
            raise CorruptCheckpointError(f"{where}: frame {f} of byte plane {p} records {content} bytes in {len(piece)}, "
                                         f"its plane holds {n}; the stored bytes are damaged or forged")


class ByteGroupZstd(ChunkCodec):
    """Byte planes, each compressed with zstd at ``level`` where it shrinks (module docstring); None: parameters
    tuned for byte planes (:func:`_compressor`)."""

    name = NAME
    identity = False
    decoded_crc = True
    skippable = True

    def __init__(self, level: Optional[int] = None) -> None:
        self.level = level

    def encode(self, data: memoryview) -> memoryview:
        return encode_planes(data, 1, self.level)

    def encode_item(self, data: memoryview, width: int) -> memoryview:
        return encode_planes(data, width if width <= MAX_WIDTH else 1, self.level)

    def decode(self, stored: memoryview, nbytes: int, where: str, limit: Optional[int] = None) -> memoryview:
        return decoded_planes(stored, nbytes, where, limit, name=self.name)

    def decode_into(self, stored: memoryview, out: memoryview, where: str) -> None:
        decoded_planes(stored, len(out), where, name=self.name, into=np.frombuffer(out, dtype=np.uint8))


register_codec(ByteGroupZstd())


COMPRESSIONS = ("zstd",)


def compression_codec(compression: Optional[str], level: Optional[int] = None) -> Optional[ChunkCodec]:
    """The codec a writer's ``compression=`` and ``compression_level=`` name: None for none (the default),
    byte-grouped zstd for ``"zstd"`` (zstd's level -7 to 22 where given; by default parameters tuned for byte
    planes, faster than level 1 and smaller on floating-point weights)."""
    if compression is None or compression == "none":
        if level is not None:
            raise CheckpointError(f"compression_level={level!r} without compression; pass compression='zstd' as well")
        return None
    if compression not in COMPRESSIONS:
        raise CheckpointError(f"compression={compression!r} is not one distckpt writes; use one of {list(COMPRESSIONS)} or None")
    if level is not None and (type(level) is not int or not -7 <= level <= 22):
        raise CheckpointError(f"compression_level={level!r} is not a zstd level (an int from -7 to 22, or None for the "
                              "default tuned for byte planes)")
    return ByteGroupZstd(level)
