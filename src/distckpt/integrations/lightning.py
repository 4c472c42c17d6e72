"""Lightning on distckpt: a CheckpointIO for strategies whose checkpoints one process writes (DDP), and
``ModelParallelStrategy`` with its sharded checkpoints and Lightning's metadata in one distckpt checkpoint.

``Trainer(plugins=[DistckptCheckpointIO()])`` (or ``Fabric(plugins=...)``): each ``.ckpt`` that Lightning
writes becomes a distckpt checkpoint directory of that name, written by the process Lightning calls
(rank 0 under DDP) without collectives, replaced atomically when saved again (``save_last``), and read
back whole. Values that are not plain data (a hyperparameter object, say) need ``allow_pickle=True``,
for checkpoints you trust, as anywhere in distckpt.

``Trainer(strategy=DistckptModelParallelStrategy(...))`` (the arguments of Lightning's
``ModelParallelStrategy``): the sharded checkpoint Lightning writes (``last.ckpt`` included) is one distckpt
checkpoint, saved by every rank and replaced atomically when saved again, holding the model and optimizer
states and, under the key ``meta``, the rest of Lightning's checkpoint (epoch, loops, callbacks, schedulers,
hyperparameters): what Lightning itself pickles into a ``meta.pt`` beside DCP's files. Each top-level entry
of it that is plain data (tensors, numbers, strings, bytes, lists, dicts: ``distckpt.format.values``) is
stored as such; an entry that is not (an object of its own class) is kept with ``torch.save``, as Lightning
keeps it, in one bytes value ``meta_torch_save`` inside the checkpoint, loaded back with ``torch.load`` and
Lightning's ``weights_only``, and named in a warning. A resume (``ckpt_path=``) reads distckpt's checkpoints
(those saved with ``route_dcp_calls()`` too, their ``meta.pt`` beside them), and Lightning's own (a file, or
DCP's folder with ``meta.pt``).

Each logs, at its first save, one line (Lightning's log, rank 0) saying that distckpt saves the checkpoints,
where, and in which format: Lightning's own lines name only the ``.ckpt`` paths, which are directories here.

Fabric's ``ModelParallelStrategy`` (and FSDP) save through torch.distributed.checkpoint themselves: route
those calls with :func:`distckpt.integrations.dcp_routing.route_dcp_calls`; Lightning's ``meta.pt`` then
stays beside them as Lightning writes it.
"""

from __future__ import annotations

import io
import os
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from ..extras import import_or_explain

import_or_explain("lightning", "distckpt.integrations.lightning", "lightning")  # before its imports: a typed error

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ..backends.filesystem import FsStore
from ..convert import read_whole
from ..errors import CheckpointError, UnsafeValueError
from ..format.values import to_data
from ..loading import load
from ..planning import DefaultSavePlanner
from ..saving import save
from .announce import announce

__all__ = ["DistckptCheckpointIO", "DistckptModelParallelStrategy", "META_KEY", "META_TORCH_SAVE_KEY"]

META_KEY = "meta"  #: Lightning's metadata, as plain data
META_TORCH_SAVE_KEY = "meta_torch_save"  #: its entries that are not plain data, torch.save'd as Lightning does


class DistckptCheckpointIO(CheckpointIO):
    """Lightning's checkpoint I/O through distckpt (see the module text)."""

    def __init__(self, allow_pickle: bool = False) -> None:
        self.allow_pickle = allow_pickle
        self._announced = False

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise CheckpointError(f"DistckptCheckpointIO takes no storage_options (got {storage_options!r})")
        if not self._announced:
            self._announced = True
            _announce(path)
        save(checkpoint, checkpoint_id=os.fspath(path), planner=DefaultSavePlanner(allow_pickle=self.allow_pickle),
             no_dist=True, overwrite=True)

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None) -> dict[str, Any]:
        # map_location: tensors come back on the CPU, and Lightning moves them where the module lives
        return read_whole(os.fspath(path), allow_pickle=self.allow_pickle)

    def remove_checkpoint(self, path: Any) -> None:
        store = FsStore(os.fspath(path))
        if store.is_committed():  # only a checkpoint of distckpt's: never another file Lightning names
            store.remove()


class DistckptModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` whose sharded checkpoints are distckpt's, Lightning's metadata
    inside them (see the module text). ``save_distributed_checkpoint=False`` (one consolidated file) stays
    Lightning's own."""

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None or not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)  # Lightning's answer, or its own file
        path = Path(self.broadcast(filepath))
        if not getattr(self, "_announced", False):  # Lightning builds strategies through many arguments: no __init__ here
            self._announced = True
            _announce(path)
        state: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        if self.global_rank == 0:  # Lightning's metadata is rank 0's, as its meta.pt is
            plain, other = _split_plain(checkpoint)
            state[META_KEY] = plain
            if other:
                warnings.warn(f"{path}: Lightning's checkpoint entries {sorted(other)} are not plain data; they are kept "
                              f"with torch.save in the value {META_TORCH_SAVE_KEY!r} (loaded with torch.load, as "
                              "Lightning loads its meta.pt). Store them as plain data to keep the checkpoint pickle-free.",
                              stacklevel=2)
                buffer = io.BytesIO()
                torch.save(other, buffer)
                state[META_TORCH_SAVE_KEY] = buffer
            if path.is_file():  # a consolidated checkpoint saved there before, as Lightning replaces it
                path.unlink()
        save(state, checkpoint_id=os.fspath(path), overwrite=True)
        stale = path / _METADATA_FILENAME  # Lightning's, from a save routed there before; the checkpoint's own meta wins
        if self.global_rank == 0 and stale.is_file():
            stale.unlink()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        if not FsStore(os.fspath(path)).is_committed():
            return super().load_checkpoint(checkpoint_path, weights_only)  # Lightning's own (a file, or DCP's + meta.pt)
        module = self.model
        state: dict[str, Any] = {"state_dict": get_model_state_dict(module)}
        state.update({f"optimizer_{i}": get_optimizer_state_dict(module, o) for i, o in enumerate(self.optimizers)})
        load(state, checkpoint_id=os.fspath(path))
        module.load_state_dict(state["state_dict"], strict=self.lightning_module.strict_loading)
        for i, optimizer in enumerate(self.optimizers):
            set_optimizer_state_dict(module, optimizer, optim_state_dict=state[f"optimizer_{i}"],
                                     options=StateDictOptions(cpu_offload=True))
        return _read_meta(path, weights_only)


def _announce(path: Any) -> None:
    text = os.fspath(path)
    where = text.rstrip("/").rpartition("/")[0] if "://" in text else os.path.dirname(os.path.abspath(text))
    announce("Lightning", f"{where} (each .ckpt a checkpoint directory; the first {os.path.basename(os.fspath(path))})",
             say=rank_zero_info)


def _split_plain(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Lightning's metadata entries that distckpt stores as they are, and the others."""
    plain, other = {}, {}
    for key, value in checkpoint.items():
        (plain if isinstance(key, str) and _storable(value) else other)[key] = value
    return plain, other


def _storable(value: Any) -> bool:
    """Whether distckpt stores ``value`` without pickle: tensors, dicts (always walked, so keyed by str or int), lists
    holding tensors (walked), and every other leaf plain data (``to_data`` takes it)."""
    if type(value) is torch.Tensor:
        return True
    if type(value) is dict:
        return all(type(k) in (str, int) for k in value) and all(_storable(v) for v in value.values())
    if type(value) in (list, tuple) and _holds_tensor(value):
        return all(_storable(v) for v in value)
    try:
        to_data(value)
    except UnsafeValueError:
        return False
    return True


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    return isinstance(value, (list, tuple)) and any(_holds_tensor(v) for v in value)


def _read_meta(path: Path, weights_only: Optional[bool]) -> dict[str, Any]:
    """Lightning's metadata from the checkpoint at ``path``, as its meta.pt gave it; read by each rank alone."""
    meta = dict(read_whole(os.fspath(path), under=META_KEY))
    kept = read_whole(os.fspath(path), under=META_TORCH_SAVE_KEY)
    if isinstance(kept, io.BytesIO):
        meta.update(torch.load(kept, weights_only=weights_only))
    if not meta and (path / _METADATA_FILENAME).is_file():  # saved with route_dcp_calls(): Lightning's meta.pt beside
        return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)
    return meta
