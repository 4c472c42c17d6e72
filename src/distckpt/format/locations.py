"""Where a metadata document says each stored item lives, decoded and checked.

Format 2.x keeps each chunk's location inline, as ``[offsets, sizes, file,
begin, crc]``, beside a table of data files; format 1.x lists locations apart
from the entries. Every location must name a listed file, lie inside it,
carry a well-formed checksum, appear once and overlap no other: a document
that breaks any of these is a CorruptCheckpointError naming the key.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import CorruptCheckpointError
from ..metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from .dtypes import itemsize
from .fields import MAX_INT, ints
from .records import FileInfo, FileStorageData, StorageInfo


def checked_chunk(chunk: ChunkStorageMetadata, size: torch.Size, here: str) -> ChunkStorageMetadata:
    """``chunk``, once its box is known to lie inside a tensor of ``size``."""
    offsets, sizes, ndim = chunk.offsets, chunk.sizes, len(size)
    if len(offsets) != ndim or len(sizes) != ndim:
        raise CorruptCheckpointError(f"{here}: chunk {list(offsets)}+{list(sizes)} does not have the tensor's {ndim} dimensions")
    for o, n, d in zip(offsets, sizes, size):
        if o + n > d:
            raise CorruptCheckpointError(f"{here}: chunk {list(offsets)}+{list(sizes)} lies outside tensor of size {list(size)}")
    return chunk


def inline_chunk(c: Any, fqn: str, size: torch.Size, width: int, fsd: FileStorageData, file_list: list,
                  here: str) -> ChunkStorageMetadata:
    """One format-2.x chunk ``[offsets, sizes, file, begin, crc]``, checked field by field: the reference
    for :func:`inline_chunks`, and what names the fault when its fast checks fail."""
    if type(c) is not list or len(c) != 5:
        raise CorruptCheckpointError(f"{here}: malformed chunk {c!r:.200}")
    chunk = checked_chunk(ChunkStorageMetadata(ints(c[0], here), ints(c[1], here)), size, here)
    add_item(fsd, file_list, MetadataIndex(fqn, chunk.offsets), c[2], c[3], math.prod(chunk.sizes) * width, c[4], here)
    return chunk


_new = object.__new__


def inline_chunks(chunks_raw: list, fqn: str, size: torch.Size, width: int, fsd: FileStorageData, file_list: list,
                   here: str) -> list:
    """The chunks of one tensor entry, their locations added to ``fsd.items``.

    The hot loop of decoding metadata at thousands of ranks: the checks of
    :func:`inline_chunk`, fused, and objects built without their
    constructors' per-field work. Anything the fast checks do not accept
    goes through :func:`inline_chunk`, which raises the precise error.
    """
    ndim = len(size)
    dims = tuple(size)
    items = fsd.items
    nfiles = len(file_list)
    chunks = []
    for c in chunks_raw:
        if type(c) is list and len(c) == 5:
            o_raw, s_raw, file_no, begin, crc = c
            if type(o_raw) is list and type(s_raw) is list and len(o_raw) == ndim and len(s_raw) == ndim:
                nbytes = width
                for o, n, d in zip(o_raw, s_raw, dims):
                    # d <= MAX_INT was checked with the size, so o + n <= d bounds o and n too
                    if type(o) is not int or type(n) is not int or o < 0 or n < 0 or o + n > d:
                        break
                    nbytes *= n
                else:
                    if (type(file_no) is int and 0 <= file_no < nfiles and type(begin) is int and 0 <= begin
                            and type(crc) is int and 0 <= crc <= 0xFFFFFFFF):
                        name, info = file_list[file_no]
                        if begin + nbytes <= info.size:
                            offsets = torch.Size(o_raw)
                            chunk = _new(ChunkStorageMetadata)
                            chunk.__dict__.update(offsets=offsets, sizes=torch.Size(s_raw))
                            index = _new(MetadataIndex)
                            index.__dict__.update(fqn=fqn, offset=offsets, index=None)
                            si = _new(StorageInfo)
                            si.__dict__.update(file=name, offset=begin, length=nbytes, crc32c=crc)
                            count = len(items)
                            items[index] = si
                            if len(items) == count:
                                raise CorruptCheckpointError(f"{here}: chunk {list(offsets)} is listed twice")
                            chunks.append(chunk)
                            continue
        chunks.append(inline_chunk(c, fqn, size, width, fsd, file_list, here))  # raises the precise error
    return chunks


def decode_file_table(data: Any, where: str) -> FileStorageData:
    """The ``$files`` member of format 2.x: save id and data-file table, items filled in from the entries."""
    from .names import check_file_name

    if not isinstance(data, dict) or set(data) != {"save_id", "files"}:
        raise CorruptCheckpointError(f"{where}: malformed storage data")
    save_id, files_raw = data["save_id"], data["files"]
    if not isinstance(save_id, str) or not isinstance(files_raw, list):
        raise CorruptCheckpointError(f"{where}: malformed storage data")
    files = {}
    for info in files_raw:
        if not (isinstance(info, list) and len(info) == 4):
            raise CorruptCheckpointError(f"{where}: malformed data-file entry {info!r:.200}")
        name = check_file_name(info[0], where)
        if not (all(type(x) is int and 0 <= x <= MAX_INT for x in info[1:3]) and is_crc(info[3])):
            raise CorruptCheckpointError(f"{where}: malformed entry for data file {name!r}")
        if name in files:
            raise CorruptCheckpointError(f"{where}: data file {name!r} is listed twice")
        files[name] = FileInfo(info[1], info[2], info[3])
    return FileStorageData(save_id, files, {})


def is_crc(value: Any) -> bool:
    return type(value) is int and 0 <= value <= 0xFFFFFFFF


def add_item(fsd: FileStorageData, file_list: list, index: MetadataIndex, file_no: Any, begin: Any, length: int,
              crc: Any, where: str) -> None:
    if type(file_no) is not int or not 0 <= file_no < len(file_list):
        raise CorruptCheckpointError(f"{where}: location names data file #{file_no!r:.20}, which the file table lacks")
    name, info = file_list[file_no]
    if not (type(begin) is int and type(length) is int and 0 <= begin <= MAX_INT and 0 <= length and begin + length <= info.size):
        raise CorruptCheckpointError(f"{where}: stored bytes {begin!r:.20}+{length} lie outside data file {name!r}")
    if type(crc) is not int or not 0 <= crc <= 0xFFFFFFFF:
        raise CorruptCheckpointError(f"{where}: malformed checksum {crc!r:.20}")
    items = fsd.items
    count = len(items)
    items[index] = StorageInfo(name, begin, length, crc)
    if len(items) == count:
        raise CorruptCheckpointError(f"{where}: chunk {list(index.offset or [])} is listed twice")


def cross_check(md: Metadata, fsd: FileStorageData, where: str) -> None:
    """Every stored chunk and value has exactly one storage item of the right length."""
    expected = 0
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            size = itemsize(entry.properties.dtype)
            for c in entry.chunks:
                si = fsd.items.get(MetadataIndex(fqn, c.offsets))
                if si is None:
                    raise CorruptCheckpointError(f"{where}: key {fqn!r} chunk {list(c.offsets)} has no storage item")
                want = math.prod(c.sizes) * size
                if si.length != want:
                    raise CorruptCheckpointError(
                        f"{where}: key {fqn!r} chunk {list(c.offsets)}: {si.length} bytes stored, shape {list(c.sizes)} "
                        f"of {entry.properties.dtype} needs {want}")
                expected += 1
        else:
            if MetadataIndex(fqn) not in fsd.items:
                raise CorruptCheckpointError(f"{where}: value {fqn!r} has no storage item")
            expected += 1
    if expected != len(fsd.items):
        raise CorruptCheckpointError(f"{where}: {len(fsd.items)} storage items for {expected} chunks and values")


def check_no_overlap(items: dict, files: dict, where: str) -> None:
    spans: dict[str, list] = {name: [] for name in files}
    for index, si in items.items():
        spans[si.file].append((si.offset, si.offset + si.length, index.fqn))
    for name, lst in spans.items():
        lst.sort()
        for (b0, e0, k0), (b1, _, k1) in zip(lst, lst[1:]):
            if b1 < e0:
                raise CorruptCheckpointError(f"{where}: items {k0!r} and {k1!r} overlap in data file {name!r}")
