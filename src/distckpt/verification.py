"""verify(): check every byte of a checkpoint against its checksums, without a model."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional, Union

from . import backends, knobs
from .backends.blob_storage import BlobStorageReader
from .backends.foreign import LayoutReader
from .engine.check import check_stored
from .errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from .format.records import FileStorageData, split_reference
from .progress import Progress
from .stored_bytes import StoredBytes, stored_bytes

__all__ = ["verify", "VerifyReport"]

@dataclass
class VerifyReport:
    """What :func:`verify` checked, and every problem it found."""

    checkpoint_id: str
    files: int = 0
    items: int = 0
    bytes_checked: int = 0
    problems: list[str] = field(default_factory=list)
    keys: int = 0  # the checkpoint's keys, as ``inspect`` and ``load`` count them
    written_by: str = "distckpt"  # or the program whose checkpoint it is (a layout: "DCP", "Hugging Face safetensors", ...)
    checksums: bool = True  # False: the program recorded none, so only the structure could be checked
    # stored bytes in the checkpoint's own files, in files of other steps it references, and decoded (stored_bytes.py)
    stored: StoredBytes = field(default_factory=StoredBytes)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(checkpoint_id: Union[str, os.PathLike], storage_reader: Optional[BlobStorageReader] = None, *,
           raise_on_error: bool = True, progress: Optional[bool] = None) -> VerifyReport:
    """Check a checkpoint: metadata checksum and structure, every data file's size, save id
    and header checksum, and the CRC-32C of every chunk and value. The data files of other steps that an
    incremental save references are checked as its own are: there, whole, of the save that stored them.

    ``progress``: True reports on standard error as ``DISTCKPT_PROGRESS=bar`` does (log lines off a terminal),
    False reports nothing, None as ``DISTCKPT_PROGRESS`` says; the phase is named "verify" either way.

    Returns a report; if anything is wrong and ``raise_on_error`` is set, raises
    CorruptCheckpointError listing every problem (a missing or uncommitted
    checkpoint raises CheckpointNotFoundError).
    """
    reader = storage_reader if storage_reader is not None else backends.reader_for(checkpoint_id)
    if isinstance(reader, LayoutReader):
        return _verify_structure(reader, checkpoint_id)
    if not isinstance(reader, BlobStorageReader):
        raise CheckpointError(f"verify checks checkpoints distckpt reads; {str(checkpoint_id)!r} was given a storage reader "
                              "of another library: leave storage_reader= out")
    reader.reset(checkpoint_id)
    where = f"checkpoint {str(checkpoint_id)!r}"
    md = reader.read_metadata()  # checks the metadata checksum and structure
    fsd = md.storage_data
    if not isinstance(fsd, FileStorageData):
        raise CorruptCheckpointError(f"{where}: metadata has no data-file table")
    unresolved = _unresolved_references(reader.data_store(md), fsd, where)
    if unresolved is not None:
        if raise_on_error:
            raise CheckpointNotFoundError(unresolved)
        return VerifyReport(str(checkpoint_id), 0, 0, 0, [unresolved], keys=len(md.state_dict_metadata), stored=stored_bytes(md))
    mode = "bar" if progress else "off" if progress is False else knobs.progress_mode()
    # always a Progress of our own: without one the read underneath reports its own, named "load"
    shown = Progress("verify", sum(si.length for si in fsd.items.values()), mode=mode)
    checked = check_stored(reader.data_store(md), md, where, threads=reader.thread_count or knobs.io_threads(), progress=shown,
                           extension_registry=reader.extension_registry)
    report = VerifyReport(str(checkpoint_id), checked.files, checked.items, checked.bytes_checked, checked.problems,
                          keys=len(md.state_dict_metadata), stored=stored_bytes(md))
    if report.problems and raise_on_error:
        shown = "\n  ".join(report.problems[:20])
        more = f"\n  ... and {len(report.problems) - 20} more" if len(report.problems) > 20 else ""
        raise CorruptCheckpointError(f"{where} failed verification ({len(report.problems)} problem(s)):\n  {shown}{more}")
    return report


def _unresolved_references(store, fsd: FileStorageData, where: str) -> Optional[str]:
    """A step of an incremental run whose referenced files are not where its run would hold them (copied or moved out
    of its run, or the steps deleted by hand) is incomplete, not damaged: what to say of it, naming the steps it
    needs and the fix; None where every reference resolves."""
    missing: dict = {}
    for name, info in sorted(fsd.files.items()):
        if info.save_id is None:
            continue
        try:
            store.open(name).close()
        except CheckpointNotFoundError:
            checkpoint, _ = split_reference(name)
            missing.setdefault(checkpoint, []).append(name)
        except CheckpointError:
            continue  # there but damaged: the check of every file below reports it
    if missing:
        steps = ", ".join(sorted(missing))
        return (
            f"{where} is incomplete: it is a step of an incremental run that references {sum(map(len, missing.values()))} "
            f"data file(s) of {steps}, which are not beside it (it was copied or moved out of its run, or those steps were "
            "deleted outside distckpt's retention). Verify it where its run is; to copy it, first make it self-contained "
            "there with `distckpt compact <step>`.")
    return None


def _verify_structure(reader: LayoutReader, checkpoint_id: Union[str, os.PathLike]) -> VerifyReport:
    """A checkpoint another program wrote: its metadata is read and every item's place checked against the files
    (what ``load`` checks before it reads a byte); a program that recorded no checksums leaves nothing to check
    the bytes against."""
    reader.reset(checkpoint_id)
    md = reader.read_metadata()
    fsd = md.storage_data
    return VerifyReport(str(checkpoint_id), len(fsd.files), len(fsd.items), 0, [], keys=len(md.state_dict_metadata),
                        written_by=fsd.layout, checksums=False)
