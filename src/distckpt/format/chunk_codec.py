"""How a chunk's bytes are stored: the chunk-codec seam of the read and write engines.

Every chunk of a format-2.0 checkpoint is stored as it is in memory (the
identity codec), which lets the engines read straight into destinations and
stream chunks in slabs. A codec that stores other bytes (compression, a
reference to a chunk of another checkpoint) implements :class:`ChunkCodec`
and registers; the engines then encode a whole item before its file's header
is built, store it as a byte entry, checksum the stored bytes, and at load
read the stored bytes whole, check them, decode and copy out. Format 2.1
records a chunk's codec by name in the metadata document (docs/format.md);
DCP's stream extensions are codecs too (:mod:`.stream_transforms`).

Decoding is bounded: a chunk decodes to exactly the bytes its dtype and sizes
imply, and a value (whose size the metadata does not record) to at most
``limit`` bytes, by default :func:`distckpt.knobs.max_value_bytes`, so a few
stored bytes cannot make a reader allocate without end.
"""

from __future__ import annotations

import abc
import functools
import inspect
from typing import Optional

from .. import knobs
from ..errors import CorruptCheckpointError
from .checksum import crc32c, format_crc

__all__ = ["ChunkCodec", "IDENTITY", "CODEC_SEPARATOR", "DECODED_CRC", "register_codec", "registered_codec", "value_limit",
           "too_large", "split_recorded"]

CODEC_SEPARATOR = "|"  # a codec recorded as a chain of transforms is named by their names, joined by this
# in memory (StorageInfo.codec, the wire's result columns), a codec whose record holds the CRC-32C of the decoded bytes
# (format 4.0) is named "<codec>#crc32c=<8 hex digits>"; the document records the two apart (format/codec.py)
DECODED_CRC = "#crc32c="


def split_recorded(name: str) -> tuple[str, Optional[int]]:
    """A recorded codec name's codec and the CRC-32C of the decoded bytes it names, if any."""
    base, mark, crc = name.partition(DECODED_CRC)
    if not mark:
        return name, None
    if len(crc) != 8 or not all(c in "0123456789abcdef" for c in crc):
        raise CorruptCheckpointError(f"malformed decoded checksum in codec {name!r:.200}")
    return base, int(crc, 16)


def value_limit(limit: Optional[int] = None) -> int:
    """The most bytes a value may decode to: ``limit`` when given, else DISTCKPT_MAX_VALUE_BYTES."""
    return knobs.max_value_bytes() if limit is None else limit


def too_large(where: str, codec: str, bound: int, limit: Optional[int] = None, chunk: bool = False) -> CorruptCheckpointError:
    """The error for stored bytes that decode through ``codec`` to more than ``bound`` bytes: the ``bound``
    of a chunk (``chunk``), or the value limit (``limit`` as the caller gave it, None for the knob)."""
    if chunk:
        return CorruptCheckpointError(f"{where}: the stored bytes decode through {codec} to more than the {bound} "
                                      "bytes of the item; the stored bytes are damaged or belong to another item")
    if limit is None:
        fix = ("the limit DISTCKPT_MAX_VALUE_BYTES sets; if the checkpoint is trusted and the value really is that "
               "large, raise DISTCKPT_MAX_VALUE_BYTES")
    else:
        fix = f"the limit this read allows (limit={limit}; DISTCKPT_MAX_VALUE_BYTES when none is given)"
    return CorruptCheckpointError(f"{where}: the stored bytes decode through {codec} to more than {bound} bytes, {fix}")


def _takes_limit(fn) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return "limit" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _checked_after(decode):
    @functools.wraps(decode)
    def checked(self, stored: memoryview, nbytes: int, where: str, limit: Optional[int] = None) -> memoryview:
        out = decode(self, stored, nbytes, where)
        if nbytes < 0 and len(out) > value_limit(limit):
            raise too_large(where, self.name, value_limit(limit), limit)
        if nbytes >= 0 and len(out) > nbytes:
            raise too_large(where, self.name, nbytes, chunk=True)
        return out
    return checked


class ChunkCodec(abc.ABC):
    """Turns a chunk's bytes into what is stored, and back."""

    name: str
    identity: bool = False  # stored bytes are the chunk's bytes: direct reads and slab streaming apply
    # the writer records the CRC-32C of each item's decoded bytes beside the codec (format 4.0), and readers require it
    decoded_crc: bool = False
    # a compression: an item it does not shrink may be stored as it is instead (never so for a transform that must
    # apply, such as an encryption)
    skippable: bool = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        decode = cls.__dict__.get("decode")
        if decode is not None and not _takes_limit(decode):
            cls.decode = _checked_after(decode)  # a codec written before ``limit``: its output is checked after the fact

    @abc.abstractmethod
    def encode(self, data: memoryview) -> bytes:
        """The bytes to store for a chunk whose bytes are ``data``."""

    @abc.abstractmethod
    def decode(self, stored: memoryview, nbytes: int, where: str, limit: Optional[int] = None) -> memoryview:
        """The ``nbytes`` bytes of the chunk stored as ``stored`` (all it decodes to, for a value: ``nbytes`` is -1);
        raise CorruptCheckpointError (naming ``where``) if they cannot be recovered.

        A value may decode to at most ``limit`` bytes (default :func:`value_limit`), a chunk to no more than
        ``nbytes``. A codec should decode in bounded steps and stop at the bound (:func:`too_large` is the
        error), never materialise all that damaged or hostile stored bytes decode to. A subclass whose
        ``decode`` takes no ``limit`` still works: its output is checked against the bound after it returns."""

    def decoded_size(self, stored: memoryview, nbytes: int, where: str, limit: Optional[int] = None) -> int:
        """How many bytes ``stored`` decodes to, checked as :meth:`decode` checks them, keeping none of them
        (``verify`` calls this). A codec that decodes in pieces overrides it to run in bounded memory."""
        return len(self.decode(stored, nbytes, where, limit=limit))

    def decode_into(self, stored: memoryview, out: memoryview, where: str) -> None:
        """:meth:`decode` of a chunk straight into ``out``, exactly its bytes (writable): a load whose one
        destination is the whole chunk saves a buffer and a copy. A codec that can, overrides it."""
        raw = memoryview(self.decode(stored, len(out), where)).cast("B")
        if len(raw) != len(out):
            raise CorruptCheckpointError(f"{where}: the stored bytes decode through {self.name} to {len(raw)} bytes, not "
                                         f"the {len(out)} of the chunk")
        out[:] = raw

    def encode_item(self, data: memoryview, width: int) -> bytes:
        """:meth:`encode` of an item whose elements are ``width`` bytes each (1 for a value): a codec that
        groups bytes by their place in an element overrides it."""
        return self.encode(data)

    def expecting(self, crc: int) -> "ChunkCodec":
        """This codec, named and checked with the CRC-32C ``crc`` of the decoded bytes: what a record that
        holds the decoded checksum decodes through."""
        return _DecodedChecked(self, crc)


class _DecodedChecked(ChunkCodec):
    """A codec whose decoded bytes must have the CRC-32C its record holds."""

    identity = False

    def __init__(self, inner: ChunkCodec, crc: int) -> None:
        self.inner, self.crc = inner, crc
        self.name = f"{inner.name}{DECODED_CRC}{format_crc(crc)}"

    def encode(self, data: memoryview) -> bytes:
        return self.inner.encode(data)

    def decode(self, stored: memoryview, nbytes: int, where: str, limit: Optional[int] = None) -> memoryview:
        out = self.inner.decode(stored, nbytes, where, limit=limit)
        self.check(out, where)
        return out

    def decode_into(self, stored: memoryview, out: memoryview, where: str) -> None:
        self.inner.decode_into(stored, out, where)
        self.check(out, where)

    def check(self, out: memoryview, where: str) -> None:
        got = crc32c(out)
        if got != self.crc:
            raise CorruptCheckpointError(f"{where}: the stored bytes decode through {self.inner.name} to bytes whose CRC-32C "
                                         f"is {format_crc(got)}, not the {format_crc(self.crc)} its codec record holds; "
                                         "the checkpoint is damaged or its metadata forged")


class _Identity(ChunkCodec):
    name = "identity"
    identity = True

    def encode(self, data: memoryview) -> bytes:
        return bytes(data)

    def decode(self, stored: memoryview, nbytes: int, where: str, limit: Optional[int] = None) -> memoryview:
        if nbytes >= 0 and len(stored) != nbytes:
            raise CorruptCheckpointError(f"{where}: stored {len(stored)} bytes for a chunk of {nbytes}")
        if nbytes < 0 and len(stored) > value_limit(limit):
            raise too_large(where, self.name, value_limit(limit), limit)
        return stored


IDENTITY: ChunkCodec = _Identity()
_CODECS: dict[str, ChunkCodec] = {IDENTITY.name: IDENTITY}


def register_codec(codec: ChunkCodec) -> None:
    """Make ``codec`` known by its name to the read engine."""
    _CODECS[codec.name] = codec


def registered_codec(name: str) -> Optional[ChunkCodec]:
    """The codec registered as ``name``, if any (bound to the decoded checksum a recorded name holds)."""
    base, crc = split_recorded(name)
    codec = _CODECS.get(base)
    return codec if codec is None or crc is None else codec.expecting(crc)
