"""The small store interface every backend implements: named blobs with positional I/O.

The checkpoint logic (data-file layout, checksums, commit) is written once,
in :mod:`distckpt.backends.blob_storage`, over this interface. A backend only
says how to create, read, commit and list blobs.
"""

from __future__ import annotations

import abc
import threading
from typing import Callable, Iterable, Optional, Union

from .. import faults, knobs
from ..errors import CheckpointError
from ..format import METADATA_FILE


class BlobWriter(abc.ABC):
    """A blob being written: positional writes from any thread, then ``close``."""

    @abc.abstractmethod
    def pwrite(self, data: memoryview, offset: int) -> None: ...

    def pwritev(self, buffers: list, offset: int) -> None:
        """Write ``buffers`` back to back from ``offset``."""
        for b in buffers:
            self.pwrite(b, offset)
            offset += len(b)

    @abc.abstractmethod
    def close(self, sync: bool) -> None:
        """Finish the blob; with ``sync``, make its bytes durable before returning."""

    def abort(self) -> None:
        """Give up on the blob after a failed write (it belongs to a save that will not commit)."""
        self.close(False)


class BlobReader(abc.ABC):
    """A blob being read: its size and positional reads from any thread.

    ``small_reads_are_cheap`` is a capability flag: a read of a few MiB costs
    about what its bytes cost (a system call, a memory copy), not a request
    round trip. Readers with it get reads in cache-sized windows, so that
    checksums run on bytes still in the CPU cache.
    """

    size: int
    small_reads_are_cheap: bool = False

    @abc.abstractmethod
    def readinto(self, buf: memoryview, offset: int) -> int:
        """Fill ``buf`` from ``offset``; return the bytes read (less only at end of blob)."""

    def readv(self, views: list, offset: int) -> int:
        """Fill ``views`` back to back from ``offset``; return the bytes read."""
        total = 0
        for v in views:
            got = self.readinto(v, offset + total)
            total += got
            if got < len(v):
                break
        return total

    def readv_cached(self, views: list, offset: int) -> Optional[int]:
        """Like readv, but only what can be read without waiting for a device (what is in the page
        cache): the bytes read, fewer than asked (0 included) where the rest would have to wait.
        None where the reader cannot tell; then readv is the way to read."""
        return None

    def identity(self) -> Optional[tuple]:
        """What tells this version of the blob from another of the same name and size (a file's device, inode and
        change times; an object's ETag), to bind what was planned on it to what is read; None where unknown."""
        return None

    def pread(self, n: int, offset: int) -> bytes:
        buf = bytearray(n)
        got = self.readinto(memoryview(buf), offset)
        return bytes(buf[:got])

    def close(self) -> None:
        pass


class BufferedWriter(BlobWriter):
    """A blob written into memory and handed over whole when closed: ``publish(data, sync)`` makes it visible.

    The writer for a store that keeps small blobs whole (a dict, a key-value service): it holds the
    blob's bytes until ``close``, so it suits tests and small checkpoints, not ones larger than memory.
    """

    def __init__(self, publish: Callable[[bytes, bool], None], name: str = ""):
        self._publish = publish
        self._name = name  # for fault injection (distckpt.faults), as every store's writes mark
        self._buf = bytearray()
        self._lock = threading.Lock()

    def pwrite(self, data: memoryview, offset: int) -> None:
        faults.point("write", self._name)
        data = memoryview(data).cast("B")
        with self._lock:
            end = offset + len(data)
            if len(self._buf) < end:
                self._buf.extend(bytes(end - len(self._buf)))
            self._buf[offset:end] = data

    def close(self, sync: bool) -> None:
        if sync:
            faults.point("fsync", self._name)
        self._publish(bytes(self._buf), sync)

    def abort(self) -> None:
        self._buf = bytearray()  # never published


class BytesReader(BlobReader):
    """A blob read from bytes in memory (what a store that keeps blobs whole returns from ``open``)."""

    small_reads_are_cheap = True

    def __init__(self, data: bytes):
        self._data = data
        self.size = len(data)

    def readinto(self, buf: memoryview, offset: int) -> int:
        view = memoryview(buf).cast("B")
        part = memoryview(self._data)[offset: offset + len(view)]  # a view: slicing bytes would copy them first
        view[: len(part)] = part
        return len(part)


RUNS = "runs"
"""A store that can be the parent of a run of checkpoints: ``child``, ``children``, ``remove``,
``remove_incomplete_below`` (what CheckpointManager needs)."""

LEASES = "leases"
"""A store that keeps leases of saves in flight: ``put_lease``, ``renew_lease``, ``read_lease``, ``drop_lease``,
``lease_ids``."""

MAPS = "maps"
"""A store whose blobs lie in memory that can be mapped, read-only, in place: ``map(name, size)`` (a tmpfs: a
reader that would copy each byte into fresh memory can view the blob's own pages instead)."""


REFERENCES = "references"
"""A store whose checkpoints may reference data files of their siblings (a run of incremental saves):
``referenced``, ``retire``, ``parent``, and ``remove_incomplete_below`` that keeps what it is told to keep."""

Keep = Optional[Union[dict, Callable[[], Optional[dict]]]]
"""What ``remove_incomplete_below`` is told to keep: (checkpoint, save id) -> data file names, or a function that
returns that map (None: keep everything), called once the retired checkpoints are listed."""


def keep_now(keep: Keep) -> Optional[dict]:
    """The map ``keep`` stands for, read now."""
    return keep() if callable(keep) else keep


PAGE_CACHE = "page-cache"
"""A store whose reads go through the node's page cache (a file system): the ranks of one node that read the
same bytes fetch them from storage once between them (shared reads leave them to it)."""


class BlobStore(abc.ABC):
    """One checkpoint's directory (or prefix) of blobs.

    A store must implement seven methods: ``create`` and ``open`` (a blob written and read; a store that
    keeps blobs whole returns :class:`BufferedWriter` and :class:`BytesReader`), ``list``, and the commit
    protocol: ``staging``, ``commit``, ``discard`` and ``incomplete_saves``. Everything else has a default
    built on those: ``prepare`` does nothing, ``exists`` looks in ``list``, ``put_atomic`` writes through
    ``create`` (whose blob is visible only once closed), ``describe`` names the blob by the store's class.
    A store registers its factory by scheme (:func:`distckpt.backends.register_store`); save and load then
    reach it by ``checkpoint_id="scheme://..."``.

    ``capabilities`` declares which optional parts of the interface the store
    implements (:data:`RUNS`, :data:`LEASES`, :data:`MAPS`); the shipped contract suite
    (:mod:`distckpt.testing.blob_store_suite`) tests those and skips the rest.
    """

    capabilities: frozenset = frozenset()

    def write_streams(self) -> int:
        """Data files one rank writes at once, each from a thread of its own (a writer's ``thread_count`` overrides
        it): the CPU's share (DISTCKPT_IO_THREADS) where writes cost CPU; a store whose writes wait on a network says
        more."""
        return knobs.io_threads()

    def prepare(self) -> None:
        """Create the checkpoint's location if needed (called on every rank)."""

    @abc.abstractmethod
    def create(self, name: str, buffer_bytes: Optional[int] = None) -> BlobWriter:
        """Start writing blob ``name``; it is visible only once the writer is closed.

        ``buffer_bytes`` is the writer's share of the memory budget: the most
        bytes of buffers it may hold (None: the store's default). A store
        whose writers need buffers sizes them to fit, as far as it can.
        """

    def write_buffer_bytes(self, buffer_bytes: Optional[int] = None) -> int:
        """The most bytes of buffers one writer from ``create(name, buffer_bytes)`` holds (0: none)."""
        return 0

    @abc.abstractmethod
    def open(self, name: str) -> BlobReader:
        """Open a blob for reading; raise CheckpointNotFoundError if it does not exist."""

    def put_atomic(self, name: str, data: bytes, sync: bool) -> None:
        """Write a small blob so that readers see either nothing or all of it."""
        writer = self.create(name)
        try:
            writer.pwrite(memoryview(data), 0)
        except BaseException:
            writer.abort()
            raise
        writer.close(sync)

    def exists(self, name: str) -> bool:
        names = self.list()
        if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
            raise CheckpointError(f"{self.describe()}: {type(self).__name__}.list() returned {type(names).__name__}, not an "
                                  "iterable of names; fix the store")
        return name in set(names)

    @abc.abstractmethod
    def list(self) -> Iterable[str]: ...

    def describe(self, name: str = "") -> str:
        """A human-readable location, for error messages."""
        return f"{type(self).__name__} blob {name!r}" if name else type(self).__name__

    # ---- commit protocol: a save writes into a staging store, then commits it

    def is_committed(self) -> bool:
        return self.exists(METADATA_FILE)

    def data_store(self, save_id: str) -> "BlobStore":
        """Where the data files of committed save ``save_id`` are (stores that keep them apart override)."""
        return self

    @abc.abstractmethod
    def staging(self, save_id: str) -> "BlobStore":
        """The store one save writes into before it commits; invisible to readers."""

    @abc.abstractmethod
    def commit(self, staging: "BlobStore", overwrite: bool, sync: bool) -> None:
        """Make ``staging`` this store's content in one atomic step.

        Without ``overwrite``, fail with CheckpointError if a checkpoint is
        already here (exactly one of two concurrent commits wins). With it,
        the old content stays intact until the new one is visible.
        """

    @abc.abstractmethod
    def discard(self, staging: "BlobStore") -> None:
        """Remove an uncommitted staging store (best effort)."""

    @abc.abstractmethod
    def incomplete_saves(self) -> list[str]:
        """Descriptions of uncommitted staging stores of this location."""

    # ---- a run of checkpoints: this location as the parent of several (CheckpointManager)

    def child(self, name: str) -> "BlobStore":
        """The store of checkpoint ``name`` directly under this location."""
        raise CheckpointError(f"{type(self).__name__} cannot hold a run of checkpoints (no child())")

    def children(self) -> list[str]:
        """Names directly under this location that may be checkpoints (committed or not)."""
        raise CheckpointError(f"{type(self).__name__} cannot list a run of checkpoints (no children())")

    def remove(self) -> None:
        """Delete this committed checkpoint: invisible to readers at once, then its contents."""
        raise CheckpointError(f"{type(self).__name__} cannot delete checkpoints (no remove())")

    def remove_incomplete_below(self, prefix: str = "", keep: Keep = None) -> list[str]:
        """Remove what uncommitted saves left of the checkpoints directly under this location whose
        names start with ``prefix``, where those saves are proven dead (see :mod:`.leases`); describe
        what was removed. A save still running, here or on another host, is never touched.

        ``keep`` (stores with :data:`REFERENCES`) maps (checkpoint, save id) to the names of its data files
        that committed checkpoints reference: those stay, and what retired checkpoints (:meth:`retire`) hold
        beyond them goes. Without it, retired checkpoints are left alone. ``keep`` may be a function returning that
        map (or None): it is called after the retired checkpoints are listed, so that one retired after its mark
        phase read the run is not pruned by what that read did not see."""
        raise CheckpointError(f"{type(self).__name__} cannot clean up a run of checkpoints")

    # ---- references between the checkpoints of a run (REFERENCES)

    def referenced(self, checkpoint: str, save_id: str) -> "BlobStore":
        """Where the data files of save ``save_id`` of ``checkpoint``, a sibling of this checkpoint under the same
        parent, are read from: committed there, or kept by :meth:`retire` after it was deleted."""
        raise CheckpointError(f"{type(self).__name__} cannot read data files of other checkpoints (no referenced()); "
                              "this checkpoint references some: load it from the storage it was saved to")

    def retire(self, save_id: str, keep: set) -> None:
        """Delete this committed checkpoint (save ``save_id``) but keep its data files named in ``keep``, which
        other checkpoints reference, where :meth:`referenced` finds them. It disappears whole first."""
        raise CheckpointError(f"{type(self).__name__} cannot keep files of a deleted checkpoint (no retire())")

    def parent(self) -> Optional["BlobStore"]:
        """The store of the location this checkpoint is directly under (the root of its run), or None where it has
        none (a checkpoint at the top of a bucket)."""
        return None

    # ---- leases: which saves in flight are alive (see leases.py); kept beside the staging stores.
    # A store that keeps none (these defaults) has its leftovers removed only by their age, and
    # only where it can tell that age: never, with these defaults.

    def put_lease(self, save_id: str, record: bytes) -> None:
        """Record the lease of save ``save_id`` (a new one: fail if it exists)."""

    def renew_lease(self, save_id: str) -> None:
        """Mark the lease of ``save_id`` as renewed now."""

    def read_lease(self, save_id: str) -> Optional[tuple[bytes, Optional[float]]]:
        """The lease record of ``save_id`` and the seconds since its last renewal (None if unknown), or None."""
        return None

    def drop_lease(self, save_id: str) -> None:
        """Remove the lease of ``save_id`` (no error if it is gone)."""

    def lease_ids(self) -> list[str]:
        """The save ids this location holds leases of (sorted)."""
        if LEASES in self.capabilities:
            raise CheckpointError(f"{type(self).__name__} declares LEASES but cannot list them (no lease_ids())")
        return []

    def sizes(self) -> dict[str, int]:
        """The blobs of this store and their sizes: what a commit checks its data files against."""
        out = {}
        for name in self.list():
            blob = self.open(name)
            try:
                out[name] = blob.size
            finally:
                blob.close()
        return out

    def check_replaceable(self) -> None:
        """Raise CheckpointError unless an overwriting save may replace what is at this location:
        nothing, or a committed checkpoint (stores that can hold other things override)."""

