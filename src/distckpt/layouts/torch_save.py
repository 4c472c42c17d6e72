"""The layout of a ``torch.save`` file of a state dict: every tensor placed at its bytes in the archive.

The archive is read by distckpt.layouts.torch_zip, never by ``torch.load``: its records must be stored as they
are, the pickle may build only tensors and plain data, and each tensor must lie inside its storage record. A
tensor laid out as it is in memory is then an ordinary stored chunk, read by the engine like any other (each
rank its own rows); one that is a strided view of its storage is read as the span of storage it covers and
copied out. Tensors that share a storage (tied weights) share bytes in the file, which the layout allows.
Only tensors are described: the file's other values are left out of the metadata.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .. import knobs
from ..errors import CheckpointError, CorruptCheckpointError
from ..format.chunk_codec import ChunkCodec
from ..format.dtypes import itemsize
from ..format.records import FileInfo, ForeignStorageData, StorageInfo
from ..metadata import ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata
from ..planning.flatten import flatten_state_dict
from .checks import check_layout
from .torch_zip import Archive, NotPlainData, TensorRef, materialise, open_archive, unpickle_refs

__all__ = ["read_archive", "flatten_refs", "torch_save_layout", "load_torch_save"]

STRIDED = "torch.save.strided"  # the codec of a tensor stored as a strided view of a storage span


def read_archive(pread: Callable[[int, int], bytes], size: int, where: str) -> tuple[Any, Archive]:
    """The object a ``torch.save`` file holds, tensors as TensorRefs, and its archive."""
    archive = open_archive(pread, size, where)
    try:
        obj = unpickle_refs(archive, pread, where, knobs.max_metadata_bytes())
    except NotPlainData as exc:
        raise CheckpointError(f"{where} holds an object of type {exc} beside tensors and plain data; distckpt does not "
                              "unpickle it. Save the state dict's tensors and plain values only.") from None
    return obj, archive


def load_torch_save(pread: Callable[[int, int], bytes], size: int, where: str) -> Any:
    """The object a ``torch.save`` file holds, built without ``torch.load`` (see the module docstring)."""
    obj, archive = read_archive(pread, size, where)
    return materialise(obj, archive, pread)


def flatten_refs(obj: Any) -> dict[str, Any]:
    """``obj`` (from :func:`read_archive`) flattened to dotted keys as the state dict it was saved from flattens:
    flattening walks a list only where it holds a tensor, so each TensorRef stands in as a tensor on the meta
    device while it runs (without that, a list of tensors stayed one value and its keys were missing)."""
    refs: dict[int, TensorRef] = {}

    def stand_in(node: Any) -> Any:
        if isinstance(node, TensorRef):
            meta = torch.empty(node.size, dtype=node.dtype, device="meta")
            refs[id(meta)] = node
            return meta
        if isinstance(node, dict):
            return {k: stand_in(v) for k, v in node.items()}
        if type(node) in (list, tuple):
            return type(node)(stand_in(v) for v in node)
        return node

    flat, _ = flatten_state_dict(stand_in(obj))
    return {fqn: refs.get(id(v), v) if isinstance(v, torch.Tensor) else v for fqn, v in flat.items()}


def torch_save_layout(obj: Any, archive: Archive, file: str, file_size: int, where: str, checkpoint_id: Optional[str],
                      load_id: str) -> Metadata:
    """The metadata of a ``torch.save`` file of a state dict: its tensors by dotted key, each one chunk."""
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where} holds a {type(obj).__name__}, not a state dict")
    flat = flatten_refs(obj)
    sdm: dict[str, Any] = {}
    items: dict[MetadataIndex, StorageInfo] = {}
    strided: dict[MetadataIndex, TensorRef] = {}
    for fqn, ref in flat.items():
        if not isinstance(ref, TensorRef):
            continue
        size = torch.Size(ref.size)
        origin = torch.Size([0] * len(size))
        sdm[fqn] = TensorStorageMetadata(TensorProperties(ref.dtype), size, [ChunkStorageMetadata(origin, size)])
        rec = archive.storage(ref.storage)
        start, end = ref.extent()
        index = MetadataIndex(fqn, origin)
        if ref.contiguous():
            items[index] = StorageInfo(file, rec.offset + start, ref.nbytes(), None)
        else:
            items[index] = StorageInfo(file, rec.offset + start, end - start, None, STRIDED)
            strided[index] = ref
    fsd = ForeignStorageData("", {file: FileInfo(file_size, 0, 0)}, items, layout="torch.save",
                             decoder=_Strided(strided))
    md = Metadata(state_dict_metadata=sdm, storage_data=fsd, storage_meta=StorageMeta(checkpoint_id=checkpoint_id, load_id=load_id))
    check_layout(md, where, shared_bytes=True)
    return md


class _Strided:
    def __init__(self, refs: dict[MetadataIndex, TensorRef]) -> None:
        self.refs = refs

    def __call__(self, index: MetadataIndex, info: StorageInfo, where: str) -> ChunkCodec:
        ref = self.refs.get(MetadataIndex(index.fqn, index.offset))
        if ref is None or info.codec != STRIDED:
            raise CorruptCheckpointError(f"{where}: stored as {info.codec!r}, which a torch.save file does not use")
        return _StridedView(ref)


class _StridedView(ChunkCodec):
    """A tensor stored as a strided view of the storage span [first byte it reads, last byte it reads]."""

    name = STRIDED

    def __init__(self, ref: TensorRef) -> None:
        self.ref = ref

    def encode(self, data: memoryview) -> bytes:
        raise CheckpointError("torch.save files are read here, never written")

    def decode(self, stored: memoryview, nbytes: int, where: str) -> memoryview:
        ref = self.ref
        start, end = ref.extent()
        if len(stored) != end - start or nbytes != ref.nbytes():
            raise CorruptCheckpointError(f"{where}: the stored span is {len(stored)} bytes, not {end - start}")
        if not len(stored):
            span = torch.empty(0, dtype=ref.dtype)
        else:  # the engine's own read buffer where it is writable: a copy would hold the span twice
            span = torch.frombuffer(stored if not stored.readonly else bytearray(stored), dtype=torch.uint8).view(ref.dtype)
        offset = ref.offset - start // itemsize(ref.dtype)
        out = span.as_strided(ref.size, ref.stride, offset).contiguous()
        return memoryview(out.view(torch.uint8).numpy()).cast("B")
