"""torchtitan's CheckpointManager, saving and loading through distckpt.

torchtitan 0.3 swaps a component by naming an override on its command line; this module registers one,
:func:`use_distckpt`, so a run of torchtitan's own launcher selects distckpt with one flag::

    torchrun --nproc_per_node=8 -m torchtitan.train --module llama3 --config llama3_8b \
        --override.imports distckpt.integrations.torchtitan.use_distckpt --checkpoint.enable

(the trainer's ``checkpoint`` config becomes this module's ``CheckpointManager.Config`` with every field
kept, so ``--checkpoint.*`` flags apply as before). A ``config_registry`` function of your own may set
``checkpoint=CheckpointManager.Config(...)`` instead (the same fields as torchtitan's); either way
``config.checkpoint.build(...)`` builds this manager. With torchtitan 0.2, build :class:`CheckpointManager`
where the trainer builds its own, with the same arguments. What changes:

- saves and loads go through distckpt (sync, ``async`` and ``async_with_pinned_mem`` alike; the async
  modes get distckpt's handle, which is the Future and the ``AsyncSaveResponse`` torchtitan expects);
  a step saved again (a rollback re-running a step) replaces its checkpoint atomically;
- the newest step to resume from is the newest *committed* one: a folder ``step-<N>`` with distckpt's
  ``metadata.json`` (or DCP's ``.metadata``: older steps written by DCP load directly);
- exports to Hugging Face safetensors (``to_hf`` / ``from_hf``) stay torchtitan's own;
- the manager logs, when it is built, one line saying that distckpt saves the checkpoints, in which folder
  and in which format (torchtitan's own log names only its configuration classes).

Folder names are torchtitan's (``step-<N>``); a save in progress lives in a hidden directory no step
pattern matches, so ``keep_latest_k`` never counts or deletes it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse  # the type torchtitan checks for

from ..extras import import_or_explain

import_or_explain("torchtitan", "distckpt.integrations.torchtitan", "torchtitan")  # before its imports: a typed error

from torchtitan.components.checkpoint import MODEL, AsyncMode
from torchtitan.components.checkpoint import CheckpointManager as _TitanCheckpointManager

from ..async_saving import async_save
from ..backends.filesystem import FsStore
from ..layouts.dcp import is_dcp_directory
from ..loading import load
from ..saving import save
from .announce import DISTCKPT_FORMAT, announce

__all__ = ["CheckpointManager", "use_distckpt"]

_STEP = re.compile(r"step-(\d+)\Z")


class _OwnStaging:
    """Stands where torchtitan keeps DCP's DefaultStager: distckpt stages into its own reused (pinned, where
    there is a GPU) host buffers, so none is built (DCP's needs an accelerator even to exist)."""

    def close(self) -> None:
        pass


class CheckpointManager(_TitanCheckpointManager):
    """torchtitan's checkpoint manager on distckpt (see the module text)."""

    if hasattr(_TitanCheckpointManager, "Config"):  # torchtitan >= 0.3: a config builds the class that declares it

        @dataclass(kw_only=True, slots=True)
        class Config(_TitanCheckpointManager.Config):
            """torchtitan's checkpoint configuration; ``build(...)`` makes distckpt's manager."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if getattr(self, "async_mode", None) == AsyncMode.ASYNC_WITH_PINNED_MEM:
            self.stager = _OwnStaging()
        if getattr(self, "folder", None) is None:  # checkpointing off: torchtitan set nothing, and nothing is saved
            return
        also = "; the last step's Hugging Face export stays torchtitan's" if getattr(self, "last_save_in_hf", False) else ""
        mode = getattr(self, "async_mode", AsyncMode.DISABLED)
        how = "synchronous saves" if mode == AsyncMode.DISABLED else f"async_mode {AsyncMode(mode).value}"
        announce("torchtitan", f"{self.folder} (step-<N>, {how})", DISTCKPT_FORMAT + also)

    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        if async_mode in (AsyncMode.ASYNC, AsyncMode.ASYNC_WITH_PINNED_MEM):
            handle = async_save(state_dict, checkpoint_id=checkpoint_id, process_group=getattr(self, "pg", None),
                                overwrite=True)
            if async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
                return AsyncSaveResponse(staging_completion=handle.staged, upload_completion=handle)
            return handle
        save(state_dict, checkpoint_id=checkpoint_id, overwrite=True)
        return None

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if from_hf:
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        load(state_dict, checkpoint_id=checkpoint_id)
        if MODEL in self.states:  # torchtitan flattens the model's states into the dict: set them back, as it does
            self.states[MODEL].load_state_dict(state_dict)
        return None

    def _find_load_step(self, folder: str = "") -> int:
        """The newest step with a committed checkpoint in ``folder`` (distckpt's, or one DCP wrote); -1 if none."""
        folder = folder if folder else self.folder
        if not os.path.isdir(folder):
            return -1
        steps = []
        for name in os.listdir(folder):
            m = _STEP.match(name)
            path = os.path.join(folder, name)
            if m and not os.path.islink(path) and (FsStore(path).is_committed() or is_dcp_directory(path)):
                steps.append(int(m.group(1)))
        return max(steps, default=-1)


try:  # torchtitan >= 0.3: components are swapped by overrides named in --override.imports
    from torchtitan.config import derive, override
except ImportError:  # torchtitan 0.2: no override registry; build CheckpointManager where the trainer does
    use_distckpt = None
else:

    @override(target=_TitanCheckpointManager.Config, description="checkpoints saved and loaded through distckpt")
    def use_distckpt(config: Any) -> Any:
        """The override ``--override.imports distckpt.integrations.torchtitan.use_distckpt`` names: torchtitan's
        checkpoint config becomes distckpt's, every field (and so every ``--checkpoint.*`` flag) kept."""
        return derive(config, CheckpointManager.Config)
