"""The line each integration logs as distckpt takes over a framework's checkpoints: that distckpt saves them,
where, and in which format.

A framework's own log names only its own classes (torchtitan's override line reads "CheckpointManager.Config ->
CheckpointManager.Config"), so without this line a run's log cannot tell which library writes its checkpoints,
nor that the files on disk are not the framework's usual ones. Each integration calls :func:`announce` once,
where it first knows the place: torchtitan's manager when it is built, Lightning's plugins at their first save,
a routing of DCP's calls at its first call, torch_checkpointing's storage at its first file.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

__all__ = ["DISTCKPT_FORMAT", "announce"]

log = logging.getLogger("distckpt")

DISTCKPT_FORMAT = ("distckpt's format (a directory per checkpoint: metadata.json with a CRC-32C, and safetensors data "
                   "files; not DCP's .metadata and .distcp files)")


def announce(framework: str, where: str, form: str = DISTCKPT_FORMAT, say: Optional[Callable[[str], None]] = None) -> str:
    """Log that distckpt saves ``framework``'s checkpoints at ``where`` in ``form``, and return the line.

    ``say`` is the framework's own log where the ``distckpt`` logger's INFO would not reach it (Lightning's
    handler sits on its own logger, which does not propagate); by default the ``distckpt`` logger at INFO.
    """
    line = f"distckpt: {framework}'s checkpoints are saved by distckpt, at {where}, in {form}"
    (say or log.info)(line)
    return line
