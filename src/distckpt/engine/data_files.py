"""A checkpoint's data files, opened and checked before any byte of theirs is read into place: size, header, save id.

Every reader of distckpt's data files (a load, ``verify``, ``distckpt.open``) opens them here, so that a file of
another save, a truncated or replaced one, or a header that disagrees with the metadata is refused the same way.
"""

from __future__ import annotations

from typing import Optional

from ..errors import CorruptCheckpointError
from ..format.checksum import crc32c
from ..format.datafile import HeaderInfo, header_spans, pread_exact, read_header
from ..format.records import FileStorageData, ForeignStorageData
from .blobs import BlobReader, BlobStore

__all__ = ["open_and_validate"]


def open_and_validate(store: BlobStore, fsd: FileStorageData, names, where: str,
                      spans: Optional[dict] = None, expected: Optional[dict[str, bytes]] = None) -> dict[str, BlobReader]:
    """Open the named data files and check size, header and save id of each, before anything is read
    into place; with ``spans``, put each file's header entries there (see :func:`header_spans`), or None
    for a file that begins with the bytes ``expected`` gives for it (format/expected_headers.py): its
    header lists exactly what the metadata says."""
    blobs: dict[str, BlobReader] = {}
    try:
        for name in sorted(names):
            info = fsd.files.get(name)
            if info is None:
                raise CorruptCheckpointError(f"{where}: data file {name!r} is not listed in the metadata")
            blob = store.open(name)
            blobs[name] = blob
            here = f"{where}, file {name!r}"
            if blob.size != info.size:
                raise CorruptCheckpointError(
                    f"{here}: size is {blob.size} bytes, the metadata records {info.size}; the file is truncated or was replaced")
            if isinstance(fsd, ForeignStorageData):  # another program's file: no header of ours to check
                bound = fsd.identities.get(name)
                if bound is not None and blob.identity() != bound:
                    raise CorruptCheckpointError(f"{here}: was replaced after its layout was read (same name, another "
                                                 "file); load again")
                if spans is not None:
                    spans[name] = None
                continue
            header = _check_header(blob, info, info.save_id or fsd.save_id, here, expected.get(name) if expected else None)
            if spans is not None:
                spans[name] = None if header is None else header_spans(header)
    except BaseException:
        for b in blobs.values():
            b.close()
        raise
    return blobs


def _check_header(blob: BlobReader, info, save_id: str, here: str, lead: Optional[bytes] = None) -> Optional[HeaderInfo]:
    """Parse and check the header (every rule of docs/format.md, section 4), its save id and its CRC; None
    where the file begins with ``lead``, the bytes the writer wrote for what the metadata says.

    A CRC that matches the metadata's is not enough: metadata and header may have been forged
    together, so the header is always parsed or compared, and the load cross-checks each chunk against it.
    """
    if lead is not None and blob.size >= len(lead) and pread_exact(blob.pread, len(lead), 0, here) == lead:
        _check_lead_crc(crc32c(lead), info, len(lead), here)
        return None
    header = read_header(blob.pread, blob.size, here)  # raises if malformed
    if header.save_id != save_id:
        raise CorruptCheckpointError(
            f"{here}: belongs to save {header.save_id}, but this checkpoint is save {save_id}; "
            "a file from another checkpoint was copied in. Restore the original file.")
    _check_lead_crc(header.lead_crc32c, info, header.data_start, here)
    return header


def _check_lead_crc(crc: int, info, data_start: int, here: str) -> None:
    if crc != info.header_crc32c:
        raise CorruptCheckpointError(
            f"{here}: header checksum mismatch (offset 0 to {data_start}): stored {info.header_crc32c:08x}, "
            f"computed {crc:08x}. The file is damaged; restore it from a copy.")
