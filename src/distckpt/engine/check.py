"""The check ``verify()`` runs: a read of every stored chunk through the load engine, delivering nothing."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..errors import CheckpointError
from ..format.checksum import crc32c
from ..format.datafile import check_header_entry
from ..format.dtypes import itemsize
from ..format.records import FileStorageData
from ..metadata import Metadata, MetadataIndex, TensorStorageMetadata
from ..planner import LoadItemType, LoadPlan, ReadItem
from ..planning.resharding import volume
from ..progress import Progress
from .blobs import BlobStore
from .chunk_reads import ChunkShapes, check_checksum, read_exact
from .data_files import open_and_validate
from .read import Read

__all__ = ["CheckResult", "check_stored"]


@dataclass
class CheckResult:
    """What :func:`check_stored` read: files opened, items and bytes checked, and every problem found."""

    files: int = 0
    items: int = 0
    bytes_checked: int = 0
    problems: list[str] = field(default_factory=list)


def check_stored(store: BlobStore, md: Metadata, where: str, *, threads: int, progress: Optional[Progress] = None,
                 extension_registry: Any = None) -> CheckResult:
    """Read every stored chunk and value ``md`` lists, as a load does, checking each file and each checksum.

    Nothing is copied anywhere: each chunk streams through the read buffers, and a problem does not stop
    the check; every one is collected in the result. Items stored through stream transforms are decoded
    too, by extensions ``extension_registry`` rebuilds.
    """
    fsd: FileStorageData = md.storage_data
    shapes = ChunkShapes(md)
    items = []
    for index in fsd.items:
        entry = md.state_dict_metadata.get(index.fqn)
        if isinstance(entry, TensorStorageMetadata):
            shape = shapes.get(index) or ()
            items.append(ReadItem(LoadItemType.TENSOR, index, torch.Size([0] * len(shape)), index,
                                  torch.Size([0] * len(shape)), torch.Size(shape)))
        else:
            items.append(ReadItem(LoadItemType.BYTE_IO, index, torch.Size([]), index, torch.Size([]), torch.Size([])))
    check = _Check(store, md, LoadPlan(items), None, where, True, frozenset(), extension_registry)
    check.open_files()
    try:
        check.execute(threads, True, progress)
    finally:
        check.close()
    return check.result


class _Check(Read):
    """A read that checks instead of delivering: every chunk goes through the buffers, problems are collected."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.result = CheckResult()

    def problem(self, text: str) -> None:
        with self.lock:
            self.result.problems.append(text)

    def open_files(self) -> None:
        by_file: dict[str, list[MetadataIndex]] = defaultdict(list)
        for index, info in self.infos.items():
            by_file[info.file].append(index)
        self.result.files = len(self.fsd.files)
        for name in sorted(self.fsd.files):
            spans: dict = {}
            try:
                self.blobs.update(open_and_validate(self.store, self.fsd, [name], self.where, spans))
            except CheckpointError as exc:
                self.problem(str(exc))
                for index in by_file.pop(name, []):
                    del self.by_chunk[index]
                continue
            for index in by_file.get(name, []):
                info = self.infos[index]
                try:
                    check_header_entry(spans[name], info.offset, info.length, self.form(index),
                                       f"{self.where}: key {index.fqn!r}, file {name!r}")
                except CheckpointError as exc:
                    self.problem(str(exc))

    def check_decodes(self, index: MetadataIndex) -> None:
        """Read a chunk stored through a codec, check its stored bytes and that they decode to exactly its bytes,
        keeping none of them."""
        info, shape = self.infos[index], self.chunk_shapes[index]
        nbytes = volume(shape) * itemsize(self.md.state_dict_metadata[index.fqn].properties.dtype)
        with self.budget.hold(info.length):
            stored = read_exact(self.reader(info.file), info.length, info.offset, self.here(index), info.file)
            check_checksum(True, crc32c(stored), info, self.here(index))
            self.codecs[index].decoded_size(memoryview(stored), nbytes, self.here(index))

    def split_direct(self) -> tuple[list, list[MetadataIndex]]:
        return [], sorted(self.by_chunk, key=lambda ix: (self.infos[ix].file, self.infos[ix].offset))

    def run_buffered(self, index: MetadataIndex) -> None:
        info = self.infos[index]
        try:
            if self.by_chunk[index][0].type == LoadItemType.BYTE_IO:
                data = read_exact(self.reader(info.file), info.length, info.offset, self.here(index), info.file)
                check_checksum(True, crc32c(data), info, self.here(index))
                if not self.codecs[index].identity:  # decoded in pieces, nothing kept: memory stays bounded
                    self.codecs[index].decoded_size(memoryview(data), -1, self.here(index))
            elif not self.codecs[index].identity:
                self.check_decodes(index)
            elif info.length:
                self.stream_chunk(index, [], True)
        except CheckpointError as exc:
            self.problem(str(exc))
            return
        with self.lock:
            self.result.items += 1
            self.result.bytes_checked += info.length
