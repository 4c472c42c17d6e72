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
"""

from __future__ import annotations

import abc
from typing import Optional

from ..errors import CorruptCheckpointError

__all__ = ["ChunkCodec", "IDENTITY", "CODEC_SEPARATOR", "register_codec", "registered_codec"]

CODEC_SEPARATOR = "|"  # a codec recorded as a chain of transforms is named by their names, joined by this


class ChunkCodec(abc.ABC):
    """Turns a chunk's bytes into what is stored, and back."""

    name: str
    identity: bool = False  # stored bytes are the chunk's bytes: direct reads and slab streaming apply

    @abc.abstractmethod
    def encode(self, data: memoryview) -> bytes:
        """The bytes to store for a chunk whose bytes are ``data``."""

    @abc.abstractmethod
    def decode(self, stored: memoryview, nbytes: int, where: str) -> memoryview:
        """The ``nbytes`` bytes of the chunk stored as ``stored`` (all it decodes to, for a value: ``nbytes`` is -1);
        raise CorruptCheckpointError (naming ``where``) if they cannot be recovered."""


class _Identity(ChunkCodec):
    name = "identity"
    identity = True

    def encode(self, data: memoryview) -> bytes:
        return bytes(data)

    def decode(self, stored: memoryview, nbytes: int, where: str) -> memoryview:
        if nbytes >= 0 and len(stored) != nbytes:
            raise CorruptCheckpointError(f"{where}: stored {len(stored)} bytes for a chunk of {nbytes}")
        return stored


IDENTITY: ChunkCodec = _Identity()
_CODECS: dict[str, ChunkCodec] = {IDENTITY.name: IDENTITY}


def register_codec(codec: ChunkCodec) -> None:
    """Make ``codec`` known by its name to the read engine."""
    _CODECS[codec.name] = codec


def registered_codec(name: str) -> Optional[ChunkCodec]:
    """The codec registered as ``name``, if any."""
    return _CODECS.get(name)
