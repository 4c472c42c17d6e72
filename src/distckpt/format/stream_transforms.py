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
from typing import IO, Any, Optional, Sequence

from ..errors import CheckpointError, CorruptCheckpointError
from .chunk_codec import CODEC_SEPARATOR as SEPARATOR
from .chunk_codec import ChunkCodec, registered_codec

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


try:
    import zstandard as _zstd
except ImportError:  # optional: pip install 'distckpt[zstd]'
    _zstd = None


class ZStandard(StreamTransformExtension):
    """Zstandard compression of every item (needs the ``zstandard`` package: ``pip install 'distckpt[zstd]'``)."""

    @staticmethod
    def is_available() -> bool:
        return _zstd is not None

    @staticmethod
    def registry_name() -> str:
        return "stream.zstd"

    @staticmethod
    def from_descriptor(version: str) -> "ZStandard":
        if version.partition(".")[0] != "1":
            raise ValueError(f"zstd stream version {version!r} is not one this distckpt reads (1)")
        return ZStandard()

    def __init__(self, level: int = 3) -> None:
        if _zstd is None:
            raise CheckpointError("ZStandard needs the zstandard package: pip install 'distckpt[zstd]'")
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

    def decode(self, stored: memoryview, nbytes: int, where: str) -> memoryview:
        stream: Any = io.BytesIO(stored)
        for ext in self.extensions:  # the first given wraps the stored bytes on write, so it is undone first
            stream = ext.transform_from(stream)
        if nbytes < 0:
            try:
                return memoryview(stream.read())
            except Exception as exc:  # noqa: BLE001 - as below
                raise CorruptCheckpointError(f"{where}: the stored bytes do not decode through {self.name} "
                                             f"({type(exc).__name__}: {exc})") from None
        out = bytearray(nbytes)
        view = memoryview(out)
        done = 0
        try:
            while done < nbytes:
                n = stream.readinto(view[done:]) if hasattr(stream, "readinto") else _read_into(stream, view[done:])
                if not n:
                    break
                done += n
            extra = stream.read(1)
        except Exception as exc:  # noqa: BLE001 - a transform raises what its library raises on damaged input
            raise CorruptCheckpointError(f"{where}: the stored bytes do not decode through {self.name} "
                                         f"({type(exc).__name__}: {exc})") from None
        if done != nbytes or extra:
            raise CorruptCheckpointError(f"{where}: the stored bytes decode through {self.name} to "
                                         f"{'more' if extra else done} bytes, not the {nbytes} of the item")
        return view


def _read_into(stream: Any, view: memoryview) -> int:
    data = stream.read(len(view))
    if not data:
        return 0
    view[: len(data)] = data
    return len(data)


def codec_for(name: str, registry: Any, where: str) -> ChunkCodec:
    """The codec recorded as ``name``: a registered one, or else a chain of stream transforms (descriptors
    joined by ``|``) whose extensions ``registry`` builds (default: :class:`ExtensionRegistry`)."""
    codec = registered_codec(name)
    if codec is not None:
        return codec
    registry = registry if registry is not None else ExtensionRegistry()
    try:
        extensions = registry.from_descriptor_list(name.split(SEPARATOR))
    except (ValueError, CheckpointError) as exc:
        raise CheckpointError(
            f"{where}: stored through the stream transforms {name.split(SEPARATOR)}, which this reader cannot rebuild "
            f"({exc}). Pass the extension classes in a registry: FileSystemReader(path, _extension_registry=registry), "
            "with registry = distckpt.ExtensionRegistry() and registry.register(YourExtension)") from None
    return StreamTransforms(list(reversed(extensions)), name)
