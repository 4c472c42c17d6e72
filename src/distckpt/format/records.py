"""What the filesystem-style storage layers record about where bytes live."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ..metadata import MetadataIndex
from ..storage import WriteResult

__all__ = ["StorageInfo", "FileInfo", "referenced_name", "split_reference", "REFERENCE_SEPARATOR",
           "FileResult", "FileStorageData", "ForeignStorageData"]


@dataclass(frozen=True)
class StorageInfo:
    """One stored item: ``length`` bytes at absolute ``offset`` of data file ``file``."""

    file: str
    offset: int
    length: int
    crc32c: Optional[int]  # None: the program that wrote the item recorded no CRC-32C of it (a foreign layout)
    codec: str = "identity"  # how the bytes are stored (format/chunk_codec.py); identity in every format-2.0 checkpoint


@dataclass(frozen=True)
class FileInfo:
    """A data file of a checkpoint: its exact size, the rank that wrote it, and the
    CRC-32C of its leading bytes (length prefix and header).

    ``save_id`` is set on a file another checkpoint of the same run stored (format 4.0, an incremental
    save's reference): the save that wrote it, whose id its header records. Such a file's name in the
    table is ``<checkpoint>/<file name>`` (:func:`referenced_name`), the sibling checkpoint that holds it.
    """

    size: int
    rank: int
    header_crc32c: int
    save_id: Optional[str] = None


REFERENCE_SEPARATOR = "/"


def referenced_name(checkpoint: str, name: str) -> str:
    """The file table's name of data file ``name`` of sibling checkpoint ``checkpoint``."""
    return f"{checkpoint}{REFERENCE_SEPARATOR}{name}"


def split_reference(key: str) -> Optional[tuple[str, str]]:
    """(checkpoint, file name) of a referenced file's table name; None for a file of the checkpoint itself."""
    checkpoint, sep, name = key.partition(REFERENCE_SEPARATOR)
    return (checkpoint, name) if sep else None


@dataclass(frozen=True)
class FileResult(WriteResult):
    """A data file a rank wrote, reported by ``write_data`` after the items' WriteResults.

    It is a WriteResult so that code written for the protocol can iterate a
    rank's results unchanged; ``index`` carries the file's name, and
    ``storage_data`` its :class:`FileInfo`. Storage layers tell the two kinds
    apart by type, never by the name.
    """

    @staticmethod
    def of(name: str, info: FileInfo) -> "FileResult":
        return FileResult(MetadataIndex(name), info.size, info)

    @property
    def file(self) -> str:
        return self.index.fqn


@dataclass
class FileStorageData:
    """``Metadata.storage_data`` of checkpoints written by distckpt's own storage layers."""

    save_id: str
    files: dict[str, FileInfo] = field(default_factory=dict)
    items: dict[MetadataIndex, StorageInfo] = field(default_factory=dict)


@dataclass
class ForeignStorageData(FileStorageData):
    """``Metadata.storage_data`` of a checkpoint another program wrote, as a layout describes it (distckpt.layouts).

    Its files carry no distckpt header and no save id, so the read engine checks only what can be checked: each
    file's size, and each item's bounds, shape and dtype (the layout checks them before handing the metadata
    over). An item's ``crc32c`` is None where the program recorded none. An item whose ``codec`` is not
    ``identity`` is decoded by ``decoder(index, info, where)``, which returns a ChunkCodec bounded by the chunk's
    size: torch.save archives, compressed streams.
    """

    layout: str = ""
    decoder: Any = None
    every_key: bool = False  # a whole model's weights (as Hugging Face's): a key the state dict lacks is an error
    # each file's identity (BlobReader.identity) when the layout read it: a file replaced since, even by one of the
    # same size, is refused rather than read at the places planned on the old one
    identities: dict = field(default_factory=dict)
