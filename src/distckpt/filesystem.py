"""DCP's module name for the file-system storage layer (the classes live in :mod:`distckpt.backends`)."""

from .backends import FileSystemReader, FileSystemWriter

__all__ = ["FileSystemReader", "FileSystemWriter"]
