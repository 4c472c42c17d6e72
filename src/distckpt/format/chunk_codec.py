"""How a chunk's bytes are stored: the chunk-codec seam of the read and write engines.

Every chunk of a format-2.0 checkpoint is stored as it is in memory (the
identity codec), which lets the engines read straight into destinations and
stream chunks in slabs. A codec that stores other bytes (compression, a
reference to a chunk of another checkpoint) implements :class:`ChunkCodec`
and registers; the engines then encode a whole item before its file's header
is built, store it as a byte entry, checksum the stored bytes, and at load
read the stored bytes whole, check them, decode and copy out. Recording a
codec in the metadata document is a format change (a new minor version with
golden files), left to the first codec that needs it.
"""

from __future__ import annotations

import abc

from ..errors import CorruptCheckpointError

__all__ = ["ChunkCodec", "IDENTITY", "register_codec", "codec_named"]


class ChunkCodec(abc.ABC):
    """Turns a chunk's bytes into what is stored, and back."""

    name: str
    identity: bool = False  # stored bytes are the chunk's bytes: direct reads and slab streaming apply

    @abc.abstractmethod
    def encode(self, data: memoryview) -> bytes:
        """The bytes to store for a chunk whose bytes are ``data``."""

    @abc.abstractmethod
    def decode(self, stored: memoryview, nbytes: int, where: str) -> memoryview:
        """The ``nbytes`` bytes of the chunk stored as ``stored``; raise CorruptCheckpointError (naming ``where``)
        if they cannot be recovered."""


class _Identity(ChunkCodec):
    name = "identity"
    identity = True

    def encode(self, data: memoryview) -> bytes:
        return bytes(data)

    def decode(self, stored: memoryview, nbytes: int, where: str) -> memoryview:
        if len(stored) != nbytes:
            raise CorruptCheckpointError(f"{where}: stored {len(stored)} bytes for a chunk of {nbytes}")
        return stored


IDENTITY: ChunkCodec = _Identity()
_CODECS: dict[str, ChunkCodec] = {IDENTITY.name: IDENTITY}


def register_codec(codec: ChunkCodec) -> None:
    """Make ``codec`` known by its name to the read engine."""
    _CODECS[codec.name] = codec


def codec_named(name: str, where: str) -> ChunkCodec:
    codec = _CODECS.get(name)
    if codec is None:
        raise CorruptCheckpointError(f"{where}: stored with chunk codec {name!r}, which this distckpt does not know; "
                                     "upgrade distckpt, or register the codec")
    return codec
