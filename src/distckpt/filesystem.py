"""DCP's module name for the file-system storage layer (the classes live in :mod:`distckpt.backends`)."""

from .backends import FileSystemReader, FileSystemWriter
from .format import FORMAT_VERSION_STR

#: DCP's name for the version a save records in ``Metadata.version``: here the format version of docs/format.md
#: (a save through stream extensions records 2.1).
CURRENT_DCP_VERSION = FORMAT_VERSION_STR

__all__ = ["FileSystemReader", "FileSystemWriter", "CURRENT_DCP_VERSION"]
