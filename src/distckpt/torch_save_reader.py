"""Loading a ``torch.save`` file straight into a (possibly sharded) state dict.

The file is never given to ``torch.load``: distckpt.layouts.torch_save reads its archive (records stored as they
are, a pickle of tensors and plain data only, every tensor inside its storage) and places every tensor at its bytes
in the file. Two readers use it:

- :class:`TorchSaveReader` (chosen by ``distckpt.load(state_dict, checkpoint_id="model.pt")``): every rank reads
  the rows its state dict holds straight from the file, through the read engine, like any checkpoint;
- :class:`BroadcastingTorchSaveReader` (DCP's name, with :class:`DynamicMetaLoadPlanner`): the coordinator reads
  the tensors and broadcasts each over the default process group, for a file only it can see. It reads them a
  batch at a time, each within half the memory budget (DISTCKPT_MEMORY_BUDGET_BYTES), never the whole file at
  once (DCP's reader, and this one until issue 48, held the whole state dict on the coordinator).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch.futures import Future

from . import knobs
from .backends.fs_objects import open_regular
from .backends.torch_save_file import TorchSaveReader, is_torch_save_file
from .engine.chunk_reads import fresh_buffer
from .errors import CheckpointError, DTypeMismatchError, MissingKeyError, ShapeMismatchError
from .format.dtypes import dtype_from_name, dtype_name, itemsize
from .layouts.torch_save import flatten_refs, read_archive
from .layouts.torch_zip import TensorRef, tensor_from
from .metadata import STATE_DICT_TYPE, ChunkStorageMetadata, Metadata, StorageMeta, TensorProperties, TensorStorageMetadata
from .planner import LoadItemType, LoadPlan, LoadPlanner
from .planning import DefaultLoadPlanner
from .planning.flatten import flatten_state_dict
from .planning.tensors import dtype_of
from .storage import StorageReader

__all__ = ["TorchSaveReader", "BroadcastingTorchSaveReader", "DynamicMetaLoadPlanner", "is_torch_save_file"]

class DynamicMetaLoadPlanner(DefaultLoadPlanner):
    """A load planner for sources without checkpoint metadata: it describes every tensor of the state dict as
    stored whole, at its global shape and dtype, and plans the reads from that."""

    def set_up_planner(self, state_dict: STATE_DICT_TYPE, metadata: Optional[Metadata] = None,
                       is_coordinator: bool = False) -> None:
        flat = flatten_state_dict(state_dict, self.rank)[0] if self.flatten_state_dict else state_dict
        sdm: dict[str, Any] = {}
        for fqn, value in flat.items():
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"state dict key {fqn!r} holds a {type(value).__name__}; "
                                      f"{type(self).__name__} loads tensors only: leave it out of the state dict")
            dtype, requires_grad = dtype_of(value)
            size = torch.Size(value.size())
            sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype, requires_grad=requires_grad), size,
                                             [ChunkStorageMetadata(torch.Size([0] * len(size)), size)])
        storage_meta = metadata.storage_meta if metadata is not None else None
        super().set_up_planner(state_dict, Metadata(sdm, storage_meta=storage_meta), is_coordinator)


class BroadcastingTorchSaveReader(StorageReader):
    """Reads a ``torch.save`` file on the coordinator and broadcasts its tensors (see the module docstring).

    Args:
        checkpoint_id: the file (may also be given to ``load`` as ``checkpoint_id``).
        coordinator_rank: the rank that reads the file.
    """

    def __init__(self, checkpoint_id: Union[str, os.PathLike, None] = None, coordinator_rank: int = 0) -> None:
        self.checkpoint_id = checkpoint_id
        self.coordinator_rank = coordinator_rank
        self.is_coordinator = True

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        if checkpoint_id is not None:
            self.checkpoint_id = checkpoint_id

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return os.path.isfile(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """No metadata: the file holds none (pair this reader with :class:`DynamicMetaLoadPlanner`)."""
        return Metadata(state_dict_metadata={}, storage_meta=StorageMeta(checkpoint_id=self.checkpoint_id))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        if self.checkpoint_id is None:
            raise CheckpointError("BroadcastingTorchSaveReader needs the file: pass checkpoint_id=")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        by_key: dict[str, list] = {}
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise CheckpointError(f"key {item.dest_index.fqn!r}: {type(self).__name__} loads tensors only")
            by_key.setdefault(item.storage_index.fqn, []).append(item)
        mine = {fqn: [list(entry.size), dtype_name(entry.properties.dtype)]
                for fqn, entry in sorted(planner.metadata.state_dict_metadata.items())}
        source = self._source(planner) if self.is_coordinator else None
        try:
            spread = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            if spread:
                self._agree(mine, source)
            elif isinstance(source, BaseException):
                raise source
            # every rank the same keys, shapes and dtypes, in one order, in the same batches; the others receive
            # each into one buffer, kept for the whole load (a buffer per tensor would leave the allocator freed
            # memory of every size to keep, and gloo lets go of a tensor it sent only some time after)
            inbox = None
            if not self.is_coordinator:
                inbox = torch.empty(max((_nbytes(k) for k in mine.items()), default=0), dtype=torch.uint8)
            for batch in _batches(list(mine.items()), knobs.memory_budget_bytes() // 2):
                tensors = self._read_batch(source, [fqn for fqn, _ in batch], spread)
                for fqn, (size, dtype) in batch:
                    if self.is_coordinator:
                        tensor = tensors.pop(fqn)
                    else:
                        tensor = inbox[:_nbytes((fqn, (size, dtype)))].view(dtype_from_name(dtype)).view(size)
                    if spread:
                        dist.broadcast(tensor, src=self.coordinator_rank)
                    for item in by_key.get(fqn, ()):
                        piece = tensor
                        for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                            piece = piece.narrow(dim, offset, length)
                        dest = planner.resolve_tensor(item).detach()
                        dest.copy_(piece)
                        planner.commit_tensor(item, dest)
                    tensor = piece = None  # not held while the next batch is read
        finally:
            if isinstance(source, _Source):
                source.close()
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_batch(self, source: Any, keys: list[str], spread: bool) -> dict:
        """The coordinator's tensors of ``keys``; with ``spread``, whether it read them is told to every rank first,
        so that a damaged record raises everywhere instead of leaving the others waiting on a broadcast."""
        tensors: dict = {}
        error: Optional[BaseException] = None
        if self.is_coordinator:
            try:
                tensors = source.tensors(keys)
            except CheckpointError as exc:
                error = exc
            except OSError as exc:
                error = CheckpointError(f"{self._where()}: cannot be read ({exc})")
        if spread:
            said = self._from_coordinator({"error": None if error is None else f"{type(error).__name__}: {error}"})
            if error is None and said["error"] is not None:
                raise CheckpointError(f"{self._where()}: the coordinator (rank {self.coordinator_rank}) could not read the "
                                      f"file ({said['error']})")
        if error is not None:
            raise error
        return tensors

    def _from_coordinator(self, doc: Optional[dict]) -> dict:
        """The coordinator's ``doc`` (JSON), on every rank."""
        if self.is_coordinator:
            raw = json.dumps(doc).encode()
            length = torch.tensor([len(raw)], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(length, src=self.coordinator_rank)
        buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if self.is_coordinator else torch.empty(
            int(length.item()), dtype=torch.uint8)
        dist.broadcast(buf, src=self.coordinator_rank)
        return json.loads(bytes(buf.numpy()).decode())

    def _agree(self, mine: dict, source: Any) -> None:
        """Before any tensor travels: the coordinator says whether it read the file and what it will send (keys,
        shapes, dtypes); every rank compares that with its own state dict, and if any rank differs, every rank
        raises. Nothing is received into a destination of another shape or dtype, and no rank waits on a
        broadcast that never comes."""
        doc = None
        if self.is_coordinator:
            doc = {"error": None, "keys": mine} if isinstance(source, _Source) else {
                "error": f"{type(source).__name__}: {source}", "keys": {}}
        theirs = self._from_coordinator(doc)
        if theirs["error"] is not None:
            if isinstance(source, BaseException):
                raise source
            raise CheckpointError(f"{self._where()}: the coordinator (rank {self.coordinator_rank}) could not read the file "
                                  f"({theirs['error']})")
        differs = [fqn for fqn in sorted(set(mine) | set(theirs["keys"])) if mine.get(fqn) != theirs["keys"].get(fqn)]
        flag = torch.tensor([1 if differs else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if differs:
            fqn = differs[0]
            raise CheckpointError(
                f"{self._where()}: this rank's state dict has key {fqn!r} as {mine.get(fqn) or 'absent'}, the coordinator's "
                f"as {theirs['keys'].get(fqn) or 'absent'} ([shape, dtype]); every rank must pass the same keys, shapes "
                "and dtypes to BroadcastingTorchSaveReader")
        if flag.item():
            raise CheckpointError(f"{self._where()}: another rank's state dict differs from the coordinator's in keys, "
                                  "shapes or dtypes; every rank must pass the same ones")

    def _where(self) -> str:
        return f"torch.save file {str(self.checkpoint_id)!r}"

    def _source(self, planner: LoadPlanner) -> Union["_Source", BaseException]:
        """The file, its tensors checked against what the metadata wants (nothing read yet but the archive's
        directory and pickle); or the error, raised after telling the others."""
        try:
            return _Source(os.fspath(self.checkpoint_id), planner, self._where())
        except CheckpointError as exc:
            return exc
        except OSError as exc:
            return CheckpointError(f"{self._where()}: cannot be read ({exc})")


class _Source:
    """A ``torch.save`` file on the coordinator: every key the metadata wants, found and checked as a tensor of its
    shape (and dtype, or castable to it), read a batch of keys at a time."""

    def __init__(self, path: str, planner: LoadPlanner, where: str) -> None:
        self.fd = open_regular(path)
        self.arena = bytearray(0)
        try:
            obj, self.archive = read_archive(self.pread, os.fstat(self.fd).st_size, where)
            if not isinstance(obj, dict):
                raise CheckpointError(f"{where} holds a {type(obj).__name__}, not a state dict")
            flat = flatten_refs(obj) if getattr(planner, "flatten_state_dict", True) else obj
            self.refs: dict[str, tuple[TensorRef, torch.dtype]] = {}
            for fqn, entry in planner.metadata.state_dict_metadata.items():
                ref = flat.get(fqn)
                if ref is None:
                    raise MissingKeyError(f"{where}: key {fqn!r} is not in the file (Missing key in checkpoint); "
                                          "leave it out of the state dict")
                if not isinstance(ref, TensorRef):
                    raise CheckpointError(f"{where}: key {fqn!r} is a {type(ref).__name__} in the file, not a plain tensor")
                if tuple(ref.size) != tuple(entry.size):
                    raise ShapeMismatchError(f"{where}: key {fqn!r} has shape {tuple(ref.size)}, the state dict "
                                             f"{tuple(entry.size)} (Size mismatch)")
                if ref.dtype != entry.properties.dtype and not getattr(planner, "allow_dtype_conversion", False):
                    raise DTypeMismatchError(
                        f"{where}: key {fqn!r} is {ref.dtype} in the file, {entry.properties.dtype} in the state "
                        "dict; pass planner=DynamicMetaLoadPlanner(allow_dtype_conversion=True) to convert")
                self.refs[fqn] = (ref, entry.properties.dtype)
        except BaseException:
            self.close()
            raise

    def pread(self, n: int, offset: int) -> bytes:
        return os.pread(self.fd, n, offset)

    def tensors(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """The tensors of ``keys``, each read (storages shared within the batch read once) and checked against its
        record's CRC-32, contiguous and in the dtype the state dict wants. Their storages are read into one
        buffer, kept for the next batch: the tensors are views of it until then."""
        sizes = {ref.storage.key: self.archive.storage(ref.storage).size for ref, _ in (self.refs[k] for k in keys)}
        need = sum(-(-n // _ALIGN) * _ALIGN for n in sizes.values())
        if len(self.arena) < need:
            self.arena = bytearray(0)
            self.arena = fresh_buffer(need)
        free = [memoryview(self.arena)]

        def read_into(n: int, offset: int) -> memoryview:
            """``n`` bytes at ``offset`` (fewer at the end of the file), into the next free part of the buffer."""
            view, free[0] = free[0][:n], free[0][-(-n // _ALIGN) * _ALIGN:]
            got = 0
            while got < n:
                step = os.preadv(self.fd, [view[got:]], offset + got)
                if step <= 0:
                    break
                got += step
            return view[:got]

        cache: dict = {}
        return {fqn: tensor_from(self.archive, self.refs[fqn][0], read_into, cache).to(self.refs[fqn][1]).contiguous()
                for fqn in keys}

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


_ALIGN = 64  # each storage read into the coordinator's buffer starts on a boundary any dtype can be viewed at


def _nbytes(key: tuple[str, list]) -> int:
    size, dtype = key[1]
    return math.prod(size) * itemsize(dtype_from_name(dtype))


def _batches(keys: list[tuple[str, list]], limit: int) -> list[list[tuple[str, list]]]:
    """Consecutive keys (fqn, [shape, dtype name]) whose tensors together hold at most ``limit`` bytes; a larger
    tensor alone."""
    out: list[list] = []
    held = 0
    for key in keys:
        n = _nbytes(key)
        if not out or (held + n > limit and out[-1]):
            out.append([])
            held = 0
        out[-1].append(key)
        held += n
    return out
