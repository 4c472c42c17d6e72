"""Validation of file names recorded in a checkpoint."""

from __future__ import annotations

import re

from ..errors import CorruptCheckpointError

_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}\Z")
SAVE_ID = re.compile(r"[0-9A-Za-z_-]{1,64}\Z")  # a save id: a plain name, used as a key prefix on object stores


def check_file_name(name: object, where: str) -> str:
    """A data-file name must be a plain name inside the checkpoint: no separators, no '..', not absolute."""
    if not isinstance(name, str) or not _SAFE.match(name) or ".." in name:
        raise CorruptCheckpointError(
            f"{where}: data file name {name!r:.80} is not a plain file name inside the checkpoint; "
            "the metadata is damaged or hostile"
        )
    return name
