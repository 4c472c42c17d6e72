"""The one exception family of distckpt.

Every error raised on purpose by distckpt derives from :class:`CheckpointError`,
an ordinary ``Exception``. Where a built-in exception type fits, the subclass
derives from it as well, so ``except FileNotFoundError`` keeps working.
Messages name the checkpoint, the file, the key, and what to do about it.
"""

from __future__ import annotations

import traceback
from typing import Mapping, NamedTuple

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "MissingKeyError",
    "UnexpectedKeyError",
    "ShapeMismatchError",
    "DTypeMismatchError",
    "UnsafeValueError",
    "UnsupportedTensorError",
    "CorruptCheckpointError",
    "FormatVersionError",
    "RankFailuresError",
    "WrappedException",
    "RemoteRankError",
    "StorageIOError",
    "InvalidStepError",
    "NotRegularFileError",
    "StagingMemoryError",
    "UnsafeLocationError",
    "RelayoutError",
    "StateDictLookupError",
    "CheckpointIndexError",
    "CheckpointClosedError",
    "MissingDependencyError",
    "ProcessGroupBrokenError",
    "StalledRanksError",
]


class CheckpointError(Exception):
    """Base class of every error distckpt raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint, or a file it needs, does not exist (or is not committed)."""


class MissingKeyError(CheckpointError, KeyError):
    """A key requested by the caller's state dict is not in the checkpoint."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class UnexpectedKeyError(CheckpointError, KeyError):
    """The checkpoint holds keys the caller's state dict lacks, where every key is meant to be loaded."""

    def __str__(self) -> str:
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


class StateDictLookupError(CheckpointError, ValueError):
    """A MetadataIndex names nothing in the state dict: no such key, or no local shard at its offsets."""


class RelayoutError(CheckpointError, ValueError):
    """A re-layout mapping is malformed, or does not fit the keys and shapes it is applied to."""


class WrappedException(NamedTuple):
    """What one rank raised in a collective phase: the exception and where it was raised.

    A tuple, as DCP's ``CheckpointException.failures`` values are, so
    ``failures[rank][0]`` is the exception there too.
    """

    exception: BaseException
    traceback: traceback.StackSummary


class RankFailuresError(CheckpointError):
    """One or more ranks failed during a collective checkpoint phase.

    ``failures`` maps each failing rank to a :class:`WrappedException`: the
    exception that rank raised, rebuilt on every rank with its type (built-in
    exceptions and this family; any other type arrives as
    :class:`RemoteRankError`), and its stack. Every rank of the group raises
    this same error, so no rank is left waiting. When every failing rank
    raised the same error of this family, the error raised is also an
    instance of that class: ``except ShapeMismatchError`` works at any world
    size. DCP's name for this class, ``CheckpointException``, is an alias.
    """

    def __init__(self, phase: str, failures: Mapping[int, "WrappedException | BaseException"], single: bool = False):
        self.phase = phase
        self.single = single
        self.failures: dict[int, WrappedException] = {
            rank: f if isinstance(f, WrappedException) else WrappedException(f, traceback.extract_tb(f.__traceback__))
            for rank, f in sorted(failures.items())}
        if single:  # one process, no other rank: the error's own words, once
            (exc, _), = self.failures.values()
            own = isinstance(exc, CheckpointError) and not isinstance(exc, (RankFailuresError, RemoteRankError))
            super().__init__(str(exc) if own else f"checkpoint {phase} failed: {describe_type(exc)}: {exc}")
            return
        lines = [f"checkpoint {phase} failed on {len(self.failures)} rank(s): {sorted(self.failures)}"]
        for rank, (exc, _) in self.failures.items():
            lines.append(f"  rank {rank}: {describe_type(exc)}: {exc}")
        super().__init__("\n".join(lines))

    def __reduce__(self):  # the joint classes are not importable by name: rebuild through of()
        return RankFailuresError.of, (self.phase, self.failures, self.single)

    @classmethod
    def of(cls, phase: str, failures: Mapping[int, "WrappedException | BaseException"], single: bool = False) -> "RankFailuresError":
        """The error for ``failures``: of a class that is also the failing ranks' common class, if they share one
        of this family (so a caller's ``except MissingKeyError`` still catches a load that failed on every rank).
        ``single``: the failure of the one process of a job without a group, told in its own words."""
        kinds = {type(f[0] if isinstance(f, WrappedException) else f) for f in failures.values()}
        kind = kinds.pop() if len(kinds) == 1 else None
        if (kind is None or not issubclass(kind, CheckpointError) or issubclass(kind, (RankFailuresError, RemoteRankError))
                or (kind is CheckpointError and not single)):
            return cls(phase, failures, single)
        error = _joint_class(kind, single)(phase, failures, single)
        if single:
            original = next(iter(failures.values()))
            original = original[0] if isinstance(original, WrappedException) else original
            error.__dict__.update({k: v for k, v in vars(original).items() if k not in error.__dict__})
            if isinstance(original, OSError):
                error.errno, error.strerror, error.filename = original.errno, original.strerror, original.filename
        return error


_joint_classes: dict[type, type] = {}


def _joint_class(kind: type, single: bool = False) -> type:
    """RankFailuresError and ``kind`` in one class (one per ``kind``, so its identity is stable).

    Named as the base, so logs and ``type(e).__name__`` checks read the same at any world size; for the
    failure of a single process (``single``), named as ``kind``: there the error is that process's own, and a
    traceback shows it as it was raised (``MissingKeyError: ...``), while ``except CheckpointException`` still
    catches it as DCP's code expects."""
    joint = _joint_classes.get((kind, single))
    if joint is None:
        name, module = (kind.__name__, kind.__module__) if single else ("RankFailuresError", __name__)
        joint = type(name, (RankFailuresError, kind), {
            "__init__": RankFailuresError.__init__, "__str__": lambda self: str(self.args[0]) if self.args else "",
            "__module__": module, "__qualname__": name})
        _joint_classes[(kind, single)] = joint
    return joint


def describe_type(exc: BaseException) -> str:
    """The type name to show for ``exc`` (a remote one's own, for RemoteRankError)."""
    return exc.type_name if isinstance(exc, RemoteRankError) else type(exc).__name__


class RemoteRankError(CheckpointError):
    """Another rank raised an exception of a type this rank does not rebuild (not built in, not of this family).

    ``type_name`` is its qualified type name; the message is its text.
    """

    def __init__(self, type_name: str, message: str):
        super().__init__(message)
        self.type_name = type_name


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


class UnsafeLocationError(CheckpointError, PermissionError):
    """A directory distckpt would keep its own files in could be changed by another user: owned by someone else,
    writable by others, or reached through a link someone else owns (a planted link in ``/dev/shm``)."""


class CheckpointIndexError(CheckpointError, IndexError):
    """An index of a tensor opened with :func:`distckpt.open` that is out of range, or of a kind it does not read."""


class CheckpointClosedError(CheckpointError, ValueError):
    """A checkpoint opened with :func:`distckpt.open` was used after ``close()`` (or after its ``with`` block)."""


class MissingDependencyError(CheckpointError, ImportError):
    """A feature needs a package that is not installed; the message names the extra that installs it
    (``pip install 'distckpt[s3]'``). An ImportError too, so an integration module's import raises it."""

    package: str | None = None  #: the missing package's import name
    extra: str | None = None  #: the extra that installs it

    def __init__(self, message: str, *, package: str | None = None, extra: str | None = None):
        super().__init__(message)
        if package is not None:  # set only when given, so an error rebuilt for every rank keeps the original's
            self.package = package
        if extra is not None:
            self.extra = extra

    @classmethod
    def naming(cls, feature: str, package: str, extra: str) -> "MissingDependencyError":
        return cls(f"{feature}: needs {package}, which is not installed: pip install 'distckpt[{extra}]'",
                   package=package, extra=extra)



class ProcessGroupBrokenError(CheckpointError):
    """The process group can no longer carry collectives: one of them failed in the transport (a rank died, or one
    stopped past the group's timeout and torch's backend tore the group down). Every later checkpoint call on that
    group raises this at once; the group must be rebuilt (``destroy_process_group`` and ``init_process_group``
    again; under torchrun, a restart of the job)."""


class StalledRanksError(CheckpointError, TimeoutError):
    """A phase of a save or load waited the checkpoint timeout (``DISTCKPT_TIMEOUT_S``, or
    ``DISTCKPT_ARRIVAL_TIMEOUT_S`` for the arrival) for other ranks. ``phase`` names the phase, ``ranks`` the ranks
    that did not report having reached it (empty where the group's store could not tell), ``timeout_s`` the bound."""

    def __init__(self, message: str, phase: str = "", ranks: tuple = (), timeout_s: float = 0.0):
        super().__init__(message)
        self.phase, self.ranks, self.timeout_s = phase, tuple(ranks), timeout_s
