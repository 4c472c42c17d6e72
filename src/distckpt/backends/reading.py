"""The read engine: validate files, then read each stored chunk once, in parallel."""

from __future__ import annotations

import io
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import torch

from ..errors import CheckpointError, CorruptCheckpointError
from ..format.checksum import crc32c
from ..format.datafile import read_header
from ..format.dtypes import itemsize
from ..format.records import FileStorageData, StorageInfo
from ..metadata import Metadata, MetadataIndex, TensorStorageMetadata
from ..planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from ..planning.resharding import volume
from .blobs import BlobReader, BlobStore
from .tensor_bytes import writable_bytes


def open_and_validate(store: BlobStore, fsd: FileStorageData, names, where: str) -> dict[str, BlobReader]:
    """Open the named data files and check size and save id of each, before anything is read into place."""
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
            header = read_header(blob.pread, blob.size, here)
            if header.save_id != fsd.save_id:
                raise CorruptCheckpointError(
                    f"{here}: belongs to save {header.save_id}, but this checkpoint is save {fsd.save_id}; "
                    "a file from another checkpoint was copied in. Restore the original file.")
            if header.lead_crc32c != info.header_crc32c:
                raise CorruptCheckpointError(
                    f"{here}: header checksum mismatch (offset 0 to {header.data_start}): stored {info.header_crc32c:08x}, "
                    f"computed {header.lead_crc32c:08x}. The file is damaged; restore it from a copy.")
    except BaseException:
        for b in blobs.values():
            b.close()
        raise
    return blobs


def read_items(store: BlobStore, md: Metadata, plan: LoadPlan, planner: LoadPlanner, checkpoint_id: str,
               *, verify: bool, threads: int) -> None:
    fsd: FileStorageData = md.storage_data
    where = f"checkpoint {checkpoint_id!r}"
    by_chunk: dict[MetadataIndex, list[ReadItem]] = defaultdict(list)
    for item in plan.items:
        by_chunk[item.storage_index].append(item)
    infos: dict[MetadataIndex, StorageInfo] = {}
    for index in by_chunk:
        info = fsd.items.get(index)
        if info is None:
            raise CorruptCheckpointError(f"{where}: key {index.fqn!r} chunk {list(index.offset or [])} has no storage entry in the metadata")
        infos[index] = info
    blobs = open_and_validate(store, fsd, {i.file for i in infos.values()}, where)
    lock = threading.Lock()
    chunk_shapes = _chunk_shapes(md)

    def run(index: MetadataIndex) -> None:
        items = by_chunk[index]
        info = infos[index]
        blob = blobs[info.file]
        here = f"{where}: key {index.fqn!r}"
        if items[0].type == LoadItemType.BYTE_IO:
            data = _read_exact(blob, info.length, info.offset, here, info.file)
            _check(verify, crc32c(data), info, here)
            with lock:
                planner.load_bytes(items[0], io.BytesIO(data))
            return
        md_entry = md.state_dict_metadata[index.fqn]
        assert isinstance(md_entry, TensorStorageMetadata)
        dtype = md_entry.properties.dtype
        shape = chunk_shapes[index]
        here = f"{here}, chunk {list(index.offset or [])}"
        if len(items) == 1 and tuple(items[0].lengths) == tuple(shape):
            with lock:
                dest = planner.resolve_tensor(items[0])
            view = writable_bytes(dest) if dest.dtype == dtype and tuple(dest.shape) == tuple(shape) else None
            if view is not None:
                _read_into(blob, view, info.offset, here, info.file)
                _check(verify, crc32c(view), info, here)
                with lock:
                    planner.commit_tensor(items[0], dest)
                return
        buf = torch.empty(info.length, dtype=torch.uint8)
        raw = memoryview(buf.numpy()).cast("B")
        _read_into(blob, raw, info.offset, here, info.file)
        _check(verify, crc32c(raw), info, here)
        src_all = buf.view(dtype).reshape(shape) if info.length else torch.empty(shape, dtype=dtype)
        for item in items:
            src = src_all
            for dim, (off, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                src = src.narrow(dim, off, length)
            with lock:
                dest = planner.resolve_tensor(item)
            if tuple(dest.shape) != tuple(item.lengths):
                raise CheckpointError(f"{here}: resolve_tensor returned shape {tuple(dest.shape)}, the read item needs {tuple(item.lengths)}")
            dest.copy_(src)
            with lock:
                planner.commit_tensor(item, dest)

    try:
        order = sorted(by_chunk, key=lambda ix: (infos[ix].file, infos[ix].offset))
        if threads <= 1 or len(order) <= 1:
            for ix in order:
                run(ix)
        else:
            with ThreadPoolExecutor(threads, thread_name_prefix="distckpt-read") as pool:
                for f in [pool.submit(run, ix) for ix in order]:
                    f.result()
    finally:
        for b in blobs.values():
            b.close()


def _chunk_shapes(md: Metadata) -> dict[MetadataIndex, tuple[int, ...]]:
    out = {}
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            for c in entry.chunks:
                out[MetadataIndex(fqn, c.offsets)] = tuple(c.sizes)
    return out


def _check(verify: bool, got: int, info: StorageInfo, here: str) -> None:
    if verify and got != info.crc32c:
        raise CorruptCheckpointError(
            f"{here}: checksum mismatch in file {info.file!r} at offset {info.offset} ({info.length} bytes): "
            f"stored {info.crc32c:08x}, computed {got:08x}. The data is damaged; restore the file from a copy.")


def _read_into(blob: BlobReader, view: memoryview, offset: int, here: str, file: str) -> None:
    got = blob.readinto(view, offset)
    if got != len(view):
        raise CorruptCheckpointError(f"{here}: file {file!r} ends at {offset + got}, before the {len(view)} bytes at offset {offset}; it is truncated")


def _read_exact(blob: BlobReader, n: int, offset: int, here: str, file: str) -> bytes:
    buf = bytearray(n)
    _read_into(blob, memoryview(buf), offset, here, file)
    return bytes(buf)
