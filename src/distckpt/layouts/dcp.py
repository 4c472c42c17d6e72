"""The layout of a checkpoint directory torch.distributed.checkpoint (DCP) wrote.

DCP stores its metadata (``.metadata``) as a pickle and every item in its ``.distcp`` files as a ``torch.save``
archive, optionally through stream extensions (``ZStandard``, or one of the caller's). Nothing is unpickled freely:

- ``.metadata`` goes through an unpickler that resolves only DCP's metadata dataclasses and the torch types they
  hold; any other global is refused, so a crafted file cannot run code. Its fields are then checked like
  distckpt's own metadata (distckpt.layouts.checks);
- a tensor item is undone through its extensions with its output bounded by the chunk's size, its archive read
  by distckpt.layouts.torch_zip, and the tensor it holds must have the chunk's dtype and shape exactly;
- a value item is read the same way; one that is not plain data reaches the planner as a pickled value, which it
  loads only with ``DefaultLoadPlanner(allow_pickle=True)``.

Items in DCP's safetensors serialization are refused with a message saying how to convert them.
"""

from __future__ import annotations

import collections
import io
import os
import pathlib
import pickle
from typing import Any, Optional, Union

import torch

from .. import knobs
from ..errors import CheckpointError, CorruptCheckpointError
from ..format import METADATA_FILE
from ..format.chunk_codec import CODEC_SEPARATOR, ChunkCodec
from ..format.dtypes import itemsize
from ..format.records import FileInfo, ForeignStorageData, StorageInfo
from ..format.stream_transforms import codec_for
from ..format.values import encode_value
from ..metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from .checks import MAX_DIM, check_layout
from .pickles import check_memo
from .torch_zip import NotPlainData, TensorRef, check_crc, materialise, open_archive, tensor_from, unpickle_refs

__all__ = ["DCP_METADATA_FILE", "TORCH_SAVE", "parse_dcp_metadata", "dcp_layout", "is_dcp_directory"]

DCP_METADATA_FILE = ".metadata"
TORCH_SAVE = "torch.save"  # the innermost codec of every DCP item: a torch.save archive
ARCHIVE_SLACK = 1 << 16
_MAX_CHUNKS = 50_000_000  # what a torch.save archive of one tensor holds beside its bytes (headers, pickle), at most

_DCP_METADATA_CLASSES = {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                         "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"}
_PATHS = {"PosixPath": pathlib.PosixPath, "PurePosixPath": pathlib.PurePosixPath}


def is_dcp_directory(checkpoint_id: Union[str, os.PathLike, None]) -> bool:
    """A local directory holding DCP's ``.metadata`` (a regular file) and no distckpt metadata."""
    if checkpoint_id is None:
        return False
    path = os.fspath(checkpoint_id)
    if not isinstance(path, str) or "://" in path:
        return False
    marker = os.path.join(path, DCP_METADATA_FILE)
    return os.path.isfile(marker) and not os.path.islink(marker) and not os.path.lexists(os.path.join(path, METADATA_FILE))


def _layout(name: str) -> torch.layout:
    """A torch layout from its pickled name (``"torch.strided"``), as torch.serialization._get_layout, for names only."""
    value = getattr(torch, str(name).rpartition(".")[2], None)
    if not isinstance(value, torch.layout):
        raise pickle.UnpicklingError(f"{name!r} is not a torch layout")
    return value


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves DCP's metadata classes and the torch values in them; refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata" and name in _DCP_METADATA_CLASSES:
            # DCP is imported only here, when a DCP checkpoint is read: distckpt does not otherwise depend on it
            from torch.distributed.checkpoint import metadata as dcp_metadata  # noqa: PLC0415

            return getattr(dcp_metadata, name)
        if module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo":
            from torch.distributed.checkpoint.filesystem import _StorageInfo  # noqa: PLC0415

            return _StorageInfo
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout
        if module == "torch":
            value = getattr(torch, name, None)
            if value is torch.Size or isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        if (module, name) in (("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")):
            return {"OrderedDict": collections.OrderedDict, "set": set, "frozenset": frozenset}[name]
        if module == "pathlib" and name in _PATHS:
            return _PATHS[name]
        raise pickle.UnpicklingError(f"global {module}.{name} is not part of DCP's metadata")


def parse_dcp_metadata(raw: bytes, where: str) -> Any:
    """DCP's metadata object from the bytes of ``.metadata``, through the restricted unpickler."""
    check_memo(raw, where)
    try:
        return _MetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # noqa: BLE001 - a damaged pickle raises anything
        raise CorruptCheckpointError(
            f"{where}: {DCP_METADATA_FILE} is not DCP metadata distckpt can read ({type(exc).__name__}: {exc}). If it is "
            "a checkpoint you trust from a newer DCP, convert it with distckpt.convert.from_dcp(src, dst, "
            "trust_pickle=True)") from None


def _field(obj: Any, name: str, where: str, kinds: Any) -> Any:
    value = getattr(obj, name, None)
    if not isinstance(value, kinds):
        raise CorruptCheckpointError(f"{where}: field {name!r} of DCP's metadata is a {type(value).__name__}; "
                                     "the checkpoint is damaged or forged")
    return value


def _int_tuple(value: Any, what: str, where: str) -> torch.Size:
    if not isinstance(value, (tuple, list, torch.Size)) or len(value) > 64 or not all(
            type(v) is int and 0 <= v <= MAX_DIM for v in value):
        raise CorruptCheckpointError(f"{where}: {what} {value!r:.200} is not a list of sizes")
    return torch.Size(value)


def dcp_layout(dcp_md: Any, file_sizes: dict[str, int], where: str, checkpoint_id: Optional[str], load_id: str,
               registry: Any) -> Metadata:
    """DCP's metadata as distckpt's, every item placed and checked (distckpt.layouts.checks).

    ``file_sizes`` holds the size of every regular file of the directory, by name; ``registry`` rebuilds
    stream extensions (None: one that knows ZStandard)."""
    sdm: dict[str, Any] = {}
    state = _field(dcp_md, "state_dict_metadata", where, dict)
    chunk_count = 0
    for fqn, md in state.items():
        here = f"{where}: key {fqn!r}"
        if not isinstance(fqn, str):
            raise CorruptCheckpointError(f"{where}: a key of DCP's metadata is a {type(fqn).__name__}")
        kind = type(md).__name__
        if kind == "BytesStorageMetadata":
            sdm[fqn] = BytesStorageMetadata()
        elif kind == "TensorStorageMetadata":
            p = getattr(md, "properties", None)
            dtype = getattr(p, "dtype", None)
            if not isinstance(dtype, torch.dtype):
                raise CorruptCheckpointError(f"{here}: tensor properties without a torch dtype")
            props = TensorProperties(dtype, torch.strided, bool(getattr(p, "requires_grad", False)))
            chunks = []
            listed = _field(md, "chunks", here, (list, tuple))
            chunk_count += len(listed)
            if chunk_count > _MAX_CHUNKS:  # one pickled list may be referenced by every key: bound the walk
                raise CorruptCheckpointError(f"{where}: DCP's metadata lists more than {_MAX_CHUNKS} chunks")
            for c in listed:
                chunks.append(ChunkStorageMetadata(_int_tuple(getattr(c, "offsets", None), "chunk offsets", here),
                                                   _int_tuple(getattr(c, "sizes", None), "chunk sizes", here)))
            sdm[fqn] = TensorStorageMetadata(props, _int_tuple(getattr(md, "size", None), "the size", here), chunks)
        else:
            raise CorruptCheckpointError(f"{here}: metadata of type {kind}")
    items: dict[MetadataIndex, StorageInfo] = {}
    for index, info in (_field(dcp_md, "storage_data", where, (dict, type(None))) or {}).items():
        fqn, offset = getattr(index, "fqn", None), getattr(index, "offset", None)
        if not isinstance(fqn, str):
            raise CorruptCheckpointError(f"{where}: a stored item is keyed by {index!r:.200}")
        here = f"{where}: key {fqn!r}"
        descriptors = getattr(info, "transform_descriptors", None) or ()
        if not (isinstance(descriptors, (list, tuple)) and all(isinstance(d, str) and d and CODEC_SEPARATOR not in d
                                                                for d in descriptors)):
            raise CorruptCheckpointError(f"{here}: malformed transform descriptors {descriptors!r:.200}")
        name, start, length = getattr(info, "relative_path", None), getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(name, str) or type(start) is not int or type(length) is not int:
            raise CorruptCheckpointError(f"{here}: stored at {name!r:.100}, offset {start!r:.40}, length {length!r:.40}")
        if name not in file_sizes:
            raise CorruptCheckpointError(f"{here}: stored in {name!r}, which is not a regular file of the directory")
        key = MetadataIndex(fqn, None if offset is None else _int_tuple(offset, "an item offset", here))
        if key in items:
            raise CorruptCheckpointError(f"{here}: two stored items at {list(key.offset or [])}")
        items[key] = StorageInfo(name, start, length, None, CODEC_SEPARATOR.join([TORCH_SAVE, *descriptors]))
    for fqn, entry in sdm.items():  # a value's item is keyed with no offset; DCP may record one of zeros
        if isinstance(entry, BytesStorageMetadata) and MetadataIndex(fqn) not in items:
            for key in [k for k in items if k.fqn == fqn]:
                items[MetadataIndex(fqn)] = items.pop(key)
    files = {name: FileInfo(size, 0, 0) for name, size in file_sizes.items()
             if any(info.file == name for info in items.values())}
    sm = getattr(dcp_md, "storage_meta", None)
    save_id = getattr(sm, "save_id", None)
    fsd = ForeignStorageData(str(save_id) if isinstance(save_id, str) else "", files, items, layout="DCP",
                             decoder=_Decoders(sdm, registry))
    meta = StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id if isinstance(save_id, str) else None, load_id=load_id)
    mappings = getattr(dcp_md, "planner_data", None)  # DCP's flattening: key -> path, as distckpt's
    if mappings is not None and not (isinstance(mappings, dict) and all(isinstance(v, tuple) for v in mappings.values())):
        mappings = None  # planner_data of another planner (not a flattening): not distckpt's to use
    version = getattr(dcp_md, "version", None)
    md = Metadata(state_dict_metadata=sdm, planner_data=mappings, storage_data=fsd, storage_meta=meta,
                  version=version if isinstance(version, str) else None)
    check_layout(md, where)
    return md


class _Decoders:
    """The decoder of each DCP item: its stream extensions undone (bounded), then its torch.save archive read."""

    def __init__(self, sdm: dict, registry: Any) -> None:
        self.sdm, self.registry = sdm, registry

    def __call__(self, index: MetadataIndex, info: StorageInfo, where: str) -> ChunkCodec:
        inner, _, outer = info.codec.partition(CODEC_SEPARATOR)
        if inner != TORCH_SAVE:
            raise CorruptCheckpointError(f"{where}: stored as {info.codec!r}, not a torch.save archive")
        transforms = codec_for(outer, self.registry, where) if outer else None
        entry = self.sdm.get(index.fqn)
        if isinstance(entry, TensorStorageMetadata):
            shape = next((tuple(c.sizes) for c in entry.chunks if tuple(c.offsets) == tuple(index.offset or ())), None)
            if shape is None:
                raise CorruptCheckpointError(f"{where}: no chunk of the key starts at {list(index.offset or [])}")
            return _TensorItem(transforms, entry.properties.dtype, shape)
        return _ValueItem(transforms)


def _undo(transforms: Optional[ChunkCodec], stored: memoryview, limit: int, where: str) -> memoryview:
    """The archive under an item's stream extensions, at most ``limit`` bytes."""
    if transforms is None:
        return stored
    return memoryview(transforms.decode(stored, -1, where, limit=limit)).cast("B")


class _TensorItem(ChunkCodec):
    """A tensor item: a torch.save archive of one tensor of the chunk's dtype and shape, whose bytes it returns."""

    name = TORCH_SAVE

    def __init__(self, transforms: Optional[ChunkCodec], dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.transforms, self.dtype, self.shape = transforms, dtype, shape

    def encode(self, data: memoryview) -> bytes:
        raise CheckpointError("DCP items are read here, never written")

    def decode(self, stored: memoryview, nbytes: int, where: str) -> memoryview:
        archive_bytes = _undo(self.transforms, stored, nbytes + ARCHIVE_SLACK, where)
        pread = _pread_of(archive_bytes)
        archive = open_archive(pread, len(archive_bytes), where)
        try:
            ref = unpickle_refs(archive, pread, where, ARCHIVE_SLACK)
        except NotPlainData as exc:
            raise CorruptCheckpointError(f"{where}: the tensor item's archive names {exc}, not a tensor") from None
        if not isinstance(ref, TensorRef):
            raise CorruptCheckpointError(f"{where}: the tensor item holds a {type(ref).__name__}, not a tensor")
        if ref.dtype != self.dtype or ref.size != self.shape or ref.nbytes() != nbytes:
            raise CorruptCheckpointError(
                f"{where}: the stored tensor is {ref.dtype} of size {list(ref.size)}, but the metadata records a chunk of "
                f"{self.dtype} of size {list(self.shape)}; the checkpoint is damaged or forged")
        if ref.contiguous():
            rec = archive.storage(ref.storage)
            check_crc(rec, archive_bytes[rec.offset:rec.offset + rec.size], f"data/{ref.storage.key}", where)
            start = rec.offset + ref.offset * itemsize(ref.dtype)
            return archive_bytes[start:start + nbytes]
        return memoryview(tensor_from(archive, ref, pread).contiguous().view(torch.uint8).numpy()).cast("B")


class _ValueItem(ChunkCodec):
    """A value item: a torch.save archive of any object, returned in distckpt's value encoding."""

    name = TORCH_SAVE

    def __init__(self, transforms: Optional[ChunkCodec]) -> None:
        self.transforms = transforms

    def encode(self, data: memoryview) -> bytes:
        raise CheckpointError("DCP items are read here, never written")

    def decode(self, stored: memoryview, nbytes: int, where: str) -> memoryview:
        limit = knobs.max_value_bytes()
        archive_bytes = _undo(self.transforms, stored, limit, where)
        pread = _pread_of(archive_bytes)
        archive = open_archive(pread, len(archive_bytes), where)
        try:
            value = materialise(unpickle_refs(archive, pread, where, limit), archive, pread)
            held = sum(t.nbytes for t in _tensors(value))
            if held > limit:
                raise CorruptCheckpointError(f"{where}: the value's tensors hold {held} bytes, over the cap of {limit} "
                                             "(DISTCKPT_MAX_VALUE_BYTES)")
        except NotPlainData:  # an object only the unpickler can build: the planner runs it only if allowed
            return memoryview(encode_value(_TrustedArchive(bytes(archive_bytes)), allow_pickle=True, where=where))
        try:
            return memoryview(encode_value(value, allow_pickle=False, where=where))
        except CheckpointError:  # not plain data by distckpt's rules (an OrderedDict, a set): pickled, as above
            return memoryview(encode_value(value, allow_pickle=True, where=where))


def _tensors(obj: Any):
    """The tensors in a materialised value (a tree: its size was bounded when it was unpickled)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            yield from _tensors(v)


def _pread_of(data: memoryview):
    def pread(n: int, offset: int) -> bytes:
        return bytes(data[offset:offset + n])
    return pread


class _TrustedArchive:
    """A DCP value that only ``torch.load`` can build: pickled as a call of it, which the planner makes only when
    the caller allowed pickle for a checkpoint they trust."""

    def __init__(self, archive: bytes) -> None:
        self.archive = archive

    def __reduce__(self) -> tuple:
        return load_trusted_archive, (self.archive,)


def load_trusted_archive(archive: bytes) -> Any:
    """The object a torch.save archive holds, with the full unpickler (for checkpoints the caller trusts)."""
    return torch.load(io.BytesIO(archive), map_location="cpu", weights_only=False)
