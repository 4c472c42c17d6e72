"""Lightning's CheckpointIO on distckpt, for strategies whose checkpoints one process writes (DDP).

``Trainer(plugins=[DistckptCheckpointIO()])`` (or ``Fabric(plugins=...)``): each ``.ckpt`` that Lightning
writes becomes a distckpt checkpoint directory of that name, written by the process Lightning calls
(rank 0 under DDP) without collectives, replaced atomically when saved again (``save_last``), and read
back whole. Values that are not plain data (a hyperparameter object, say) need ``allow_pickle=True``,
for checkpoints you trust, as anywhere in distckpt.

Strategies that save sharded state from every rank (``ModelParallelStrategy``, FSDP) save through
torch.distributed.checkpoint themselves and ignore the CheckpointIO: route those calls with
:func:`distckpt.integrations.dcp_routing.route_dcp_calls` (tested with ``ModelParallelStrategy``).
"""

from __future__ import annotations

import os
from typing import Any, Optional

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from ..backends.filesystem import FsStore
from ..convert import read_whole
from ..errors import CheckpointError
from ..planning import DefaultSavePlanner
from ..saving import save

__all__ = ["DistckptCheckpointIO"]


class DistckptCheckpointIO(CheckpointIO):
    """Lightning's checkpoint I/O through distckpt (see the module text)."""

    def __init__(self, allow_pickle: bool = False) -> None:
        self.allow_pickle = allow_pickle

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise CheckpointError(f"DistckptCheckpointIO takes no storage_options (got {storage_options!r})")
        save(checkpoint, checkpoint_id=os.fspath(path), planner=DefaultSavePlanner(allow_pickle=self.allow_pickle),
             no_dist=True, overwrite=True)

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None) -> dict[str, Any]:
        # map_location: tensors come back on the CPU, and Lightning moves them where the module lives
        return read_whole(os.fspath(path), allow_pickle=self.allow_pickle)

    def remove_checkpoint(self, path: Any) -> None:
        store = FsStore(os.fspath(path))
        if store.is_committed():  # only a checkpoint of distckpt's: never another file Lightning names
            store.remove()
