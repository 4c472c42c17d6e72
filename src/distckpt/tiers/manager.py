"""TieredCheckpointManager: node-local memory, replicas on other nodes, a durable tier (docs/tiers.md)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import re
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Union

import torch.distributed as dist

from .. import events, faults, knobs
from ..backends import FileSystemReader, FileSystemWriter
from ..backends.fs_objects import is_real_dir, private_dir
from ..distributed import JSON as _JSON
from ..distributed import Coordinator, new_gloo_group
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, RankFailuresError
from ..format.json_text import parse_json
from ..format.records import FileStorageData
from ..loading import load, read_metadata
from ..manager import CheckpointManager
from ..verification import verify
from .exchange import Buffers, dir_bytes, dir_manifest, transfer
from .local_steps import RECORD, Incoming, commit, discard, make_room, receive_into, record_of
from .local_view import LocalView, as_saved, host_state
from .mapped_step import map_step
from .placement import choose_restore, replica_targets

__all__ = ["TieredCheckpointManager", "RestoreReport"]

log = logging.getLogger("distckpt.tiers")
_TIMINGS_KEPT = 64
_OWNER = re.compile(r"rank-(0|[1-9]\d{0,8})\Z")
_RUN = re.compile(r"[0-9a-f]{32}\Z")


@dataclass
class RestoreReport:
    """What :meth:`TieredCheckpointManager.restore` did: the step (None: nothing to restore), where it came from
    (``"memory"``, ``"durable"`` or ``"none"``), each rank's source (``"own"``, ``"peer <rank>"``, ``"durable"``),
    and the bytes behind each source: for this rank's own tier or a peer's, the bytes of its copy (every one of them
    read and checked); for the durable tier, the stored bytes of the step (a resharding load reads a part).
    ``seconds`` splits this rank's time: ``agree`` (the collectives that chose the step and sources, over every
    round), ``fetch`` (a replica brought from its holder), ``verify`` (every checksum of the copy), ``load``.
    ``struck`` lists the sources that failed, as ``(rank, step, source)``."""

    step: Optional[int]
    tier: str
    sources: dict[int, str] = field(default_factory=dict)
    bytes_from: dict[str, int] = field(default_factory=lambda: {"own": 0, "peer": 0, "durable": 0})
    rounds: int = 1
    seconds: dict[str, float] = field(default_factory=dict)
    struck: list[tuple[int, int, str]] = field(default_factory=list)


class TieredCheckpointManager:
    """Checkpoints in three tiers: each rank's own node-local copy, replicas on ranks of other nodes, and a
    durable :class:`CheckpointManager` run (a directory or ``s3://``).

    Args:
        durable: the durable tier's root (as for :class:`CheckpointManager`).
        local: this node's tier directory (default: :func:`distckpt.knobs.tier_dir`, under ``/dev/shm``, a tmpfs:
            memory that outlives a crashed training process but not the node). It must be a directory only this
            user can change (created so where missing); see docs/tiers.md.
        replicas: how many ranks on other nodes keep a copy of each rank's step (0: none).
        keep_local: how many newest steps the local tier keeps (own and replicas alike).
        memory_budget_bytes: the most the local tier may hold on this rank (own and replicas); older steps go
            first, the newest own step always stays.
        persist_every: every this many saves, the step also goes to the durable tier, in the background
            (0: only on :meth:`persist`).
        process_group: the job's group (default: the default group); the manager makes a gloo group of its own
            for its background work, with the package's collective timeout (``DISTCKPT_TIMEOUT_S``).
        durable_options: passed to the durable :class:`CheckpointManager` (``keep_last``, ``storage_options``...).
        run_id: what identifies this run (32 hex digits); default: the id recorded at the durable root
            (:meth:`CheckpointManager.run_id`). Steps in memory are restored only by a manager of the same run.

    ``timings[step]`` has what each of the newest steps cost this rank, in seconds: ``blocked_s`` (the ``save``
    call), ``waited_s`` (the part of it spent waiting for the background, see ``save``), ``local_s`` (from then
    until the local copy was committed), ``agree_s`` (waiting for every rank's local copy, and their file lists),
    ``replicate_s`` (sending and receiving the replicas) and ``replicated_bytes`` (sent by this rank), and
    ``persist_s`` where it was persisted.

    Every rank builds the manager and calls ``save``, ``restore``, ``persist`` and ``wait`` together.
    """

    def __init__(self, durable: Union[str, os.PathLike], *, local: Optional[str] = None, replicas: int = 1,
                 keep_local: int = 2, memory_budget_bytes: Optional[int] = None, persist_every: int = 10,
                 process_group: Any = None, durable_options: Optional[dict[str, Any]] = None,
                 run_id: Optional[str] = None) -> None:
        if keep_local < 1:
            raise CheckpointError(f"keep_local={keep_local}: the local tier keeps at least the newest step")
        if run_id is not None and not (isinstance(run_id, str) and _RUN.match(run_id)):
            raise CheckpointError(f"run_id={run_id!r}: a run id is 32 lowercase hex digits (secrets.token_hex(16))")
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        # every rank makes the manager (its group is a collective): agreed first, so that a rank that does not gets a
        # typed error within the arrival bound, not torch's store error from new_group
        agreement = Coordinator(process_group)
        agreement.begin("TieredCheckpointManager")
        agreement.arrive("TieredCheckpointManager")
        self.group = new_gloo_group(None if process_group is None else dist.get_process_group_ranks(process_group))
        self._coord = Coordinator(self.group)
        self.replicas, self.keep_local, self.memory_budget_bytes = replicas, keep_local, memory_budget_bytes
        self.persist_every = persist_every
        self._durable_root, self._durable_options = os.fspath(durable), dict(durable_options or {})
        self.durable: Optional[CheckpointManager] = None
        self.durable_failure: Optional[str] = None  # why the durable tier cannot be used, alike on every rank
        start = self._agree("start", lambda: self._start_report(local, run_id), self._start_plan)
        self.nodes, self.run_id, self.incarnation = start["nodes"], start["run"], start["incarnation"]
        self.durable_failure = start["durable_failure"]
        if self.durable_failure is not None:
            log.warning("rank %d: the durable tier %s cannot be used (%s); restores take steps from memory only, and "
                        "persisting raises until it can", self.rank, self._durable_root, self.durable_failure)
        self.run_dir = os.path.join(self.local, f"run-{self.run_id}")
        self.world_dir = os.path.join(self.run_dir, f"world-{self.world_size}")
        self.own_dir = os.path.join(self.world_dir, "own", f"rank-{self.rank}")
        self.held_dir = os.path.join(self.world_dir, "held", f"rank-{self.rank}")
        self._agree("local tier", self._open_local)
        self.targets = replica_targets(self.nodes, replicas) if replicas else {r: [] for r in range(self.world_size)}
        self.sources = sorted(r for r, ts in self.targets.items() if self.rank in ts)
        self._saves = 0
        self._queue: "queue.Queue[Any]" = queue.Queue()
        self._slots = threading.BoundedSemaphore(keep_local)  # saves in the background at once (see save)
        self._errors: list[tuple[int, BaseException]] = []  # (the save call's index, what it raised)
        self._errors_lock = threading.Lock()
        self._struck_durable: set[int] = set()  # durable steps whose load failed its checksums at restore
        self._in_call = 0  # restore() or persist() running on the calling thread (see install_preemption_handler)
        self._deferred: Optional[Callable[[], None]] = None
        self._worker = threading.Thread(target=self._work, name="distckpt-tier", daemon=True)
        self._worker.start()
        self._views: dict[int, LocalView] = {}
        self.timings: dict[int, dict[str, float]] = {}
        self._buffers = Buffers()
        log.info("rank %d (node %s): local tier %s (run %s), replicas to ranks %s, holding replicas of ranks %s",
                 self.rank, self.nodes[self.rank], self.local, self.run_id, self.targets[self.rank], self.sources)

    # ---- start: who is where, which run this is, whether the durable tier answers

    def _start_report(self, local: Optional[str], run_id: Optional[str]) -> dict[str, Any]:
        self.local = private_dir(local or knobs.tier_dir())
        report: dict[str, Any] = {"node": knobs.node_id(), "pointer": self._read_pointer()}
        try:
            self.durable = CheckpointManager(self._durable_root, process_group=self.group, step_names="padded",
                                             **self._durable_options)
            if self.rank == 0 and run_id is None:
                report["run"] = self.durable.run_id()
        except (CheckpointError, OSError) as exc:  # a dead store: memory can still be restored
            self.durable = None
            report["durable_failure"] = f"rank {self.rank}: {exc}"
        if run_id is not None:
            report["run"] = run_id
        return report

    def _start_plan(self, reports: list[dict[str, Any]]) -> dict[str, Any]:
        failures = [r["durable_failure"] for r in reports if r.get("durable_failure")]
        run = reports[0].get("run")
        if run is None:  # the durable root could not say: the run this node's tier last served, if all agree
            pointers = {r["pointer"]["run"] for r in reports if r.get("pointer")}
            if len(pointers) > 1:
                raise CheckpointError(
                    f"the durable tier {self._durable_root!r} cannot be read ({failures[0]}), and the nodes' tiers last "
                    f"served different runs of it ({sorted(pointers)}): which steps in memory belong to this run is "
                    "unknown. Bring the durable tier back, or pass run_id=")
            run = pointers.pop() if pointers else uuid.uuid4().hex
        # what this manager's saves are known by: one more than any incarnation a node of the run recorded, so that
        # later incarnations order after earlier ones whatever the clocks say (see choose_restore)
        counted = [r["pointer"]["incarnation"] for r in reports if r.get("pointer") and r["pointer"]["run"] == run]
        incarnation = f"{max(counted, default=0) + 1:012d}-{uuid.uuid4().hex[:8]}"
        return {"nodes": [r["node"] for r in reports], "run": run, "incarnation": incarnation,
                "durable_failure": failures[0] if failures else None}

    def _pointer(self) -> str:
        """This node's note of the run it last served for this durable root (used when the root cannot be read)."""
        endpoint = (self._durable_options.get("storage_options") or {}).get("endpoint_url")
        root = self._durable_root if "://" in self._durable_root else os.path.abspath(self._durable_root)
        key = hashlib.sha256(json.dumps([root, endpoint]).encode()).hexdigest()[:32]
        return os.path.join(self.local, f"last-run-{key}")

    def _read_pointer(self) -> Optional[dict[str, Any]]:
        """``{"run": id, "incarnation": n}`` as this node last wrote it for this durable root, or None."""
        try:
            with open(self._pointer(), "rb", opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW)) as fh:
                note = parse_json(fh.read(4096), self._pointer())
            if not (isinstance(note, dict) and isinstance(note.get("run"), str) and _RUN.match(note["run"])
                    and type(note.get("incarnation")) is int and note["incarnation"] >= 0):
                raise ValueError(note)
        except (OSError, ValueError, UnicodeDecodeError):
            return None
        return note

    def _open_local(self) -> None:
        """This rank's folders of the run, and its local runs: the own tier and one per rank whose replicas it
        holds, each a CheckpointManager of this process alone. Building them removes what crashed saves of this
        rank left, by the lease rules: a save whose process still lives is left alone."""
        for folder in (self.run_dir, self.world_dir, self.own_dir, self.held_dir):
            private_dir(folder)
        tmp = f"{self._pointer()}.tmp-{uuid.uuid4().hex}"
        with open(tmp, "w", opener=lambda p, f: os.open(p, f | os.O_EXCL | os.O_NOFOLLOW, 0o600)) as fh:
            json.dump({"run": self.run_id, "incarnation": int(self.incarnation.split("-")[0])}, fh)
        os.replace(tmp, self._pointer())
        self._own_run = self._local_run(self.own_dir)
        self._held_runs: dict[int, CheckpointManager] = {}
        for name in sorted(os.listdir(self.held_dir)):
            m = _OWNER.match(name)
            if m and is_real_dir(os.path.join(self.held_dir, name)):
                self._held(int(m.group(1)))

    @staticmethod
    def _local_run(folder: str) -> CheckpointManager:
        return CheckpointManager(folder, step_names="plain", no_dist=True)

    def _held(self, owner: int) -> CheckpointManager:
        if owner not in self._held_runs:
            self._held_runs[owner] = self._local_run(private_dir(self._replica_dir(owner)))
        return self._held_runs[owner]

    # ---- agreement: a phase of the package's Coordinator on the manager's group

    def _agree(self, phase: str, local_fn: Callable[[], Any], global_fn: Optional[Callable[[list[Any]], Any]] = None) -> Any:
        """``local_fn`` on every rank, ``global_fn`` (default: the list of every rank's answer) over their answers;
        its result on every rank. A failure anywhere, or a rank that does not answer within the collective
        timeout, raises on every rank, naming each failing rank."""
        self._coord.begin(f"tier {phase}")
        return self._coord.all_reduce(f"tier {phase}", local_fn, global_fn or (lambda values: values), _JSON, _JSON)

    # ---- paths and listings

    def _own(self, step: int) -> str:
        return os.path.join(self.own_dir, f"step-{step}")

    def _replica_dir(self, owner: int) -> str:
        return os.path.join(self.held_dir, f"rank-{owner}")

    def _replica(self, owner: int, step: int) -> str:
        return os.path.join(self._replica_dir(owner), f"step-{step}")

    def own_steps(self) -> list[int]:
        """Steps this rank's own tier holds, committed."""
        return self._own_run.all_steps()

    def replica_steps(self) -> dict[int, list[int]]:
        """For each rank whose replicas this rank keeps, the committed steps held."""
        return {owner: run.all_steps() for owner, run in sorted(self._held_runs.items())}

    # ---- save

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Save ``state`` as ``step``: returns once it is copied to host memory; the local write, replication and
        (every ``persist_every`` saves) the durable write follow in the background, in call order. When
        ``keep_local`` earlier saves are still in the background, this waits for the oldest (``timings[step]
        ["waited_s"]``): a background that lags, behind a slow persist, cannot pile steps up in memory.

        A background save that failed raises here ``keep_local`` calls later (by then it has ended on every rank,
        so every rank raises at the same call), or at the next :meth:`wait`, :meth:`persist` or :meth:`restore`."""
        index = self._saves
        start = time.perf_counter()
        self._slots.acquire()
        waited = time.perf_counter() - start
        try:
            # the saves up to index - keep_local have ended here, and so, alike, on every rank
            self._raise_background_error(upto=index - self.keep_local)
        except BaseException:
            self._slots.release()
            raise
        # from here the call counts on every rank: a failure on this rank alone still goes through the step's
        # agreement in the background, so that every rank fails the step, and the next save starts in step
        self._saves += 1
        persist = self.persist_every > 0 and self._saves % self.persist_every == 0
        failure: Optional[BaseException] = None
        handle = None
        try:
            view = LocalView(state, self.rank, self.world_size)
            # this call's save of the step: copies of one step from two calls never make one whole step
            record = {"step": step, "rank": self.rank, "world": self.world_size, "fingerprint": view.fingerprint,
                      "run": self.run_id, "save": f"{self.incarnation}:{index:012d}"}
            make_room(self._own(step))
            # an older copy of the step (of a history the run left) is replaced only once this one commits
            writer = FileSystemWriter(self._own(step), overwrite=True)
            handle = self._own_run.async_save(step, {**view.view, RECORD: record}, storage_writer=writer)
            self._views[step] = view
        except Exception as exc:  # noqa: BLE001 - raised below, and told to every rank by the background
            failure = exc
        self._timed(step, blocked_s=time.perf_counter() - start, waited_s=waited)
        self._queue.put((index, step, handle if failure is None else failure, persist, start + waited))
        if failure is not None:
            raise failure

    def persist(self, step: Optional[int] = None) -> Optional[int]:
        """Write ``step`` (default: the newest step every rank holds) to the durable tier from the local copies,
        once the saves before it are done; returns the step persisted or already durable (None where no step is
        held everywhere, or the newest held everywhere is older than the newest durable step)."""
        with self._main_collectives():
            self.wait()
            start = time.perf_counter()
            done = self._persist(step)
            if done is not None:
                self._timed(done, persist_s=time.perf_counter() - start)
            return done

    def wait(self) -> None:
        """Block until every save so far is written, replicated and (where due) persisted; raise its error."""
        self._queue.join()
        self._raise_background_error()

    def close(self) -> None:
        self._queue.join()
        self._queue.put(None)
        self._worker.join(timeout=60)

    def _raise_background_error(self, upto: Optional[int] = None) -> None:
        """Raise the first error of the background saves (of those up to call ``upto``), and forget them."""
        with self._errors_lock:
            due = [(i, exc) for i, exc in self._errors if upto is None or i <= upto]
            self._errors = [(i, exc) for i, exc in self._errors if not (upto is None or i <= upto)]
        if due:
            exc = due[0][1]
            raise CheckpointError(f"a background save of the tiered manager failed: {exc}") from exc

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                index, step, handle, persist, start = job
                failure: Optional[BaseException] = handle if isinstance(handle, BaseException) else None
                try:
                    if failure is None:
                        handle.result()
                except BaseException as exc:  # noqa: BLE001 - told to the other ranks, raised at the next call
                    failure = exc
                self._timed(step, local_s=time.perf_counter() - start)
                try:
                    sent = self._replicate(step, failure, f"{self.incarnation}:{index:012d}")
                    self._timed(step, replicated_bytes=sent)
                    if persist:
                        t0 = time.perf_counter()
                        self._persist(step)
                        self._timed(step, persist_s=time.perf_counter() - t0)
                except BaseException as exc:  # noqa: BLE001
                    with self._errors_lock:
                        self._errors.append((index, exc))
                finally:
                    self._slots.release()
                    try:  # failures never skip the bound
                        self._bound(step)
                    except (CheckpointError, OSError) as exc:
                        log.warning("rank %d: bounding the local tier after step %d failed: %s", self.rank, step, exc)
            finally:
                self._queue.task_done()

    def _timed(self, step: int, **figures: float) -> None:
        self.timings.setdefault(step, {}).update(figures)
        while len(self.timings) > _TIMINGS_KEPT:
            del self.timings[min(self.timings)]

    def _replicate(self, step: int, failure: Optional[BaseException], save: str) -> int:
        """Agree that every rank committed its local copy of ``step`` (where one did not, the step is never whole:
        every rank removes its copy), then send this rank's copy to its replica holders and take the replicas it
        holds, in one exchange; returns the bytes this rank sent."""
        t0 = time.perf_counter()

        def committed() -> Any:
            if failure is not None:
                raise CheckpointError(f"the local copy of step {step} failed: {failure}")
            return dir_manifest(self._own(step))

        try:
            manifests = self._agree(f"step {step}: local copies", committed)
        except CheckpointError:
            self._discard_own(step, save)
            raise
        manifest = manifests[self.rank]
        t1 = time.perf_counter()
        self._timed(step, agree_s=t1 - t0)
        if not self.replicas:
            return 0
        incoming: list[Optional[Incoming]] = []
        error: Optional[BaseException] = None
        for src in self.sources:
            try:
                self._held(src)
                incoming.append(receive_into(self._replica(src, step), self._spare(src), manifests[src]))
            except (CheckpointError, OSError) as exc:  # its messages are still taken (and dropped) below
                error = error or exc
                incoming.append(None)
        try:
            faults.point("collective", f"tier replication of step {step}")
            transfer([(self._own(step), manifest, dst) for dst in self.targets[self.rank]],
                     [(got.staging.root if got else None, manifests[src], src) for src, got in zip(self.sources, incoming)],
                     self.group, self._buffers)
        except (CheckpointError, OSError) as exc:  # every stream ran to its end: the ranks can still agree
            error = error or exc

        def transferred() -> None:
            if error is not None:
                raise CheckpointError(f"replicating step {step}: {error}") from error

        try:
            # a replica whose sender failed carries zeros: no rank commits any replica of a step whose transfer
            # failed anywhere (the first agreement); a commit that fails on one rank fails the step on all (the second)
            self._agree(f"step {step}: replicas", transferred)
            self._agree(f"step {step}: replicas committed", lambda: self._commit_all(incoming))
        except CheckpointError as exc:
            for got in incoming:
                if got is not None and os.path.lexists(got.staging.root):
                    discard(got)
            raise CheckpointError(f"replicating step {step} failed ({exc}); the step stays in the own tiers but has "
                                  "no replicas") from exc
        self._timed(step, replicate_s=time.perf_counter() - t1)
        return sum(size for _, size in manifest) * len(self.targets[self.rank])

    @staticmethod
    def _commit_all(incoming: list[Optional[Incoming]]) -> None:
        for got in incoming:
            if got is not None:
                commit(got)

    def _discard_own(self, step: int, save: str) -> None:
        """Remove this rank's copy of ``step`` made by the save ``save`` (a step some rank failed to commit is never
        whole); an older copy of the step, which that save would have replaced, stays."""
        self._views.pop(step, None)
        try:
            if record_of(self._own(step)).get("save") == save:
                self._own_run.delete(step)
        except (CheckpointError, OSError) as exc:
            log.warning("rank %d: could not remove its copy of the failed step %d: %s", self.rank, step, exc)

    def _bound(self, upto: int) -> None:
        """Keep the newest ``keep_local`` steps up to ``upto`` (the step just replicated), within the memory budget;
        the newest own step always stays. Newer steps, which training saved while this one was being replicated,
        are left to their own turn. The newest replica dropped of each owner is kept as that owner's spare,
        budget permitting: the next replica from it is received over its files (see ``exchange.reuse_spare``)."""
        own = [s for s in self.own_steps() if s <= upto]
        replica = {o: [s for s in ss if s <= upto] for o, ss in self.replica_steps().items()}
        steps = sorted(set(own) | {s for ss in replica.values() for s in ss}, reverse=True)
        keep = set(steps[: self.keep_local])
        used = 0
        for s in steps:
            if s not in keep:
                continue
            size = (dir_bytes(self._own(s)) if s in own else 0) + sum(
                dir_bytes(self._replica(o, s)) for o, ss in replica.items() if s in ss)
            if self.memory_budget_bytes is not None and used + size > self.memory_budget_bytes and own and s != own[-1]:
                keep.discard(s)
            else:
                used += size
        for s in own:
            if s not in keep:
                self._own_run.delete(s)
                self._views.pop(s, None)
        for o, ss in replica.items():
            spare = self._spare(o)
            for s in sorted(ss, reverse=True):
                if s in keep:
                    continue
                path = self._replica(o, s)
                size = dir_bytes(path)
                room = self.memory_budget_bytes is None or used + size <= self.memory_budget_bytes
                if room and not os.path.lexists(spare) and is_real_dir(path):
                    os.rename(path, spare)
                    used += size
                else:
                    self._held(o).delete(s)

    def _spare(self, owner: int) -> str:
        return os.path.join(self._replica_dir(owner), ".spare")

    # ---- durable tier

    def _usable_durable(self) -> CheckpointManager:
        if self.durable_failure is not None or self.durable is None:
            raise CheckpointError(f"the durable tier {self._durable_root!r} could not be opened when the manager "
                                  f"started ({self.durable_failure}); build the manager again once it answers")
        return self.durable

    def _persist(self, step: Optional[int]) -> Optional[int]:
        with events.phase("persist", "total", rank=self.rank, tier="durable") as record:
            done = self._persist_step(step)
            if record is not None:
                record.fields["step"] = done
            return done

    def _persist_step(self, step: Optional[int]) -> Optional[int]:
        durable = self._usable_durable()

        def held() -> dict[str, Any]:
            # the steps this process saved or restored (a copy left by an earlier process is not known to match),
            # each with the save that wrote it
            own = {str(s): record_of(self._own(s)).get("save") for s in self.own_steps() if s in self._views}
            out: dict[str, Any] = {"own": own}
            if self.rank == 0:
                stored = durable.all_steps()
                low = min((int(s) for s in own), default=None)
                out["durable"] = {str(s): (self._durable_save(durable, s) if low is not None and s >= low else None)
                                  for s in stored}
            return out

        def decide(reports: list[dict[str, Any]]) -> dict[str, Any]:
            saves = [r["own"] for r in reports]
            common = {int(s): v for s, v in saves[0].items() if v and all(o.get(s) == v for o in saves[1:])}
            stored = {int(s): v for s, v in reports[0]["durable"].items()}
            live = [s for s in stored if s not in self._struck_durable]  # a damaged step is not "newer"
            chosen = step
            if chosen is None:
                chosen = max(common) if common else None
                if chosen is None or (live and chosen < max(live)):
                    return {"step": None}  # nothing held everywhere, or the durable tier already has a newer step
            elif chosen not in common:
                raise CheckpointError(f"step {chosen} is not in every rank's local tier as one save of this run "
                                      f"(held everywhere: {sorted(common)}); persist a step that is, or restore() "
                                      "it first")
            if chosen not in stored:
                return {"step": chosen, "durable": False, "replace": False}
            if stored[chosen] == common[chosen]:
                return {"step": chosen, "durable": True}
            if chosen in self._struck_durable:  # its bytes failed their checksums at this manager's restore
                return {"step": chosen, "durable": False, "replace": True}
            raise CheckpointError(f"the durable tier {self._durable_root!r} holds another save of step {chosen} (a "
                                  "history the run did not go on with); a committed durable step is never replaced. "
                                  "Delete it (CheckpointManager(root).delete(step)) to persist this one")

        plan = self._agree("persist: choose", held, decide)
        chosen = plan["step"]
        if chosen is None or plan["durable"]:
            return chosen
        staged: dict[str, Any] = {}

        def stage() -> None:  # a damaged local copy fails this phase on every rank, before the durable save starts
            view = self._views[chosen]
            state = host_state(view, "meta")
            if not map_step(self._own(chosen), state["view"], state["dtensors"]):
                state = host_state(view, "cpu")
                load(state["view"], checkpoint_id=self._own(chosen), no_dist=True)
            staged["state"] = state

        self._agree(f"persist: stage step {chosen}", stage)
        state = staged["state"]
        if plan["replace"] and self.rank == 0:
            log.warning("rank %d: durable step %d failed its checksums at restore; replacing it with the step in "
                        "memory", self.rank, chosen)
            durable.delete(chosen)
        record = record_of(self._own(chosen))  # what every rank shares of it: the run, the step, the save
        shared = {k: record[k] for k in ("run", "step", "save") if k in record}
        durable.save(chosen, {**as_saved(state), RECORD: shared})
        log.info("rank %d: step %d persisted to %s", self.rank, chosen, durable.root)
        return chosen

    # ---- restore

    def restore(self, state: dict[str, Any]) -> RestoreReport:
        """Load the newest step of this run that can be fully assembled, from the nearest source of each rank (own
        tier, a replica holder, the durable tier), into ``state`` in place. Collective. Nothing is deleted unless
        the restore succeeds. See docs/tiers.md."""
        with self._main_collectives(), events.context(rank=self.rank), events.phase("restore", "total") as record:
            report = self._restore(state)  # its parts (agree, fetch, verify, load) are reported as each lap ends
            if record is not None:
                record.fields.update(step=report.step, tier=report.tier)
                record.bytes = sum(report.bytes_from.values())  # what the sources held, read and checked
            return report

    def _restore(self, state: dict[str, Any]) -> RestoreReport:
        """Rounds of one agreement on the step and each rank's source, then the load from them, until one succeeds;
        a source that fails is struck for the next round."""
        self.wait()
        view = LocalView(state, self.rank, self.world_size)
        layouts = self._agree("restore: layouts", lambda: view.fingerprint)
        bound: dict[str, Optional[str]] = {}
        struck: set = set()
        lap = _Laps()
        report = RestoreReport(None, "none", seconds=lap.seconds)
        for round_ in range(1, 2 * self.world_size + 8):
            plan = self._agree("restore: choose", lambda: self._restore_listing(view, layouts, bound),
                               lambda reports: self._restore_choice(reports, struck))
            step, tier = plan["step"], plan["tier"]
            sources = {int(r): s for r, s in plan["sources"].items()}
            report = RestoreReport(step, tier, rounds=round_, seconds=lap.seconds, struck=sorted(struck, key=str))
            lap("agree")
            if plan["durable_failure"] is not None:
                log.warning("rank %d: the durable tier cannot be listed (%s); restoring from memory, which may be "
                            "older than a durable step", self.rank, plan["durable_failure"])
            if step is None:
                log.info("rank %d: nothing to restore (no step of run %s in memory or in the durable tier)", self.rank,
                         self.run_id)
                return report
            if tier == "durable":
                if self._restore_durable(state, step, struck, report, lap):
                    return report
            elif self._restore_from_memory(step, sources, view, struck, report, lap):
                return report
        raise CheckpointError(f"restore gave up after {report.rounds} rounds of failed sources ({sorted(struck, key=str)}); "
                              "nothing was removed")

    def _restore_listing(self, view: LocalView, layouts: list, bound: dict[str, Optional[str]]) -> dict[str, Any]:
        """What this rank can restore from: its own steps and the replicas it holds (those saved by the same call
        with the layout each rank has now), and on rank 0 the durable steps."""
        own = [[s, save] for s in self.own_steps() if (save := self._bound_to(self._own(s), view.fingerprint, bound))]
        replicas = {str(o): [[s, save] for s in ss if (save := self._bound_to(self._replica(o, s), layouts[o], bound))]
                    for o, ss in self.replica_steps().items() if o < self.world_size}
        out: dict[str, Any] = {"own": own, "replicas": replicas}
        if self.rank == 0:
            try:
                out["durable"] = self._usable_durable().all_steps()
            except (CheckpointError, OSError) as exc:
                out["durable_failure"] = str(exc)
        return out

    def _restore_choice(self, reports: list[dict[str, Any]], struck: set) -> dict[str, Any]:
        """The coordinator's choice from every rank's listing: the step, its tier and each rank's source."""
        failure = reports[0].get("durable_failure")
        step, tier, sources = choose_restore(reports, frozenset(tuple(s) for s in struck))
        if failure is not None and tier != "memory":
            raise CheckpointError(f"no step of this run is whole in memory, and the durable tier cannot be listed "
                                  f"({failure}); nothing was restored or removed. Bring the durable tier back and "
                                  "restore again")
        return {"step": step, "tier": tier, "sources": {str(r): s for r, s in sources.items()},
                "durable_failure": failure}

    def _restore_durable(self, state: dict[str, Any], step: int, struck: set, report: RestoreReport, lap: "_Laps") -> bool:
        """Load ``step`` from the durable tier into ``state``; False (the step struck) where it is damaged."""
        durable = self._usable_durable()
        try:
            durable.load(state, step)
        except CheckpointError as exc:
            if not _damaged(exc):
                raise
            log.warning("rank %d: durable step %d is damaged (%s); trying an older source", self.rank, step,
                        str(exc).splitlines()[0])
            struck.update((r, step, "durable") for r in range(self.world_size))
            self._struck_durable.add(step)
            lap("load")
            return False
        lap("load")
        report.sources = {r: "durable" for r in range(self.world_size)}
        report.bytes_from["durable"] = _stored_bytes(durable.path(step))
        log.info("rank %d: restored step %d from the durable tier %s", self.rank, step, durable.root)
        return True

    def _restore_from_memory(self, step: int, sources: dict[int, str], view: LocalView, struck: set,
                             report: RestoreReport, lap: "_Laps") -> bool:
        """Fetch and verify each rank's copy of ``step`` from its source, agree, and load; False (each failed source
        struck) where any rank's copy failed."""
        mine = sources[self.rank]
        failure: Optional[str] = None
        try:
            fetched = self._fetch(step, sources)
            lap("fetch")
            try:  # a copy from a peer is checked before it takes the step's place in this rank's tier
                checked = verify(self._own(step) if fetched is None else fetched.staging.root)
            except BaseException:
                if fetched is not None:
                    discard(fetched)
                raise
            if fetched is not None:
                commit(fetched)
            lap("verify")
            report.bytes_from["own" if mine == "own" else "peer"] = checked.bytes_checked
        except (CheckpointError, OSError) as exc:
            failure = str(exc) or type(exc).__name__
        votes = self._agree(f"restore: verify step {step}", lambda: failure)
        lap("agree")
        if any(votes):
            for r, v in enumerate(votes):
                if v:
                    log.warning("rank %d: step %d for rank %d from %s failed (%s); trying the next source",
                                self.rank, step, r, sources[r], v.splitlines()[0])
                    struck.add((r, step, sources[r]))
            return False
        # every checksum of this copy passed just above, and only this rank writes its own tier: one read,
        # not a second pass over the bytes (headers, sizes and save ids are still checked)
        self._agree(f"restore: load step {step}", lambda: self._load_own(step, view))
        lap("load")
        report.sources = {r: ("own" if s == "own" else f"peer {s}") for r, s in sources.items()}
        log.info("rank %d: restored step %d from %s", self.rank, step,
                 "its own tier" if mine == "own" else f"the replica on rank {mine}")
        self._views[step] = view
        return True

    def _load_own(self, step: int, view: LocalView) -> None:
        load(view.view, storage_reader=FileSystemReader(self._own(step), verify_checksums=False), no_dist=True)
        view.write_back()

    def _durable_save(self, durable: CheckpointManager, step: int) -> Optional[str]:
        """The save that wrote durable step ``step`` (its tier record), or None where it has none or is unreadable."""
        try:
            holder: dict[str, Any] = {RECORD: {"save": ""}}
            durable.load(holder, step, no_dist=True)
            return str(holder[RECORD]["save"]) or None
        except (CheckpointError, OSError, KeyError, TypeError):
            return None

    def _bound_to(self, path: str, fingerprint: str, seen: dict[str, Optional[str]]) -> Optional[str]:
        """The save that wrote the step at ``path``, where its record says it was written by this run for the layout
        ``fingerprint``; None where it was not, or cannot be read."""
        if path not in seen:
            try:
                record = record_of(path)
                ok = record.get("run") == self.run_id and record.get("fingerprint") == fingerprint
                seen[path] = str(record["save"]) if ok and record.get("save") else None
            except (CheckpointError, OSError, KeyError, TypeError, AttributeError) as exc:
                log.warning("rank %d: %s is not a source (%s)", self.rank, path, exc)
                seen[path] = None
        return seen[path]

    def _fetch(self, step: int, sources: dict[int, Any]) -> Optional[Incoming]:
        """Bring each rank's step from the replica holder chosen for it, into a leased staging area beside its place
        in the rank's own tier (returned, for the caller to check and commit; None where the rank has its own)."""
        wanted = {r: s for r, s in sources.items() if s != "own"}

        def offers() -> dict[str, Any]:
            return {str(r): dir_manifest(self._replica(r, step)) for r, holder in wanted.items() if holder == self.rank}

        everyone = self._agree(f"restore: offers of step {step}", offers)
        outgoing = [(self._replica(r, step), everyone[holder][str(r)], r) for r, holder in wanted.items()
                    if holder == self.rank]
        incoming: list[tuple[Optional[str], list[list[Any]], int]] = []
        fetched = None
        error: Optional[BaseException] = None
        try:
            if self.rank in wanted:
                manifest = everyone[wanted[self.rank]][str(self.rank)]
                try:
                    fetched = receive_into(self._own(step), None, manifest)
                except (CheckpointError, OSError) as exc:  # its messages are still taken (and dropped) below
                    error = exc
                incoming.append((fetched.staging.root if fetched else None, manifest, wanted[self.rank]))
            transfer(outgoing, incoming, self.group, self._buffers)
            if error is not None:
                raise error
        except BaseException:
            if fetched is not None:
                discard(fetched)
            raise
        return fetched

    # ---- preemption

    def preempt(self) -> Optional[int]:
        """What the preemption handler does, without exiting: finish the saves in flight, log (and set aside) what
        failed among them, and persist the newest step whole on every rank; returns it (None: nothing to persist,
        or the durable tier already has a newer step). Collective."""
        self._queue.join()
        with self._errors_lock:
            failed, self._errors = self._errors, []
        for _, exc in failed:
            log.warning("rank %d: a save before the preemption had failed (%s); persisting the newest step whole on "
                        "every rank", self.rank, exc)
        return self._persist(None)

    @contextlib.contextmanager
    def _main_collectives(self) -> Iterator[None]:
        """Marks a call whose collectives run on the calling thread: a preemption signal that lands inside it is
        handled once it ends, so that the handler's own collectives never interleave with its."""
        self._in_call += 1
        try:
            yield
        finally:
            self._in_call -= 1
            if not self._in_call and self._deferred is not None:
                deferred, self._deferred = self._deferred, None
                deferred()

    def install_preemption_handler(self, grace_s: float = 30.0, signum: int = signal.SIGTERM) -> None:
        """On ``signum`` (SIGTERM: what schedulers send before they kill): :meth:`preempt` (finish the saves in
        flight, persist the newest step every rank holds whole, whatever failed before), log what was persisted,
        and exit with 128+signum. Every rank must get the signal (torchrun passes it to all its workers). The
        persist runs against ``grace_s``: a deadline the log reports as met or missed."""

        def handler(signo: int, _frame: Any) -> None:
            if self._in_call:  # the signal landed inside restore() or persist(): its collectives end first
                log.warning("rank %d: signal %d during a collective call; persisting once it ends", self.rank, signo)
                self._deferred = lambda: handler(signo, None)
                return
            start = time.monotonic()
            log.warning("rank %d: signal %d: persisting the newest local step within %.0f s", self.rank, signo, grace_s)
            step = None
            try:
                step = self.preempt()
            except BaseException as exc:  # noqa: BLE001 - reported, then the process exits as asked
                log.error("rank %d: persisting on signal %d failed: %s", self.rank, signo, exc)
            took = time.monotonic() - start
            what = f"persisted step {step}" if step is not None else "persisted nothing (no step held everywhere)"
            log.warning("rank %d: on signal %d %s to %s in %.2f s (%s the %.0f s grace)", self.rank, signo, what,
                        self._durable_root, took, "within" if took <= grace_s else "past", grace_s)
            os._exit(128 + signo)

        signal.signal(signum, handler)


class _Laps:
    """Seconds a restore spends in each phase, counted from one lap to the next."""

    def __init__(self) -> None:
        self.seconds = {"agree": 0.0, "fetch": 0.0, "verify": 0.0, "load": 0.0}
        self.clock, self.wall = time.perf_counter(), time.time()

    def __call__(self, what: str) -> None:
        now, wall = time.perf_counter(), time.time()
        self.seconds[what] += now - self.clock
        events.report("restore", what, now - self.clock, self.wall)  # this lap, timed as it ran
        self.clock, self.wall = now, wall


def _damaged(exc: CheckpointError) -> bool:
    """Whether a failed load of a committed step says its bytes are damaged or missing (on any rank)."""
    kinds = (CorruptCheckpointError, CheckpointNotFoundError)
    if isinstance(exc, kinds):
        return True
    if isinstance(exc, RankFailuresError):
        return any(isinstance(w.exception, kinds) for w in exc.failures.values())
    return False


def _stored_bytes(checkpoint_id: str) -> int:
    """The bytes of every chunk and value a committed checkpoint stores, from its metadata (any backend)."""
    data = read_metadata(checkpoint_id).storage_data
    return sum(si.length for si in data.items.values()) if isinstance(data, FileStorageData) else 0
