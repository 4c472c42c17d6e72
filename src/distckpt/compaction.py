"""compact(): make a step of an incremental run self-contained again.

An incremental step references data files of earlier steps (format 4.0). Compaction copies each referenced file
into the step, under the step's own save id, and commits a new metadata document that references nothing; the
step then survives anything done to the rest of the run (copied elsewhere alone, its run deleted). The copy is
the file as stored, header and all: only the save id its header names changes, which keeps every offset, so the
chunks' recorded locations and checksums hold as they are. The files left unreferenced go at the run's next
retention or cleanup.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Union

from . import backends
from .backends.blob_storage import BlobStorageReader
from .engine.references import data_files
from .errors import CheckpointError, CorruptCheckpointError
from .format import METADATA_FILE
from .format.checksum import crc32c
from .format.codec import encode_metadata
from .format.datafile import loads_json, read_header
from .format.names import check_file_name
from .format.records import FileInfo, FileStorageData, StorageInfo, split_reference

__all__ = ["compact", "CompactReport"]

_PIECE = 16 << 20  # bytes copied per read: the copy holds one piece at a time


@dataclass(frozen=True)
class CompactReport:
    """What :func:`compact` did: the files copied into the checkpoint, and their bytes."""

    checkpoint_id: str
    files: int
    bytes_copied: int


def compact(checkpoint_id: Union[str, os.PathLike], **storage_options: Any) -> CompactReport:
    """Copy every data file ``checkpoint_id`` references in other checkpoints of its run into it, and commit it
    referencing none. A checkpoint that references nothing is left as it is."""
    reader = backends.reader_for(checkpoint_id, **storage_options)
    if not isinstance(reader, BlobStorageReader):
        raise CheckpointError(f"{str(checkpoint_id)!r} is not a distckpt checkpoint; only those reference other steps")
    reader.reset(checkpoint_id)
    where = f"checkpoint {str(checkpoint_id)!r}"
    md = reader.read_metadata()
    fsd = md.storage_data
    if not isinstance(fsd, FileStorageData):
        raise CorruptCheckpointError(f"{where}: metadata has no data-file table")
    referenced = sorted(name for name, info in fsd.files.items() if info.save_id is not None)
    if not referenced:
        return CompactReport(str(checkpoint_id), 0, 0)
    location = reader.blob_store()
    source = data_files(location, fsd)
    own = location.data_store(fsd.save_id)
    renamed: dict[str, str] = {}
    files = {name: info for name, info in fsd.files.items() if info.save_id is None}
    copied = 0
    # every referenced file's header is read and relabelled before any is copied: a damaged one fails the compaction
    # before it leaves a copy in the step
    leads = {key: _relabelled_lead(source, key, fsd.files[key], fsd.save_id, f"{where}, file {key!r}") for key in referenced}
    for key in referenced:
        checkpoint, file = split_reference(key)  # type: ignore[misc]
        new_name = _free_name(own, set(fsd.files) | set(files), checkpoint, file, where)
        info, lead = fsd.files[key], leads[key]
        copied += _copy(source, own, key, new_name, lead, info.size)
        renamed[key] = new_name
        files[new_name] = FileInfo(info.size, info.rank, crc32c(lead))
    items = {index: StorageInfo(renamed.get(si.file, si.file), si.offset, si.length, si.crc32c, si.codec)
             for index, si in fsd.items.items()}
    md.storage_data = FileStorageData(fsd.save_id, files, items)
    location.put_atomic(METADATA_FILE, encode_metadata(md), True)
    return CompactReport(str(checkpoint_id), len(referenced), copied)


def _free_name(own, taken: set, checkpoint: str, file: str, where: str) -> str:
    """A name to copy ``checkpoint``'s ``file`` in as: one the table does not list and the step does not hold. A file
    the step holds but does not list is what a compaction cut short left (nothing else writes into a committed step;
    it goes when the step is retired or removed): created exclusively, its name cannot be written again."""
    for attempt in range(100):
        name = check_file_name(f"{checkpoint}-{file}" if not attempt else f"{checkpoint}-{attempt}-{file}", where)
        if name not in taken and not own.exists(name):
            return name
    raise CheckpointError(f"{where}: cannot copy {checkpoint}/{file} in: 100 names for it are taken by files the "
                          "checkpoint holds; load the step and save it again instead")


def _relabelled_lead(source, key: str, info: FileInfo, save_id: str, here: str) -> bytes:
    """The length prefix and header of referenced file ``key``, naming save ``save_id`` instead of the one that wrote it:
    the header as parsed, its ``__metadata__`` naming the new save, written again at the same length (the spaces
    that pad a header take up any difference), so that every offset after it holds."""
    blob = source.open(key)
    try:
        header = read_header(blob.pread, blob.size, here)
        lead = blob.pread(header.data_start, 0)
    finally:
        blob.close()
    if crc32c(lead) != info.header_crc32c or header.save_id != info.save_id:
        raise CorruptCheckpointError(f"{here}: its header is not the one the metadata records; the file is damaged")
    members = loads_json(lead[8:])  # read_header has checked it whole
    members["__metadata__"] = {**members["__metadata__"], "save_id": save_id}
    length = len(lead) - 8
    for ascii_only in (False, True):
        text = json.dumps(members, separators=(",", ":"), ensure_ascii=ascii_only).encode("utf-8")
        if len(text) <= length:
            return lead[:8] + text + b" " * (length - len(text))
    raise CheckpointError(f"{here}: its header, naming this checkpoint's save, no longer fits in the {length} bytes it "
                          "has; load the step and save it again instead")


def _copy(source, own, key: str, name: str, lead: bytes, size: int) -> int:
    """Write ``lead`` and then the bytes of ``key`` after its lead into blob ``name`` of ``own``; return the bytes."""
    blob = source.open(key)
    out = own.create(name)
    try:
        out.pwrite(memoryview(lead), 0)
        position = len(lead)
        while position < size:
            piece = blob.pread(min(_PIECE, size - position), position)
            if not piece:
                raise CorruptCheckpointError(f"{source.describe(key)} ends at {position} bytes, not {size}")
            out.pwrite(memoryview(piece), position)
            position += len(piece)
    except BaseException:
        out.abort()
        raise
    finally:
        blob.close()
    out.close(True)
    return size
