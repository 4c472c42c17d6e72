"""DCP's module name for stream extensions (they live in :mod:`distckpt.format.stream_transforms`)."""

from .format.stream_transforms import Extension, ExtensionRegistry, StreamTransformExtension, ZStandard

__all__ = ["Extension", "StreamTransformExtension", "ZStandard", "ExtensionRegistry"]
