"""verify(): check every byte of a checkpoint against its checksums, without a model."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional, Union

from . import backends, knobs
from .backends.blob_storage import BlobStorageReader
from .engine.read import ChunkShapes, open_and_validate
from .errors import CheckpointError, CorruptCheckpointError
from .format.checksum import crc32c
from .format.datafile import VALUE_FORM, check_header_entry, header_spans, read_header, stored_form
from .format.records import FileStorageData
from .metadata import TensorStorageMetadata

__all__ = ["verify", "VerifyReport"]

@dataclass
class VerifyReport:
    """What :func:`verify` checked, and every problem it found."""

    checkpoint_id: str
    files: int = 0
    items: int = 0
    bytes_checked: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(checkpoint_id: Union[str, os.PathLike], storage_reader: Optional[BlobStorageReader] = None, *,
           raise_on_error: bool = True, progress: bool = False) -> VerifyReport:
    """Check a checkpoint: metadata checksum and structure, every data file's size, save id
    and header checksum, and the CRC-32C of every chunk and value.

    Returns a report; if anything is wrong and ``raise_on_error`` is set, raises
    CorruptCheckpointError listing every problem (a missing or uncommitted
    checkpoint raises CheckpointNotFoundError).
    """
    reader = storage_reader if storage_reader is not None else backends.reader_for(checkpoint_id)
    if not isinstance(reader, BlobStorageReader):
        raise CheckpointError(f"verify needs one of distckpt's storage readers, got {type(reader).__name__}")
    reader.reset(checkpoint_id)
    report = VerifyReport(str(checkpoint_id))
    md = reader.read_metadata()  # checks the metadata checksum and structure
    fsd = md.storage_data
    if not isinstance(fsd, FileStorageData):
        raise CorruptCheckpointError(f"checkpoint {str(checkpoint_id)!r}: metadata has no data-file table")
    store = reader._store().data_store(fsd.save_id)
    where = f"checkpoint {str(checkpoint_id)!r}"
    by_file: dict[str, list] = {name: [] for name in fsd.files}
    shapes = ChunkShapes(md)
    for index, si in fsd.items.items():
        by_file[si.file].append((si.offset, index, si))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(si.length for si in fsd.items.values()), unit="B", unit_scale=True, desc="verify")
    for name in sorted(by_file):
        report.files += 1
        try:
            blobs = open_and_validate(store, fsd, [name], where)
        except CheckpointError as exc:
            report.problems.append(str(exc))
            continue
        blob = blobs[name]
        try:
            spans = header_spans(read_header(blob.pread, blob.size, f"{where}, file {name!r}"))
            for _, index, si in sorted(by_file[name], key=lambda t: t[0]):
                report.items += 1
                entry = md.state_dict_metadata.get(index.fqn)
                if isinstance(entry, TensorStorageMetadata):
                    form = stored_form(entry.properties.dtype, shapes.get(index), si.length)
                else:
                    form = (VALUE_FORM, (si.length,))
                try:
                    check_header_entry(spans, si.offset, si.length, form, f"{where}: key {index.fqn!r}, file {name!r}")
                except CheckpointError as exc:
                    report.problems.append(str(exc))
                crc = 0
                buf = bytearray(min(si.length, knobs.verify_piece_bytes()))
                pos = 0
                while pos < si.length:
                    n = min(len(buf), si.length - pos)
                    view = memoryview(buf)[:n]
                    got = blob.readinto(view, si.offset + pos)
                    if got != n:
                        report.problems.append(f"{where}, file {name!r}: ends before key {index.fqn!r} at offset {si.offset + pos}")
                        break
                    crc = crc32c(view, crc)
                    pos += n
                    if bar is not None:
                        bar.update(n)
                else:
                    report.bytes_checked += si.length
                    if crc != si.crc32c:
                        chunk = f" chunk {list(index.offset)}" if index.offset is not None else ""
                        report.problems.append(
                            f"{where}: key {index.fqn!r}{chunk}: checksum mismatch in file {name!r} at offset {si.offset} "
                            f"({si.length} bytes): stored {si.crc32c:08x}, computed {crc:08x}")
        finally:
            blob.close()
    if bar is not None:
        bar.close()
    if report.problems and raise_on_error:
        shown = "\n  ".join(report.problems[:20])
        more = f"\n  ... and {len(report.problems) - 20} more" if len(report.problems) > 20 else ""
        raise CorruptCheckpointError(f"{where} failed verification ({len(report.problems)} problem(s)):\n  {shown}{more}")
    return report
