"""Loading a ``torch.save`` file straight into a (possibly sharded) state dict.

The file is never given to ``torch.load``: distckpt.layouts.torch_save reads its archive (records stored as they
are, a pickle of tensors and plain data only, every tensor inside its storage) and places every tensor at its bytes
in the file. Two readers use it:

- :class:`TorchSaveReader` (chosen by ``distckpt.load(state_dict, checkpoint_id="model.pt")``): every rank reads
  the rows its state dict holds straight from the file, through the read engine, like any checkpoint;
- :class:`BroadcastingTorchSaveReader` (DCP's name, with :class:`DynamicMetaLoadPlanner`): the coordinator reads
  the tensors and broadcasts each over the default process group, for a file only it can see.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch.futures import Future

from .backends.fs_objects import open_regular
from .backends.torch_save_file import TorchSaveReader, is_torch_save_file
from .errors import CheckpointError, MissingKeyError, ShapeMismatchError
from .layouts.torch_save import load_torch_save
from .metadata import STATE_DICT_TYPE, ChunkStorageMetadata, Metadata, StorageMeta, TensorProperties, TensorStorageMetadata
from .planner import LoadItemType, LoadPlan, LoadPlanner
from .planning import DefaultLoadPlanner
from .planning.flatten import flatten_state_dict
from .planning.tensors import dtype_of, is_dtensor, is_sharded_tensor
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
        metadata: Metadata = planner.metadata
        by_key: dict[str, list] = {}
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise CheckpointError(f"key {item.dest_index.fqn!r}: {type(self).__name__} loads tensors only")
            by_key.setdefault(item.storage_index.fqn, []).append(item)
        source = self._source(planner) if self.is_coordinator else None
        spread = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if spread:  # the coordinator says whether it could read the file before anyone waits for a tensor
            status = torch.tensor([0 if self.is_coordinator and isinstance(source, dict) else 1])
            dist.broadcast(status, src=self.coordinator_rank)
            if status.item():
                raise source if isinstance(source, BaseException) else CheckpointError(
                    f"{self._where()}: the coordinator (rank {self.coordinator_rank}) could not read the file")
        elif isinstance(source, BaseException):
            raise source
        for fqn in sorted(metadata.state_dict_metadata):
            entry = metadata.state_dict_metadata[fqn]
            if self.is_coordinator:
                tensor = source[fqn]
            else:
                tensor = torch.empty(entry.size, dtype=entry.properties.dtype)
            if spread:
                dist.broadcast(tensor, src=self.coordinator_rank)
            for item in by_key.get(fqn, ()):
                piece = tensor
                for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                    piece = piece.narrow(dim, offset, length)
                dest = planner.resolve_tensor(item).detach()
                dest.copy_(piece)
                planner.commit_tensor(item, dest)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _where(self) -> str:
        return f"torch.save file {str(self.checkpoint_id)!r}"

    def _source(self, planner: LoadPlanner) -> Union[dict, BaseException]:
        """The file's tensors by key, as the metadata wants them; or the error, raised after telling the others."""
        try:
            fd = open_regular(os.fspath(self.checkpoint_id))
            try:
                loaded = load_torch_save(lambda n, offset: os.pread(fd, n, offset), os.fstat(fd).st_size, self._where())
            finally:
                os.close(fd)
            if not isinstance(loaded, dict):
                raise CheckpointError(f"{self._where()} holds a {type(loaded).__name__}, not a state dict")
            flat = flatten_state_dict(loaded)[0] if getattr(planner, "flatten_state_dict", True) else loaded
            out = {}
            for fqn, entry in planner.metadata.state_dict_metadata.items():
                value = flat.get(fqn)
                if value is None:
                    raise MissingKeyError(f"{self._where()}: key {fqn!r} is not in the file (Missing key in checkpoint); "
                                          "leave it out of the state dict")
                if not isinstance(value, torch.Tensor) or is_dtensor(value) or is_sharded_tensor(value):
                    raise CheckpointError(f"{self._where()}: key {fqn!r} is a {type(value).__name__} in the file, not a plain tensor")
                if tuple(value.shape) != tuple(entry.size):
                    raise ShapeMismatchError(f"{self._where()}: key {fqn!r} has shape {tuple(value.shape)}, the state dict "
                                             f"{tuple(entry.size)} (Size mismatch)")
                out[fqn] = value.to(entry.properties.dtype).contiguous()
            return out
        except CheckpointError as exc:
            return exc
        except OSError as exc:
            return CheckpointError(f"{self._where()}: cannot be read ({exc})")
