"""The one exception family of distckpt.

Every error raised on purpose by distckpt derives from :class:`CheckpointError`,
an ordinary ``Exception``. Where a built-in exception type fits, the subclass
derives from it as well, so ``except FileNotFoundError`` keeps working.
Messages name the checkpoint, the file, the key, and what to do about it.
"""

from __future__ import annotations

from typing import Mapping, Optional

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "MissingKeyError",
    "ShapeMismatchError",
    "DTypeMismatchError",
    "UnsafeValueError",
    "UnsupportedTensorError",
    "CorruptCheckpointError",
    "FormatVersionError",
    "RankFailuresError",
    "StorageIOError",
    "InvalidStepError",
    "NotRegularFileError",
    "StagingMemoryError",
]


class CheckpointError(Exception):
    """Base class of every error distckpt raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint, or a file it needs, does not exist (or is not committed)."""


class MissingKeyError(CheckpointError, KeyError):
    """A key requested by the caller's state dict is not in the checkpoint."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class ShapeMismatchError(CheckpointError, ValueError):
    """A destination tensor's shape does not match the stored tensor."""


class DTypeMismatchError(CheckpointError, TypeError):
    """A destination tensor's dtype differs from the stored dtype and conversion was not allowed."""


class UnsafeValueError(CheckpointError, TypeError):
    """A non-tensor value cannot be stored without pickle, and pickling was not allowed."""


class UnsupportedTensorError(CheckpointError, TypeError):
    """A tensor in the state dict cannot be stored: its dtype, layout or device has no stored form."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """Stored bytes fail validation: bad checksum, truncated file, malformed header or metadata."""


class FormatVersionError(CheckpointError, ValueError):
    """The checkpoint was written in a format version this reader does not support."""


class RankFailuresError(CheckpointError):
    """One or more ranks failed during a collective checkpoint phase.

    ``failures`` maps each failing rank to the text of its error. Every rank of
    the group raises this same error, so no rank is left waiting.
    """

    def __init__(self, phase: str, failures: Mapping[int, str], *, cause_types: Optional[Mapping[int, str]] = None):
        self.phase = phase
        self.failures = dict(sorted(failures.items()))
        self.cause_types = dict(cause_types or {})
        lines = [f"checkpoint {phase} failed on {len(self.failures)} rank(s): {sorted(self.failures)}"]
        for rank, text in self.failures.items():
            kind = self.cause_types.get(rank)
            prefix = f"{kind}: " if kind else ""
            lines.append(f"  rank {rank}: {prefix}{text}")
        super().__init__("\n".join(lines))


class StorageIOError(CheckpointError, OSError):
    """Reading or writing the storage failed (disk full, I/O error, permission denied)."""

    def __init__(self, message: str, errno_value: int | None = None):
        CheckpointError.__init__(self, message)
        self.errno = errno_value

    def __str__(self) -> str:
        return str(self.args[0])


class InvalidStepError(CheckpointError, ValueError):
    """A CheckpointManager step that is not an integer from 0 to 10**19 - 1."""


class NotRegularFileError(CorruptCheckpointError):
    """A file of a checkpoint is a symbolic link, FIFO, socket or device node; distckpt reads only regular files."""


class StagingMemoryError(CheckpointError, MemoryError):
    """async_save could not allocate the host memory to copy the state into."""
