"""CheckpointManager: numbered checkpoints of a training run, with retention and resume."""

from __future__ import annotations

import json
import logging
import numbers
import os
import re
import secrets
from typing import Any, Optional, Union

from . import backends, events
from .async_saving import async_save
from .backends.blob_storage import BlobStorageReader, BlobStorageWriter
from .backends.run_guard import Deleting, deleting, drop_dead
from .compaction import CompactReport, compact
from .distributed import JSON as _JSON
from .distributed import Coordinator
from .engine.blobs import REFERENCES, RUNS, BlobStore
from .engine.reuse import Reuse
from .errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, InvalidStepError
from .format import METADATA_FILE
from .format.json_text import parse_json
from .loading import load
from .metadata import STATE_DICT_TYPE, Metadata
from .prefetching import Prefetch
from .run_references import RunFiles
from .saving import save

__all__ = ["CheckpointManager"]

_STEP = re.compile(r"step-(\d{10,19})\Z")
RUN_ID_FILE = "run-id.json"
_RUN_ID = re.compile(r"[0-9a-f]{32}\Z")
_PLAIN_STEP = re.compile(r"step-(0|[1-9]\d{0,18})\Z")
STEP_NAMES = ("padded", "plain")
MAX_STEP = 10**19 - 1
_MARK_TRIES = 8  # reads of the run's tables before a sweep gives up (prunes nothing) on a run that keeps changing
log = logging.getLogger("distckpt")


class CheckpointManager:
    """Checkpoints of one training run under ``root``, one checkpoint per step.

    Args:
        root: where the run's ``step-<N>`` checkpoints live: a directory, or
            any location a backend can hold a run in (``s3://bucket/run``,
            ``memory://run``).
        keep_last: keep the newest N committed checkpoints (None: all).
        keep_every: also keep every checkpoint whose step is a multiple of K.
        process_group, coordinator_rank: as for :func:`distckpt.save`.
        cleanup: remove what crashed saves left behind when the manager starts
            (only saves proven dead; see below).
        read_only: open the run to list and load only: nothing is created,
            cleaned or deleted, and ``save`` raises. For evaluation jobs and
            read-only media.
        no_dist: a run of this process alone: its saves and loads call no
            collective (as ``no_dist=True`` does for :func:`distckpt.save`), and
            this process cleans up and applies retention itself. For a rank's
            node-local copies (the memory tier keeps each rank's own run).
        step_names: how step folders are named: ``"padded"`` (``step-0000000042``, ten or more
            digits, distckpt's own), ``"plain"`` (``step-42``, torchtitan's and others'), or None
            (default): ``"plain"`` if the run already holds committed ``step-<N>`` folders of that
            spelling and none of the padded one, else ``"padded"``. Only folders spelled as this
            manager names them are its steps: the others are never counted or deleted.
        storage_options: arguments for the backend's writer and reader, each
            given those its constructor takes: for ``s3://``, ``client``,
            ``endpoint_url``, ``region_name``, ``part_size``...; for a
            directory, ``thread_count`` or ``sync_files``. The run's listing,
            cleanup and retention use them too.
        incremental: write only what changed: a chunk whose bytes equal (by a BLAKE3 hash) what this manager's previous
            committed save stored for it is not written again; the new step references the stored bytes
            (format 4.0). Every step still loads on its own, and retention keeps the files kept steps reference.
            The first save of a manager, and one after a failed save, writes everything.
        full_every: with ``incremental``, every K-th save writes every chunk (a step that references nothing).
        compression: ``"zstd"``: every chunk stored byte-grouped and zstd-compressed (docs/format.md);
            ``compression_level`` its level.

    Every rank constructs the manager and calls ``save``/``load`` together.
    Only committed checkpoints count: a save that crashed is invisible to
    ``all_steps``, never counts toward ``keep_last``, and its temporaries are
    removed by a later manager. The newest committed checkpoint is never
    deleted. Deletion renames a checkpoint to a hidden name first, so a
    reader never sees half of one.

    Several processes may share a root: a trainer saving, evaluation jobs
    listing and loading (best with ``read_only=True``), a restarted trainer,
    even two trainers saving different steps. A save holds a lease (its
    process and host, renewed while it runs) from before its first byte until
    it commits; cleanup removes a save's leftovers only when that process is
    gone (on this host) or its lease went unrenewed for
    ``DISTCKPT_LEASE_STALE_S`` (elsewhere). A commit checks that its data
    files are all there first. Retention by several managers at once deletes
    each step at most once, and never one newer than every other committed
    step. Two saves of the same step race: exactly one commits.
    Only directories named as :meth:`path` names them (see ``step_names``)
    are steps; links are never steps and never followed.
    """

    def __init__(self, root: Union[str, os.PathLike], *, keep_last: Optional[int] = None, keep_every: Optional[int] = None,
                 process_group: Any = None, coordinator_rank: int = 0, cleanup: bool = True, read_only: bool = False,
                 storage_options: Optional[dict[str, Any]] = None, step_names: Optional[str] = None,
                 no_dist: bool = False, incremental: bool = False, full_every: Optional[int] = None,
                 compression: Optional[str] = None, compression_level: Optional[int] = None):
        if keep_last is not None and keep_last < 1:
            raise CheckpointError(f"keep_last must be at least 1, got {keep_last}")
        if keep_every is not None and keep_every < 1:
            raise CheckpointError(f"keep_every must be at least 1, got {keep_every}")
        if full_every is not None and (not incremental or full_every < 1):
            raise CheckpointError(f"full_every={full_every!r} needs incremental=True and is at least 1")
        self.root = os.fspath(root)
        self._url = "://" in self.root and not self.root.startswith("file://")
        self.storage_options = dict(storage_options or {})
        if compression is not None or compression_level is not None:
            self.storage_options.update(compression=compression, compression_level=compression_level)
        backends.check_options(self.root, self.storage_options)
        self.incremental = incremental
        self.full_every = full_every
        self._previous: Optional[dict] = None  # this rank's fingerprints of its last committed save (engine/reuse.py)
        self._base: Optional[tuple] = None
        self._since_full = 0
        self._in_flight: Any = None  # this manager's last async save
        self._prefetch: Optional[tuple[int, Prefetch]] = None  # the step a prefetch reads, and the prefetch
        self._store = _root_store(self.root, self.storage_options)
        self._files = RunFiles(self._store)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.process_group = process_group
        self.coordinator_rank = coordinator_rank
        self.no_dist = no_dist
        self._coord = Coordinator(process_group, coordinator_rank, no_dist=no_dist)
        self.read_only = read_only
        if step_names is not None and step_names not in STEP_NAMES:
            raise CheckpointError(f"step_names must be one of {STEP_NAMES} or None, got {step_names!r}")
        self.step_names = step_names if step_names is not None else self._detect_step_names()
        if self._coord.is_coordinator and not read_only:
            self._store.prepare()
            if cleanup:
                try:
                    self.remove_stale_temporaries()
                except (OSError, CheckpointError) as exc:  # read-only media, another cleaner: loading must still work
                    log.warning("distckpt: could not clean up crashed saves under %s: %s", self.root, exc)

    def _detect_step_names(self) -> str:
        padded = plain = False
        for name in self._store.children():
            if _STEP.match(name):
                padded = padded or self._store.child(name).is_committed()
            elif _PLAIN_STEP.match(name):
                plain = plain or self._store.child(name).is_committed()
        return "plain" if plain and not padded else "padded"

    def _name(self, step: Any) -> str:
        return _step_name(step, self.step_names)

    def path(self, step: int) -> str:
        """The checkpoint id of ``step``."""
        name = self._name(step)
        return f"{self.root.rstrip('/')}/{name}" if self._url else os.path.join(self.root, name)

    def all_steps(self) -> list[int]:
        """Steps with a committed checkpoint, ascending."""
        steps = []
        pattern = _PLAIN_STEP if self.step_names == "plain" else _STEP
        for name in self._store.children():
            m = pattern.match(name)
            if m and name == self._name(int(m.group(1))) and self._store.child(name).is_committed():
                steps.append(int(m.group(1)))
        return sorted(steps)

    def run_id(self, create: bool = True) -> Optional[str]:
        """The identity of this run: a random id recorded at the run's root (``run-id.json``) the first time it is
        asked for with ``create`` (None where none is recorded and ``create`` is False). A root emptied and used
        again is a new run with a new id. Call it on one rank and share the answer: two processes creating the id at
        once both return the one that was written last, unless their write and read interleave."""
        found = self._read_run_id()
        if found is not None or not create:
            return found
        if self.read_only:
            raise CheckpointError(f"CheckpointManager({self.root!r}, read_only=True) records no run id; open it "
                                  "without read_only")
        self._store.prepare()
        self._store.put_atomic(RUN_ID_FILE, json.dumps({"run_id": secrets.token_hex(16)}).encode(), sync=True)
        found = self._read_run_id()
        if found is None:
            raise CheckpointError(f"the run id written under {self.root!r} cannot be read back; check the storage")
        return found

    def _read_run_id(self) -> Optional[str]:
        if not self._store.exists(RUN_ID_FILE):
            return None
        reader = self._store.open(RUN_ID_FILE)
        try:
            raw = reader.pread(min(reader.size, 4096), 0)
        finally:
            reader.close()
        try:
            found = parse_json(raw, self._store.describe(RUN_ID_FILE))["run_id"]
            if not isinstance(found, str) or not _RUN_ID.match(found):
                raise ValueError(found)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise CorruptCheckpointError(f"{self._store.describe(RUN_ID_FILE)} is not a run id distckpt wrote "
                                         '({"run_id": <32 hex digits>}); remove it to start a new run') from None
        return found

    def incomplete_saves(self, step: int) -> list[str]:
        """Uncommitted saves of ``step`` left at this run's location: what a save that died leaves until
        cleanup finds its saver dead (``remove_stale_temporaries``)."""
        return self._store.child(self._name(step)).incomplete_saves()

    def latest_step(self) -> Optional[int]:
        """The newest committed step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(self, step: int, state_dict: STATE_DICT_TYPE, **kwargs: Any) -> Metadata:
        """Save ``state_dict`` as checkpoint ``step`` on every rank, then apply retention.

        Once the checkpoint is committed the save succeeds: a failure of retention after it is logged, not raised.
        """
        path = self._writable_path(step)
        kwargs.setdefault("storage_writer", self._writer())
        if self.no_dist:
            kwargs.setdefault("no_dist", True)
        if self.incremental:
            self._wait_for_previous_async()  # its commit sets the base this save chooses from
        reuse = self._reuse(step, kwargs["storage_writer"])
        with events.context(step=step):
            try:
                md = save(state_dict, checkpoint_id=path, process_group=self.process_group,
                          coordinator_rank=self.coordinator_rank, **kwargs)
            except BaseException:
                self._previous = None  # whatever this save left, the next one writes every chunk
                raise
            self._committed(reuse)
            if self._coord.is_coordinator:
                self._retain_after_commit()
        return md

    def _reuse(self, step: int, writer: Any) -> Optional[Reuse]:
        """The incremental part of saving ``step`` through ``writer``: what the previous save stored, to reference."""
        if not self.incremental or not isinstance(writer, BlobStorageWriter) or REFERENCES not in self._store.capabilities:
            return None  # a store that cannot keep files for other steps' references: every save is full
        full = (self._previous is None or (self.full_every is not None and self._since_full + 1 >= self.full_every)
                or self._base is None or self._base[1] is None  # the base's commit could not be seen: unknown
                or self._metadata_identity(self._base[0]) != self._base[1])
        reuse = Reuse(self._name(step), {} if full else self._previous, base=None if full else self._base)
        writer.reuse = reuse
        self._previous = None  # until this save commits
        return reuse

    def _committed(self, reuse: Optional[Reuse]) -> None:
        if reuse is not None:
            self._since_full = 0 if not reuse.previous else self._since_full + 1
            self._previous = reuse.fingerprints
            # the step the fingerprints come from, as committed: compacted, deleted or replaced since, and the files they
            # name may be gone, so the next save writes every chunk
            self._base = (reuse.checkpoint, self._metadata_identity(reuse.checkpoint))

    def _metadata_identity(self, name: str) -> Any:
        try:
            blob = self._store.child(name).open(METADATA_FILE)
        except (OSError, CheckpointError):
            return None
        try:
            return blob.identity()  # None where the store cannot tell versions apart: the base is then unknown
        finally:
            blob.close()

    def _writable_path(self, step: int) -> str:
        if self.read_only:
            raise CheckpointError(f"CheckpointManager({self.root!r}, read_only=True) does not save; open it without read_only")
        return self.path(step)

    def _retain_after_commit(self) -> None:
        try:
            self.apply_retention()
        except (OSError, CheckpointError) as exc:
            log.warning("distckpt: retention under %s failed after a committed save (the save stands): %s", self.root, exc)

    def async_save(self, step: int, state_dict: STATE_DICT_TYPE, **kwargs: Any):
        """Like :meth:`save`, but returns after staging; retention runs after the commit."""
        is_coordinator = self._coord.is_coordinator
        kwargs.setdefault("storage_writer", self._writer())
        if self.no_dist:
            kwargs.setdefault("no_dist", True)
        if self.incremental:
            self._wait_for_previous_async()
        reuse = self._reuse(step, kwargs["storage_writer"])

        def on_commit(_md: Any) -> None:
            self._committed(reuse)
            if is_coordinator:
                self._retain_after_commit()

        try:
            with events.context(step=step):  # the background's retention, in this context, carries the step too
                handle = async_save(state_dict, checkpoint_id=self._writable_path(step), process_group=self.process_group,
                                    coordinator_rank=self.coordinator_rank, on_commit=on_commit, **kwargs)
        except BaseException:
            self._previous = None
            raise
        self._in_flight = handle
        return handle

    def _wait_for_previous_async(self) -> None:
        """An incremental save builds on the previous one: wait for it to commit (or fail: then this one is full)."""
        handle, self._in_flight = self._in_flight, None
        if handle is not None:
            try:
                handle.result()
            except BaseException:  # noqa: BLE001 - reported on that save's handle; here it only means a full save
                self._previous = None

    def load(self, state_dict: STATE_DICT_TYPE, step: Optional[int] = None, **kwargs: Any) -> int:
        """Load checkpoint ``step`` (default: the newest committed) into ``state_dict``; return the step. What a
        :meth:`prefetch` of that step read is copied from memory, and its memory given back after."""
        ahead, self._prefetch = self._prefetch, None  # used by this load or by none: its memory goes back after it
        reader = None
        try:
            step = self._committed_step(step)
            reader = kwargs.setdefault("storage_reader", backends.reader_for(self.root, **self.storage_options))
            if self.no_dist:
                kwargs.setdefault("no_dist", True)
            if ahead is not None and ahead[0] == step and isinstance(reader, BlobStorageReader):
                ahead[1].attach(reader)
            with events.context(step=step):
                load(state_dict, checkpoint_id=self.path(step), process_group=self.process_group,
                     coordinator_rank=self.coordinator_rank, **kwargs)
        finally:
            if ahead is not None:
                ahead[1].release(wait=False)
                if isinstance(reader, BlobStorageReader):
                    reader.prefetched = None
        return step

    def prefetch(self, step: Optional[int] = None, state_dict: Optional[STATE_DICT_TYPE] = None,
                 max_bytes: Optional[int] = None) -> Prefetch:
        """Start reading checkpoint ``step`` (default: the newest committed) into host memory in the background, for
        the :meth:`load` of that step that follows: call it first thing, then build the model. This rank alone reads
        (no collective): the chunks it will load into ``state_dict`` where given (shapes and placements are enough),
        else the files it wrote itself (a restart at the world size that saved). At most ``max_bytes`` (default:
        DISTCKPT_MEMORY_BUDGET_BYTES) are held. Returns the prefetch (``wait()``, ``cancel()``, ``nbytes``)."""
        step = self._committed_step(step)
        if self._prefetch is not None:
            self._prefetch[1].release()
        reader = backends.reader_for(self.root, **self.storage_options)
        if not isinstance(reader, BlobStorageReader):
            raise CheckpointError(f"CheckpointManager({self.root!r}).prefetch: the checkpoints here are read by "
                                  f"{type(reader).__name__}, which reads no bytes ahead; load without prefetch")
        ahead = Prefetch(self.path(step), reader, state_dict=state_dict, max_bytes=max_bytes, rank=self._coord.rank,
                         world_size=self._coord.world_size)
        self._prefetch = (step, ahead)
        return ahead

    def _drop_prefetch(self, step: int) -> None:
        """A prefetch of a step about to go gives its memory back."""
        ahead = self._prefetch
        if ahead is not None and ahead[0] == step:
            self._prefetch = None
            ahead[1].release(wait=False)

    def _committed_step(self, step: Optional[int]) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointNotFoundError(f"no committed checkpoint under {self.root!r}; nothing to resume from")
        elif self._name(step) and step not in self.all_steps():
            raise CheckpointNotFoundError(
                f"no committed checkpoint of step {step} under {self.root!r}; committed steps: {self.all_steps()}")
        return step

    def _writer(self):
        # a step, once committed, is never replaced: DISTCKPT_OVERWRITE does not reach the manager
        return backends.writer_for(self.root, **{"overwrite": False, **self.storage_options})

    def steps_to_keep(self, steps: list[int]) -> set[int]:
        if not steps:
            return set()
        keep = set(steps) if self.keep_last is None else set(steps[-self.keep_last:])
        if self.keep_every is not None:
            if self.keep_last is None:
                keep = {s for s in steps if s % self.keep_every == 0}
            else:
                keep |= {s for s in steps if s % self.keep_every == 0}
        keep.add(steps[-1])  # never the newest
        return keep

    def apply_retention(self) -> list[int]:
        """Delete committed checkpoints the policy does not keep; return their steps.

        Only what this call saw committed is considered, and the newest of it is kept: with
        several managers on one root, a step is deleted only where a newer one is committed.
        """
        if self.read_only:
            raise CheckpointError(f"CheckpointManager({self.root!r}, read_only=True) does not delete checkpoints")
        steps = self.all_steps()
        keep = self.steps_to_keep(steps)
        gone = [step for step in steps if step not in keep]
        if not gone:
            return []
        with events.phase("retention", "total", checkpoint_id=self.root) as record, deleting(self._store) as guard:
            if record is not None:
                record.files = len(gone)  # the steps it deletes
            kept = self._kept(guard, {self._name(step) for step in gone})
            for step in gone:
                self._drop_prefetch(step)
                self._files.delete(self._name(step), kept)
            self._sweep(kept, guard)
        return gone

    def delete(self, step: int) -> None:
        """Delete committed checkpoint ``step`` of this run (one already gone is no error). It disappears whole (a
        rename to a hidden name), then its files go; nothing but what distckpt wrote there is removed."""
        if self.read_only:
            raise CheckpointError(f"CheckpointManager({self.root!r}, read_only=True) does not delete checkpoints")
        if self.incremental:
            self._wait_for_previous_async()  # a save in flight may reference the step; its commit must see it kept
        self._drop_prefetch(step)
        self._delete(step)

    def compact(self, step: int) -> "CompactReport":
        """Make committed step ``step`` self-contained: copy in the data files it references in earlier steps (see
        :mod:`distckpt.compaction`). A phase of the manager's process group: call it on every rank; the coordinator
        copies, and every rank returns its report, or raises its failure, once the copy has committed. This manager's
        next incremental save then writes every chunk (the files its fingerprints name may be swept)."""
        if self.read_only:
            raise CheckpointError(f"CheckpointManager({self.root!r}, read_only=True) does not compact checkpoints")
        self._wait_for_previous_async()
        self._previous = None

        def on_coordinator(_: list) -> list:
            if step not in self.all_steps():
                raise CheckpointNotFoundError(f"no committed checkpoint of step {step} under {self.root!r}")
            with events.phase("compaction", "total", step=step, checkpoint_id=self.path(step)):
                with events.phase("compaction", "copy"):
                    report = compact(self.path(step), **self.storage_options)
                    events.add_bytes(report.bytes_copied, report.files)
            self._retain_after_commit()
            return [report.checkpoint_id, report.files, report.bytes_copied]

        # a phase of the group: a failure on the coordinator raises on every rank, and every rank returns once the
        # copy and its commit are done
        self._coord.begin("compact", self.path(step))
        checkpoint_id, files, copied = self._coord.all_reduce("compact", lambda: None, on_coordinator, _JSON, _JSON)
        return CompactReport(checkpoint_id, files, copied)

    def _delete(self, step: int) -> None:
        name = self._name(step)
        with deleting(self._store) as guard:
            kept = self._kept(guard, {name})
            self._files.delete(name, kept)
            self._sweep(kept, guard)

    def _kept(self, guard: Deleting, gone: set) -> Optional[dict]:
        """What the committed steps other than ``gone`` reference (the mark), or None (keep everything) where a save
        in flight may come to reference files of the run. The look for such saves comes first, the listing of the
        steps and their reading after it: a save it did not see either saw this deleter's record (and references
        nothing), or committed before the look, and its document is read here (run_guard.py)."""
        if guard.savers_live():
            return None
        return self._files.kept_files([name for name in self._committed_steps() if name not in gone])

    def _sweep(self, kept: Optional[dict], guard: Deleting) -> None:
        """Remove what retired steps hold that no kept step references (only with every kept step's table read)."""
        if kept is not None and REFERENCES in self._store.capabilities:
            self._store.remove_incomplete_below("step-", lambda: self._marked(guard))

    def remove_stale_temporaries(self) -> list[str]:
        """Remove what crashed saves and deletions left behind under ``root``; return what was removed.

        A save in flight, in this process or any other, is left alone (see the class text).
        """
        if self.read_only:
            raise CheckpointError(f"CheckpointManager({self.root!r}, read_only=True) does not clean up")
        if REFERENCES not in self._store.capabilities:
            return self._store.remove_incomplete_below("step-")
        drop_dead(self._store)  # the records of deleters and saves that crashed
        with deleting(self._store) as guard:
            return self._store.remove_incomplete_below("step-", lambda: self._marked(guard))

    def _marked(self, guard: Deleting) -> Optional[dict]:
        """The mark phase of a sweep: what the committed steps (of either spelling) reference. The store calls it once
        it has listed the retired steps it may prune, and it is read again until no step came or went during the read:
        another process may commit a step and retire the one before it meanwhile, and the new step references only
        what a step read here references or holds (a step retired after the listing is not pruned)."""
        if guard.savers_live():
            return None
        for _ in range(_MARK_TRIES):
            names = self._committed_steps()
            kept = self._files.kept_files(names)
            if kept is None or self._committed_steps() == names:
                return kept
        return None

    def _committed_steps(self) -> list[str]:
        return [name for name in self._store.children()
                if (_STEP.match(name) or _PLAIN_STEP.match(name)) and self._store.child(name).is_committed()]



def _step_name(step: Any, names: str = "padded") -> str:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise InvalidStepError(f"a step is an int, got {type(step).__name__} {step!r:.40}; pass int(step)")
    if not 0 <= step <= MAX_STEP:
        raise InvalidStepError(f"steps are integers from 0 to {MAX_STEP}, got {step}")
    return f"step-{int(step)}" if names == "plain" else f"step-{int(step):010d}"


def _root_store(root: str, options: dict[str, Any]) -> BlobStore:
    """The store of the location that holds the run's checkpoints, from the backend that accepts ``root``."""
    writer = backends.writer_for(root, **options)
    writer.reset(root)
    store = writer.blob_store() if isinstance(writer, BlobStorageWriter) else None
    if not isinstance(store, BlobStore) or RUNS not in store.capabilities:
        raise CheckpointError(f"CheckpointManager cannot keep a run at {root!r}: its backend is not a blob store that "
                              "declares it can hold a run of checkpoints (engine.blobs.RUNS)")
    return store
