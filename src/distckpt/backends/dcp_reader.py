"""Reading a checkpoint directory that torch.distributed.checkpoint (DCP) wrote, so ``distckpt.load`` takes
it as it is, with resharding, and a run migrates without a conversion step.

DCP stores its metadata (``.metadata``) as a pickle and every item in its
``.distcp`` files as ``torch.save`` output. Neither is unpickled freely here:

- ``.metadata`` goes through an unpickler that resolves only DCP's metadata
  dataclasses and the torch types they hold (sizes, dtypes, layouts, memory
  formats); any other global a file names is refused, so a crafted file
  cannot run code;
- tensors load with ``torch.load(weights_only=True)``, torch's own
  restricted unpickler;
- non-tensor values load the same way; one that is not plain data (an
  arbitrary object) needs ``DefaultLoadPlanner(allow_pickle=True)``. Values
  reach the planner's ``load_bytes`` in distckpt's value encoding, as from a
  distckpt checkpoint.

Items written through DCP's stream extensions (``ZStandard``, or one of the
caller's, rebuilt by ``_extension_registry=`` as with DCP) are undone before
either. Items in DCP's safetensors serialization are refused with a message
saying how to convert them. The files are read as regular files only, never
through a symbolic link.
"""

from __future__ import annotations

import collections
import io
import os
import pathlib
import pickle
import uuid
from typing import Any, Union

import torch
from torch.futures import Future

from .. import knobs
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, UnsafeValueError
from ..format import METADATA_FILE
from ..format.chunk_codec import CODEC_SEPARATOR
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
from ..planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from ..storage import StorageReader
from .fs_objects import open_regular

__all__ = ["DCPReader", "is_dcp_directory"]

DCP_METADATA_FILE = ".metadata"

_DCP_METADATA_CLASSES = {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                         "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"}


def _layout(name: str) -> torch.layout:
    """A torch layout from its pickled name (``"torch.strided"``), as torch.serialization._get_layout, for names only."""
    value = getattr(torch, str(name).rpartition(".")[2], None)
    if not isinstance(value, torch.layout):
        raise pickle.UnpicklingError(f"{name!r} is not a torch layout")
    return value


def is_dcp_directory(checkpoint_id: Union[str, os.PathLike, None]) -> bool:
    """A local directory holding DCP's ``.metadata`` and no distckpt metadata."""
    if checkpoint_id is None:
        return False
    path = os.fspath(checkpoint_id)
    if not isinstance(path, str) or "://" in path:
        return False
    return (os.path.isfile(os.path.join(path, DCP_METADATA_FILE)) and not os.path.islink(os.path.join(path, DCP_METADATA_FILE))
            and not os.path.lexists(os.path.join(path, METADATA_FILE)))


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves DCP's metadata classes and the torch values in them; refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata" and name in _DCP_METADATA_CLASSES:
            # DCP is imported only here, when a DCP checkpoint is read: distckpt does not otherwise depend on it
            from torch.distributed.checkpoint import metadata as dcp_metadata

            return getattr(dcp_metadata, name)
        if module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo":
            from torch.distributed.checkpoint.filesystem import _StorageInfo

            return _StorageInfo
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout
        if module == "torch":
            value = getattr(torch, name, None)
            if value is torch.Size or isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        if (module, name) in (("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                              ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")):
            return {"OrderedDict": collections.OrderedDict, "set": set, "frozenset": frozenset,
                    "PosixPath": pathlib.PosixPath, "PurePosixPath": pathlib.PurePosixPath}[name]
        raise pickle.UnpicklingError(f"global {module}.{name} is not part of DCP's metadata")


class DCPReader(StorageReader):
    """Reads a checkpoint directory written by torch.distributed.checkpoint's FileSystemWriter.

    ``distckpt.load(state_dict, checkpoint_id=path)`` picks it for such a
    directory; pass it as ``storage_reader=`` to choose it explicitly.
    """

    def __init__(self, path: Union[str, os.PathLike, None] = None, *, _extension_registry: Any = None):
        self.path = None if path is None else os.fspath(path)
        self.load_id = uuid.uuid4().hex
        self.extension_registry = _extension_registry  # rebuilds DCP's stream extensions; None: one that knows ZStandard
        self._items: dict[MetadataIndex, tuple[str, int, int, str]] = {}

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self.load_id = uuid.uuid4().hex
        self._items = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return is_dcp_directory(checkpoint_id)

    def _where(self) -> str:
        return f"DCP checkpoint {self.path!r}"

    def _open(self, name: str) -> int:
        """A descriptor of the regular file ``name`` of the checkpoint (never through a link)."""
        if os.sep in name or name in ("", ".", ".."):
            raise CorruptCheckpointError(f"{self._where()}: its metadata names the file {name!r} outside the directory")
        return open_regular(os.path.join(self.path, name))

    def _pread(self, fd: int, name: str, offset: int, length: int) -> bytes:
        size = os.fstat(fd).st_size
        if offset < 0 or length < 0 or offset + length > size:
            raise CorruptCheckpointError(f"{self._where()}, file {name}: the item at bytes {offset}..{offset + length} "
                                         f"lies past the end of the file ({size} bytes); it is truncated or damaged")
        data = os.pread(fd, length, offset)
        if len(data) != length:
            raise CorruptCheckpointError(f"{self._where()}, file {name}: read {len(data)} of {length} bytes; the file "
                                         "changed while read")
        return data

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.path is None:
            raise CheckpointError("DCPReader needs the checkpoint directory: DCPReader(path) or checkpoint_id=")
        if not os.path.isdir(self.path):
            raise CheckpointNotFoundError(f"{self._where()} does not exist (no such directory); check the path")
        fd = self._open(DCP_METADATA_FILE)
        try:
            size = os.fstat(fd).st_size
            if size > knobs.max_metadata_bytes():
                raise CorruptCheckpointError(f"{self._where()}: {DCP_METADATA_FILE} is {size} bytes, over the cap of "
                                             f"{knobs.max_metadata_bytes()} (DISTCKPT_MAX_METADATA_BYTES)")
            raw = self._pread(fd, DCP_METADATA_FILE, 0, size)
        finally:
            os.close(fd)
        try:
            dcp_md = _MetadataUnpickler(io.BytesIO(raw)).load()
        except Exception as exc:  # noqa: BLE001 - a damaged pickle raises anything
            raise CorruptCheckpointError(
                f"{self._where()}: {DCP_METADATA_FILE} is not DCP metadata distckpt can read ({exc}). If it is a "
                "checkpoint you trust from a newer DCP, convert it with distckpt.convert.from_dcp(src, dst, "
                "trust_pickle=True)") from None
        return self._convert(dcp_md)

    def _convert(self, dcp_md: Any) -> Metadata:
        """DCP's metadata as distckpt's; the locations of its items kept in this reader."""
        sdm: dict[str, Any] = {}
        for fqn, md in getattr(dcp_md, "state_dict_metadata", {}).items():
            if type(md).__name__ == "BytesStorageMetadata":
                sdm[fqn] = BytesStorageMetadata()
            elif type(md).__name__ == "TensorStorageMetadata":
                p = md.properties
                props = TensorProperties(p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory)
                chunks = [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in md.chunks]
                sdm[fqn] = TensorStorageMetadata(props, torch.Size(md.size), chunks)
            else:
                raise CorruptCheckpointError(f"{self._where()}: key {fqn!r} has metadata of type {type(md).__name__}")
        items: dict[MetadataIndex, tuple[str, int, int, str]] = {}
        for index, info in (getattr(dcp_md, "storage_data", None) or {}).items():
            descriptors = getattr(info, "transform_descriptors", None) or ()
            if not (isinstance(descriptors, (list, tuple)) and all(isinstance(d, str) and d for d in descriptors)):
                raise CorruptCheckpointError(f"{self._where()}: item {index.fqn!r} has malformed transform descriptors")
            key = MetadataIndex(index.fqn, index.offset)
            items[key] = (str(info.relative_path), int(info.offset), int(info.length), CODEC_SEPARATOR.join(descriptors))
        self._items = items
        sm = getattr(dcp_md, "storage_meta", None)
        meta = StorageMeta(checkpoint_id=self.path, save_id=getattr(sm, "save_id", None), load_id=self.load_id)
        mappings = getattr(dcp_md, "planner_data", None)  # DCP's flattening: key -> path, as distckpt's
        if not (isinstance(mappings, dict) and all(
                isinstance(k, str) and isinstance(v, tuple) and all(isinstance(p, (str, int)) for p in v)
                for k, v in mappings.items())):
            mappings = None
        return Metadata(state_dict_metadata=sdm, planner_data=mappings, storage_meta=meta,
                        version=getattr(dcp_md, "version", None))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not self._items:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        files: dict[str, int] = {}  # each data file opened once for the whole plan
        try:
            for item in plan.items:
                self._read_item(item, planner, files)
        finally:
            for fd in files.values():
                os.close(fd)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_item(self, item: ReadItem, planner: LoadPlanner, files: dict[str, int]) -> None:
        where = self._items.get(MetadataIndex(item.storage_index.fqn, item.storage_index.offset))
        if where is None:
            raise CorruptCheckpointError(f"{self._where()}: its metadata lists no stored bytes for "
                                         f"{item.storage_index.fqn!r} at {list(item.storage_index.offset or [])}")
        name, offset, length, transforms = where
        if name not in files:
            files[name] = self._open(name)
        raw = self._pread(files[name], name, offset, length)
        label = f"{self._where()}, key {item.storage_index.fqn!r} (file {name})"
        if transforms:  # written through DCP's stream extensions: undone as DCP's reader does
            raw = bytes(codec_for(transforms, self.extension_registry, label).decode(memoryview(raw), -1, label))
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(self._value_bytes(raw, planner, label)))
            return
        try:
            stored = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - torch.load raises many kinds
            raise CorruptCheckpointError(
                f"{label}: the tensor bytes are not torch.save output ({type(exc).__name__}: {exc}); DCP's "
                "safetensors serialization is not read here: convert with torch.distributed.checkpoint.format_utils"
                ".dcp_to_torch_save") from None
        if not isinstance(stored, torch.Tensor):
            raise CorruptCheckpointError(f"{label}: a tensor item holds a {type(stored).__name__}")
        for dim, (off, n) in enumerate(zip(item.storage_offsets, item.lengths)):
            stored = stored.narrow(dim, off, n)
        dest = planner.resolve_tensor(item).detach()
        if dest.shape != stored.shape:
            raise CheckpointError(f"{label}: the planner's destination has shape {tuple(dest.shape)}, the read "
                                  f"item needs {tuple(stored.shape)}")
        dest.copy_(stored)
        planner.commit_tensor(item, dest)

    @staticmethod
    def _value_bytes(raw: bytes, planner: LoadPlanner, label: str) -> bytes:
        """A DCP value (``torch.save`` output) in distckpt's value encoding."""
        allow_pickle = bool(getattr(planner, "allow_pickle", False))
        try:
            value = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            if not allow_pickle:
                raise UnsafeValueError(
                    f"{label}: the value is a pickled object that is not plain data, and loading it would run "
                    "the unpickler; pass planner=DefaultLoadPlanner(allow_pickle=True) for a checkpoint you trust, "
                    "or leave the key out of the state dict") from None
            value = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=False)
        except Exception as exc:  # noqa: BLE001
            raise CorruptCheckpointError(f"{label}: the value bytes are not torch.save output ({exc})") from None
        return encode_value(value, allow_pickle=allow_pickle, where=label)
