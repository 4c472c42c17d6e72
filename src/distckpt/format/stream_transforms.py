"""Stream transforms (DCP's ``_extensions``) as chunk codecs.

DCP lets a writer pass stream transforms (compression, or any transform a user
writes) that wrap the output stream of each item; the reader rebuilds them from
descriptors recorded in the metadata (``"stream.zstd/1"``), through a registry
of extension classes. Here a chain of transforms is one chunk codec
(:mod:`.chunk_codec`): each item is encoded whole, stored as a byte entry, its
CRC-32C taken over the stored bytes, and decoded whole at load. The codec's
name is its descriptors joined by ``|`` in DCP's order (the transform applied
last to the stream first); the metadata records them as a list (docs/format.md,
format 2.1).

Extensions are duck-typed: torch's own ``ZStandard``, ``Rot13Example`` and
``ExtensionRegistry`` work as well as the classes here, so code written for DCP
needs no change beyond its imports.
"""

from __future__ import annotations

import abc
import io
import mmap
from typing import IO, Any, Optional, Sequence

import zstandard as _zstd

from ..errors import CheckpointError, CorruptCheckpointError
from . import bytegroup  # noqa: F401 - registers the byte-grouped zstd codec, which codec_for finds by name
from .chunk_codec import CODEC_SEPARATOR as SEPARATOR
from .chunk_codec import ChunkCodec, registered_codec, split_recorded, too_large, value_limit

__all__ = ["Extension", "StreamTransformExtension", "ZStandard", "ExtensionRegistry", "StreamTransforms",
           "codec_for"]

class Extension(abc.ABC):
    """An addition to how a checkpoint's bytes are written, named in the metadata by its descriptor."""

    @staticmethod
    @abc.abstractmethod
    def registry_name() -> str:
        """The name a registry finds the class by: the descriptor up to its ``/``."""

    @staticmethod
    @abc.abstractmethod
    def from_descriptor(version: str) -> "Extension":
        """The extension for the version part of a recorded descriptor."""

    @abc.abstractmethod
    def get_descriptor(self) -> str:
        """``name[@local-domain][/version]``, recorded in the metadata for every item written through it."""


class StreamTransformExtension(Extension):
    """An extension that transforms a byte stream (compression, encryption)."""

    @abc.abstractmethod
    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        """A writable stream that transforms what is written to it into ``output``."""

    @abc.abstractmethod
    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        """A readable stream that yields the bytes ``input`` holds, transformed back."""


class ZStandard(StreamTransformExtension):
    """Zstandard compression of every item."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def registry_name() -> str:
        return "stream.zstd"

    @staticmethod
    def from_descriptor(version: str) -> "ZStandard":
        if version.partition(".")[0] != "1":
            raise ValueError(f"zstd stream version {version!r} is not one this distckpt reads (1)")
        return ZStandard()

    def __init__(self, level: int = 3) -> None:
        self.level = level

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return _zstd.ZstdCompressor(level=self.level).stream_writer(output)

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return _zstd.ZstdDecompressor().stream_reader(input)


class ExtensionRegistry:
    """Extension classes by registry name, to rebuild a writer's extensions from recorded descriptors.

    Knows :class:`ZStandard`; register others (or pass DCP's own registry: it has the same two methods).
    """

    def __init__(self) -> None:
        self.extensions: dict[str, type] = {ZStandard.registry_name(): ZStandard}

    def register(self, cls: type) -> None:
        self.extensions[cls.registry_name()] = cls

    def from_descriptor_list(self, descriptors: Sequence[str]) -> list:
        out = []
        for desc in descriptors:
            name, _, version = desc.partition("/")
            cls = self.extensions.get(name)
            if cls is None:
                raise ValueError(f"no extension registered as {name!r}")
            out.append(cls.from_descriptor(version))
        return out


class _Unclosed(io.RawIOBase):
    """The sink under a transform chain: closing the chain flushes into it but keeps its bytes readable."""

    def __init__(self, sink: io.BytesIO) -> None:
        self.sink = sink

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return self.sink.write(b)


class StreamTransforms(ChunkCodec):
    """A chain of stream transforms as a chunk codec; ``name`` is its descriptors, as recorded."""

    identity = False

    def __init__(self, extensions: Sequence[Any], name: Optional[str] = None) -> None:
        self.extensions = list(extensions)
        descriptors = [ext.get_descriptor() for ext in reversed(self.extensions)]
        for d in descriptors:
            if not isinstance(d, str) or not d or SEPARATOR in d:
                raise CheckpointError(f"stream extension descriptor {d!r} is not a non-empty string without {SEPARATOR!r}")
        self.name = name if name is not None else SEPARATOR.join(descriptors)

    def encode(self, data: memoryview) -> bytes:
        sink = io.BytesIO()
        stream: Any = _Unclosed(sink)
        for ext in self.extensions:
            stream = ext.transform_to(stream)
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            n = stream.write(view[done:])
            done += len(view) - done if n is None else n
        stream.close()  # ends compressed frames; _Unclosed keeps the bytes
        return sink.getvalue()

    def decode(self, stored: memoryview, nbytes: int, where: str, limit: Optional[int] = None) -> memoryview:
        def drain(stream: Any) -> tuple[memoryview, int]:
            if nbytes < 0:
                out = bytearray()
                while piece := stream.read(_PIECE):
                    out += piece
                return memoryview(out), len(out)
            view = _untouched(nbytes)
            done = 0
            while done < nbytes:
                n = stream.readinto(view[done:])
                if not n:
                    break
                done += n
            stream.read(1)  # one byte past the item's end is an overflow of the last stage
            return view, done

        return self._decoding(stored, nbytes, where, limit, drain)

    def decoded_size(self, stored: memoryview, nbytes: int, where: str, limit: Optional[int] = None) -> int:
        """As :meth:`decode`, through one buffer of 1 MiB that every piece overwrites: memory stays bounded
        whatever the stored bytes decode to."""
        def count(stream: Any) -> tuple[int, int]:
            buf = memoryview(bytearray(_PIECE))
            done = 0
            while n := stream.readinto(buf):
                done += n
            return done, done

        return self._decoding(stored, nbytes, where, limit, count)

    def _decoding(self, stored: memoryview, nbytes: int, where: str, limit: Optional[int], drain: Any) -> Any:
        """``drain(stream)`` over the chain of transforms, returning (result, bytes decoded); every stage's cap
        and the item's size are checked, and a transform's own failure becomes CorruptCheckpointError."""
        stages: list[_Capped] = []
        try:
            result, done = drain(self._chain(stored, nbytes, limit, stages))  # a transform may read its input as made
        except Exception as exc:  # noqa: BLE001 - a transform raises what its library raises on damaged input
            self._check_stages(stages, nbytes, where, limit)
            raise CorruptCheckpointError(f"{where}: the stored bytes do not decode through {self.name} "
                                         f"({type(exc).__name__}: {exc})") from None
        self._check_stages(stages, nbytes, where, limit)
        if nbytes >= 0 and done != nbytes:
            raise CorruptCheckpointError(f"{where}: the stored bytes decode through {self.name} to "
                                         f"{done} bytes, not the {nbytes} of the item")
        return result

    def _chain(self, stored: memoryview, nbytes: int, limit: Optional[int], stages: list["_Capped"]) -> Any:
        """The chain of transforms over ``stored``, each stage read through a cap: the last at the item's
        bytes (``nbytes``, or the value limit), the others at the larger of that and the value limit (a stage
        may legitimately expand what the next one shrinks, as an encryption's tag before a compression)."""
        final = nbytes if nbytes >= 0 else value_limit(limit)
        inner = max(final, value_limit(limit))
        stream: Any = io.BytesIO(stored)
        for i, ext in enumerate(self.extensions):  # the first given wraps the stored bytes on write: undone first
            last = i == len(self.extensions) - 1
            stream = _Capped(ext.transform_from(stream), final if last else inner, ext)
            stages.append(stream)
        return stream

    def _check_stages(self, stages: list["_Capped"], nbytes: int, where: str, limit: Optional[int]) -> None:
        for i, stage in enumerate(stages):
            if stage.over:
                last = i == len(self.extensions) - 1
                codec = self.name if len(self.extensions) == 1 else f"{self.name} (at {_descriptor(stage.ext)})"
                raise too_large(where, codec, stage.bound, limit, chunk=last and nbytes >= 0)


_PIECE = 1 << 20  # bytes asked of a transform at a time


def _untouched(nbytes: int) -> memoryview:
    """A writable buffer of ``nbytes`` whose pages take memory only once written: the size comes from the
    metadata, and stored bytes that decode to less (a forged size, distckpt.open reading a slice) must not
    make a reader fill the whole claim with zeros first. Small ones are plain bytearrays."""
    if nbytes < _PIECE:
        return memoryview(bytearray(nbytes))
    return memoryview(mmap.mmap(-1, nbytes))


class _Overflow(Exception):
    """A stage of a chain of transforms gave more bytes than its cap (raised into the transform reading it)."""


class _Capped(io.RawIOBase):
    """A stage's output, read through: never asks it for more than one byte past ``bound`` in all, and
    raises once it gave that byte, so even a transform that reads its input whole stops at the bound."""

    def __init__(self, stream: Any, bound: int, ext: Any) -> None:
        self.stream, self.bound, self.ext = stream, bound, ext
        self.count = 0
        self.over = False

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if not len(view):
            return 0
        want = min(len(view), self.bound + 1 - self.count)
        if self.over or want <= 0:
            self.over = True
            raise _Overflow(f"more than {self.bound} bytes")
        if hasattr(self.stream, "readinto"):
            n = self.stream.readinto(view[:want]) or 0
        else:
            n = _read_into(self.stream, view[:want])
        self.count += n
        if self.count > self.bound:
            self.over = True
            raise _Overflow(f"more than {self.bound} bytes")
        return n


def _descriptor(ext: Any) -> str:
    try:
        return str(ext.get_descriptor())
    except Exception:  # noqa: BLE001 - only for a message
        return type(ext).__name__


def _read_into(stream: Any, view: memoryview) -> int:
    data = stream.read(len(view))
    if not data:
        return 0
    view[: len(data)] = data
    return len(data)


def codec_for(name: str, registry: Any, where: str) -> ChunkCodec:
    """The codec recorded as ``name``: a registered one, or else a chain of stream transforms (descriptors
    joined by ``|``) whose extensions ``registry`` builds (default: :class:`ExtensionRegistry`); bound to the
    CRC-32C of the decoded bytes where the record holds one (format 4.0), which a codec that declares
    ``decoded_crc`` requires."""
    try:
        base, crc = split_recorded(name)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{where}: {exc}") from None
    codec = registered_codec(base)
    if codec is not None:
        if codec.decoded_crc and crc is None:
            raise CorruptCheckpointError(f"{where}: stored through {base}, whose codec record must hold the CRC-32C of the "
                                         "decoded bytes (crc32c), and this one does not; the metadata is damaged or forged")
        return codec if crc is None else codec.expecting(crc)
    if crc is not None:
        return _stream_codec(base, registry, where).expecting(crc)
    return _stream_codec(name, registry, where)


def _stream_codec(name: str, registry: Any, where: str) -> ChunkCodec:
    registry = registry if registry is not None else ExtensionRegistry()
    try:
        extensions = registry.from_descriptor_list(name.split(SEPARATOR))
    except (ValueError, CheckpointError) as exc:
        raise CheckpointError(
            f"{where}: stored through the stream transforms {name.split(SEPARATOR)}, which this reader cannot rebuild "
            f"({exc}). Pass the extension classes in a registry: FileSystemReader(path, _extension_registry=registry), "
            "with registry = distckpt.ExtensionRegistry() and registry.register(YourExtension)") from None
    return StreamTransforms(list(reversed(extensions)), name)
