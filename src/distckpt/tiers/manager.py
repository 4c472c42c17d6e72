"""TieredCheckpointManager: node-local memory, replicas on other nodes, a durable tier (docs/tiers.md)."""

from __future__ import annotations

import logging
import os
import queue
import re
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .. import faults
from ..backends import FileSystemReader
from ..backends.filesystem import parse_hidden
from ..errors import CheckpointError
from ..format.records import FileStorageData
from ..loading import load, read_metadata
from ..manager import CheckpointManager
from ..staging import async_save
from ..verification import verify
from .exchange import Buffers, all_gather_json, commit_dir, dir_bytes, dir_manifest, transfer
from .local_view import LocalView
from .mapped_step import map_step
from .placement import choose_restore, replica_targets

__all__ = ["TieredCheckpointManager", "RestoreReport"]

log = logging.getLogger("distckpt.tiers")
_STEP = re.compile(r"step-(\d+)\Z")
_RECORD = "distckpt_tier"
_TIMINGS_KEPT = 64


@dataclass
class RestoreReport:
    """What :meth:`TieredCheckpointManager.restore` did: the step (None: nothing to restore), where it came from
    (``"memory"``, ``"durable"`` or ``"none"``), each rank's source (``"own"``, ``"peer <rank>"``, ``"durable"``),
    and the bytes behind each source: for this rank's own tier or a peer's, the bytes of its copy (every one of them
    read and checked); for the durable tier, the stored bytes of the step (a resharding load reads a part).
    ``seconds`` splits this rank's time: ``agree`` (the collectives that chose the step and sources, over every
    round), ``fetch`` (a replica brought from its holder), ``verify`` (every checksum of the copy), ``load``."""

    step: Optional[int]
    tier: str
    sources: dict[int, str] = field(default_factory=dict)
    bytes_from: dict[str, int] = field(default_factory=lambda: {"own": 0, "peer": 0, "durable": 0})
    rounds: int = 1
    seconds: dict[str, float] = field(default_factory=dict)


def _default_local_root() -> str:
    job = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("DISTCKPT_JOB_ID") or "default"
    return os.environ.get("DISTCKPT_TIER_DIR") or os.path.join("/dev/shm", "distckpt-tier", job)


def _node_id() -> str:
    return os.environ.get("DISTCKPT_NODE_ID") or os.environ.get("GROUP_RANK") or os.uname().nodename


def _steps_in(folder: str) -> list[int]:
    if not os.path.isdir(folder):
        return []
    out = []
    for name in os.listdir(folder):
        m = _STEP.match(name)
        if m and os.path.isfile(os.path.join(folder, name, "metadata.json")) and not os.path.islink(os.path.join(folder, name)):
            out.append(int(m.group(1)))
    return sorted(out)


class TieredCheckpointManager:
    """Checkpoints in three tiers: each rank's own node-local copy, replicas on ranks of other nodes, and a
    durable :class:`CheckpointManager` run (a directory or ``s3://``).

    Args:
        durable: the durable tier's root (as for :class:`CheckpointManager`).
        local: this node's tier directory (default ``$DISTCKPT_TIER_DIR`` or ``/dev/shm/distckpt-tier/<job>``,
            a tmpfs: memory that outlives a crashed training process but not the node).
        replicas: how many ranks on other nodes keep a copy of each rank's step (0: none).
        keep_local: how many newest steps the local tier keeps (own and replicas alike).
        memory_budget_bytes: the most the local tier may hold on this rank (own and replicas); older steps go
            first, the newest own step always stays.
        persist_every: every this many saves, the step also goes to the durable tier, in the background
            (0: only on :meth:`persist`).
        process_group: the job's group (default: the default group); the manager makes a gloo group of its own
            for its background work.
        durable_options: passed to the durable :class:`CheckpointManager` (``keep_last``, ``storage_options``...).

    ``timings[step]`` has what each of the newest steps cost this rank, in seconds: ``blocked_s`` (the ``save``
    call), ``waited_s`` (the part of it spent waiting for the background, see ``save``), ``local_s`` (from then
    until the local copy was committed), ``agree_s`` (waiting for every rank's local copy, and their file lists),
    ``replicate_s`` (sending and receiving the replicas) and ``replicated_bytes`` (sent by this rank), and
    ``persist_s`` where it was persisted.

    Every rank builds the manager and calls ``save``, ``restore``, ``persist`` and ``wait`` together.
    """

    def __init__(self, durable: Union[str, os.PathLike], *, local: Optional[str] = None, replicas: int = 1,
                 keep_local: int = 2, memory_budget_bytes: Optional[int] = None, persist_every: int = 10,
                 process_group: Any = None, durable_options: Optional[dict[str, Any]] = None) -> None:
        if keep_local < 1:
            raise CheckpointError(f"keep_local={keep_local}: the local tier keeps at least the newest step")
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.group = dist.new_group(ranks=None if process_group is None else dist.get_process_group_ranks(process_group),
                                    backend="gloo")
        self.local = os.path.abspath(local or _default_local_root())
        self.own_dir = os.path.join(self.local, "own", f"rank-{self.rank}")
        self.held_dir = os.path.join(self.local, "held", f"rank-{self.rank}")
        os.makedirs(self.own_dir, exist_ok=True)
        self._remove_leftovers()
        self.replicas, self.keep_local, self.memory_budget_bytes = replicas, keep_local, memory_budget_bytes
        self.persist_every = persist_every
        self.durable = CheckpointManager(durable, process_group=self.group, step_names="padded", **(durable_options or {}))
        self.nodes = all_gather_json(_node_id(), self.group)
        self.targets = replica_targets(self.nodes, replicas) if replicas else {r: [] for r in range(self.world_size)}
        self.sources = sorted(r for r, ts in self.targets.items() if self.rank in ts)
        self._saves = 0
        self._queue: "queue.Queue[Any]" = queue.Queue()
        self._slots = threading.BoundedSemaphore(keep_local)  # saves in the background at once (see save)
        self._errors: list[BaseException] = []
        self._worker = threading.Thread(target=self._work, name="distckpt-tier", daemon=True)
        self._worker.start()
        self._views: dict[int, LocalView] = {}
        self.timings: dict[int, dict[str, float]] = {}
        self._buffers = Buffers()
        log.info("rank %d (node %s): local tier %s, replicas to ranks %s, holding replicas of ranks %s",
                 self.rank, self.nodes[self.rank], self.local, self.targets[self.rank], self.sources)

    def _remove_leftovers(self) -> None:
        """What a killed earlier process of this rank left half-written in its own directories (nobody else writes
        there, and this process has started nothing yet): unfinished local writes and transfers, and the leases of
        local saves it was killed in."""
        dirs = [self.own_dir] + ([os.path.join(self.held_dir, d) for d in os.listdir(self.held_dir)]
                                 if os.path.isdir(self.held_dir) else [])
        for d in dirs:
            for name in os.listdir(d) if os.path.isdir(d) else []:
                if name.startswith((".incoming-", ".replaced-", ".spare")) or parse_hidden(name) is not None:
                    path = os.path.join(d, name)
                    if os.path.isdir(path) and not os.path.islink(path):
                        shutil.rmtree(path, ignore_errors=True)
                    elif not os.path.isdir(path):
                        os.unlink(path)

    # ---- paths

    def _own(self, step: int) -> str:
        return os.path.join(self.own_dir, f"step-{step}")

    def _replica_dir(self, owner: int) -> str:
        return os.path.join(self.held_dir, f"rank-{owner}")

    def own_steps(self) -> list[int]:
        """Steps this rank's own tier holds, committed."""
        return _steps_in(self.own_dir)

    def replica_steps(self) -> dict[int, list[int]]:
        """For each rank whose replicas this rank keeps, the committed steps held."""
        root = self.held_dir
        out = {}
        if os.path.isdir(root):
            for name in os.listdir(root):
                m = re.match(r"rank-(\d+)\Z", name)
                if m:
                    out[int(m.group(1))] = _steps_in(os.path.join(root, name))
        return out

    # ---- save

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Save ``state`` as ``step``: returns once it is copied to host memory; the local write, replication and
        (every ``persist_every`` saves) the durable write follow in the background, in call order. When
        ``keep_local`` earlier saves are still in the background, this waits for the oldest (``timings[step]
        ["waited_s"]``): a background that lags, behind a slow persist, cannot pile steps up in memory."""
        self._raise_background_error()
        start = time.perf_counter()
        self._slots.acquire()
        waited = time.perf_counter() - start
        try:
            view = LocalView(state, self.rank, self.world_size)
            record = {"step": step, "rank": self.rank, "world": self.world_size, "fingerprint": view.fingerprint}
            handle = async_save({**view.view, _RECORD: record}, checkpoint_id=self._own(step), no_dist=True, overwrite=True)
        except BaseException:
            self._slots.release()
            raise
        self._saves += 1
        persist = self.persist_every > 0 and self._saves % self.persist_every == 0
        self._views[step] = view
        self._timed(step, blocked_s=time.perf_counter() - start, waited_s=waited)
        self._queue.put(("save", step, handle, persist, start + waited))

    def persist(self, step: Optional[int] = None) -> Optional[int]:
        """Write ``step`` (default: the newest step every rank holds) to the durable tier from the local copies,
        once the saves before it are done; returns the step persisted or already durable (None where no step is
        held everywhere, or the newest held everywhere is older than the newest durable step)."""
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

    def _raise_background_error(self) -> None:
        if self._errors:
            exc = self._errors.pop(0)
            self._errors.clear()
            raise CheckpointError(f"a background save of the tiered manager failed: {exc}") from exc

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                _, step, handle, persist, start = job
                ok = True
                try:
                    handle.result()
                except BaseException as exc:  # noqa: BLE001 - told to the other ranks, raised at the next call
                    ok = False
                    self._errors.append(exc)
                self._timed(step, local_s=time.perf_counter() - start)
                try:
                    sent = self._replicate(step, ok)
                    self._timed(step, replicated_bytes=sent)
                    self._bound(step)
                    if persist and ok:
                        t0 = time.perf_counter()
                        self._persist(step)
                        self._timed(step, persist_s=time.perf_counter() - t0)
                except BaseException as exc:  # noqa: BLE001
                    self._errors.append(exc)
                finally:
                    self._slots.release()
            finally:
                self._queue.task_done()

    def _timed(self, step: int, **figures: float) -> None:
        self.timings.setdefault(step, {}).update(figures)
        while len(self.timings) > _TIMINGS_KEPT:
            del self.timings[min(self.timings)]

    def _replicate(self, step: int, ok: bool) -> int:
        """Send this rank's step to its replica holders and take the replicas it holds, in one exchange; returns
        the bytes this rank sent."""
        t0 = time.perf_counter()
        manifest = dir_manifest(self._own(step)) if ok else None
        everyone = all_gather_json({"ok": ok, "manifest": manifest}, self.group)
        t1 = time.perf_counter()
        self._timed(step, agree_s=t1 - t0)
        if not all(r["ok"] for r in everyone):
            bad = [r for r, rep in enumerate(everyone) if not rep["ok"]]
            raise CheckpointError(f"step {step} failed on ranks {bad}; it is not kept as a tiered step")
        if not self.replicas:
            return 0
        failure, tmps = None, []
        try:
            faults.point("collective", f"tier replication of step {step}")
            tmps = transfer([(self._own(step), manifest, dst) for dst in self.targets[self.rank]],
                            [(self._replica_dir(src), everyone[src]["manifest"], src, self._spare(src))
                             for src in self.sources], self.group, self._buffers)
        except (CheckpointError, OSError) as exc:  # every stream ran to its end: the ranks can still agree
            failure = f"rank {self.rank}: {exc}"
        failures = [f for f in all_gather_json(failure, self.group) if f]
        if failures:  # a replica whose sender failed carries zeros: no rank commits any replica of this step
            for tmp in tmps:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"replicating step {step} failed ({failures[0]}); the step stays in the own tiers "
                                  "but has no replicas")
        for src, tmp in zip(self.sources, tmps):
            commit_dir(tmp, os.path.join(self._replica_dir(src), f"step-{step}"))
        self._timed(step, replicate_s=time.perf_counter() - t1)
        return sum(size for _, size in manifest) * len(self.targets[self.rank])

    def _bound(self, upto: int) -> None:
        """Keep the newest ``keep_local`` steps up to ``upto`` (the step just replicated), within the memory budget;
        the newest own step always stays. Newer steps, which training saved while this one was being replicated,
        are left to their own turn. The newest replica dropped of each owner is kept as that owner's spare,
        budget permitting: the next replica from it is received over its files (see ``exchange.transfer``)."""
        own = [s for s in self.own_steps() if s <= upto]
        replica = {o: [s for s in ss if s <= upto] for o, ss in self.replica_steps().items()}
        steps = sorted(set(own) | {s for ss in replica.values() for s in ss}, reverse=True)
        keep = set(steps[: self.keep_local])
        used = 0
        for s in steps:
            if s not in keep:
                continue
            size = (dir_bytes(self._own(s)) if s in own else 0) + sum(
                dir_bytes(os.path.join(self._replica_dir(o), f"step-{s}")) for o, ss in replica.items() if s in ss)
            if self.memory_budget_bytes is not None and used + size > self.memory_budget_bytes and own and s != own[-1]:
                keep.discard(s)
            else:
                used += size
        for s in own:
            if s not in keep:
                shutil.rmtree(self._own(s), ignore_errors=True)
                self._views.pop(s, None)
        for o, ss in replica.items():
            spare = self._spare(o)
            for s in sorted(ss, reverse=True):
                if s in keep:
                    continue
                path = os.path.join(self._replica_dir(o), f"step-{s}")
                size = dir_bytes(path)
                room = self.memory_budget_bytes is None or used + size <= self.memory_budget_bytes
                if room and not os.path.lexists(spare):
                    os.rename(path, spare)
                    used += size
                else:
                    shutil.rmtree(path, ignore_errors=True)

    def _spare(self, owner: int) -> str:
        return os.path.join(self._replica_dir(owner), ".spare")

    # ---- durable tier

    def _persist(self, step: Optional[int]) -> Optional[int]:
        held = all_gather_json({"own": self.own_steps(), "views": sorted(self._views)}, self.group)
        common = set(held[0]["own"]).intersection(*(set(h["own"]) for h in held[1:]))
        durable = self.durable.all_steps()
        if step is None:
            step = max(common) if common else None
            if step is None or (durable and step < max(durable)):
                return None  # nothing held everywhere, or the durable tier already has a newer step
        elif step not in common:
            raise CheckpointError(f"step {step} is not in every rank's local tier (held everywhere: {sorted(common)}); "
                                  "persist a step that is")
        if step in durable:
            return step
        missing = [r for r, h in enumerate(held) if step not in h["views"]]
        if missing:  # decided alike on every rank, before any rank starts the collective save
            raise CheckpointError(f"step {step} was saved by an earlier process on ranks {missing}; restore() it first, "
                                  "then persist")
        view = self._views[step]
        state = _host_state(view, "meta")
        if not map_step(self._own(step), state["view"], state["dtensors"]):
            state = _host_state(view, "cpu")
            load(state["view"], checkpoint_id=self._own(step), no_dist=True)
        self.durable.save(step, _as_saved(state))
        log.info("rank %d: step %d persisted to %s", self.rank, step, self.durable.root)
        return step

    # ---- restore

    def restore(self, state: dict[str, Any]) -> RestoreReport:
        """Load the newest step that can be fully assembled, from the nearest source of each rank (own tier, a
        replica holder, the durable tier), into ``state`` in place. Collective. See docs/tiers.md."""
        self.wait()
        view = LocalView(state, self.rank, self.world_size)
        durable = self.durable.all_steps() if self.rank == 0 else []
        struck: set = set()
        report = RestoreReport(None, "none")
        seconds = {"agree": 0.0, "fetch": 0.0, "verify": 0.0, "load": 0.0}
        clock = time.perf_counter()

        def lap(what: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            seconds[what] += now - clock
            clock = now

        for round_ in range(1, 2 * self.world_size + 4):
            own = [s for s in self.own_steps() if self._record(self._own(s)) == view.fingerprint]
            reports = all_gather_json({"own": own, "replicas": {str(o): ss for o, ss in self.replica_steps().items()},
                                       "durable": durable}, self.group)
            step, tier, sources = choose_restore(reports, frozenset(struck))
            report = RestoreReport(step, tier, rounds=round_, seconds=seconds)
            self._drop_after(step)
            lap("agree")
            if step is None:
                log.info("rank %d: nothing to restore (no step in memory or in the durable tier)", self.rank)
                return report
            if tier == "durable":
                stored = _stored_bytes(self.durable.path(step))
                self.durable.load(state, step)
                lap("load")
                report.sources = {r: "durable" for r in range(self.world_size)}
                report.bytes_from["durable"] = stored
                log.info("rank %d: restored step %d from the durable tier %s", self.rank, step, self.durable.root)
                return report
            mine = sources[self.rank]
            failure = None
            try:
                self._fetch(step, sources)
                lap("fetch")
                checked = verify(self._own(step))
                lap("verify")
                report.bytes_from["own" if mine == "own" else "peer"] = checked.bytes_checked
            except (CheckpointError, OSError) as exc:
                failure = str(exc)
            votes = all_gather_json(failure, self.group)
            lap("agree")
            if any(votes):
                for r, v in enumerate(votes):
                    if v:
                        log.warning("rank %d: step %d for rank %d from %s failed verification (%s); trying the next "
                                    "source", self.rank, step, r, sources[r], v.splitlines()[0])
                        struck.add((r, step, sources[r]))
                continue
            # every checksum of this copy passed just above, and only this rank writes its own tier: one read,
            # not a second pass over the bytes (headers, sizes and save ids are still checked)
            load(view.view, storage_reader=FileSystemReader(self._own(step), verify_checksums=False), no_dist=True)
            view.write_back()
            lap("load")
            report.sources = {r: ("own" if s == "own" else f"peer {s}") for r, s in sources.items()}
            log.info("rank %d: restored step %d from %s", self.rank, step,
                     "its own tier" if mine == "own" else f"the replica on rank {mine}")
            self._views[step] = view
            return report
        raise CheckpointError(f"restore gave up after {report.rounds} rounds of failed sources")

    def _drop_after(self, step: Optional[int]) -> None:
        """Remove the local steps after ``step``, which every rank now restores: they belong to a run that did not
        go on (saved by some ranks only, or before a crash), and the run saves those step numbers again."""
        newest = -1 if step is None else step
        for s in self.own_steps():
            if s > newest:
                shutil.rmtree(self._own(s), ignore_errors=True)
        for owner, steps in self.replica_steps().items():
            for s in steps:
                if s > newest:
                    shutil.rmtree(os.path.join(self._replica_dir(owner), f"step-{s}"), ignore_errors=True)

    def _record(self, path: str) -> Optional[str]:
        try:
            holder = {_RECORD: {"fingerprint": ""}}
            load(holder, checkpoint_id=path, no_dist=True)
            return holder[_RECORD]["fingerprint"]
        except (CheckpointError, OSError, KeyError, TypeError):
            return None

    def _fetch(self, step: int, sources: dict[int, Any]) -> None:
        """Bring each rank's step into its own tier from the replica holder chosen for it."""
        wanted = {r: s for r, s in sources.items() if s != "own"}
        offers = {}
        for r, holder in wanted.items():
            if holder == self.rank:
                offers[str(r)] = dir_manifest(os.path.join(self._replica_dir(r), f"step-{step}"))
        everyone = all_gather_json(offers, self.group)
        outgoing = [(os.path.join(self._replica_dir(r), f"step-{step}"), everyone[holder][str(r)], r)
                    for r, holder in wanted.items() if holder == self.rank]
        incoming = [(self.own_dir, everyone[holder][str(r)], holder, None) for r, holder in wanted.items() if r == self.rank]
        tmps = transfer(outgoing, incoming, self.group, self._buffers)
        if tmps:
            commit_dir(tmps[0], self._own(step))

    # ---- preemption

    def install_preemption_handler(self, grace_s: float = 30.0, signum: int = signal.SIGTERM) -> None:
        """On ``signum`` (SIGTERM: what schedulers send before they kill): finish the saves in flight, persist the
        newest step every rank holds to the durable tier, log what was persisted, and exit with 128+signum.
        Every rank must get the signal (torchrun passes it to all its workers). The persist runs against
        ``grace_s``: a deadline the log reports as met or missed."""

        def handler(signo: int, _frame: Any) -> None:
            start = time.monotonic()
            log.warning("rank %d: signal %d: persisting the newest local step within %.0f s", self.rank, signo, grace_s)
            step = None
            try:
                self.wait()
                step = self._persist(None)
            except BaseException as exc:  # noqa: BLE001 - reported, then the process exits as asked
                log.error("rank %d: persisting on signal %d failed: %s", self.rank, signo, exc)
            took = time.monotonic() - start
            log.warning("rank %d: on signal %d persisted step %s to %s in %.2f s (%s the %.0f s grace)", self.rank, signo,
                        step, self.durable.root, took, "within" if took <= grace_s else "past", grace_s)
            os._exit(128 + signo)

        signal.signal(signum, handler)


def _host_state(view: LocalView, device: str) -> dict[str, Any]:
    """Fresh tensors on ``device`` shaped like ``view``'s, in the same structure, and the DTensors to rebuild."""
    dtensors: dict[int, Any] = {}

    def walk(src: Any, local: Any) -> Any:
        if isinstance(src, DTensor):
            t = torch.empty(local.shape, dtype=local.dtype, device=device)
            dtensors[id(t)] = src
            return t
        if isinstance(local, torch.Tensor):
            return torch.empty(local.shape, dtype=local.dtype, device=device)
        if isinstance(local, dict):
            return {k: walk(src.get(k) if isinstance(src, dict) else None, v) for k, v in local.items()}
        if isinstance(local, (list, tuple)):
            out = [walk(src[i] if isinstance(src, (list, tuple)) and i < len(src) else None, v) for i, v in enumerate(local)]
            return out if isinstance(local, list) else tuple(out)
        return local

    sources = {k: (view.statefuls[k][1] if k in view.statefuls else view.state[k]) for k in view.view}
    return {"view": {k: walk(sources.get(k), v) for k, v in view.view.items()}, "dtensors": dtensors}


def _as_saved(state: dict[str, Any]) -> dict[str, Any]:
    """The host state with each DTensor's shard wrapped back as a DTensor of the same mesh and placements."""
    dtensors = state["dtensors"]

    def walk(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and id(obj) in dtensors:
            src = dtensors[id(obj)]
            return DTensor.from_local(obj, src.device_mesh, src.placements, run_check=False, shape=src.shape,
                                      stride=src.stride())
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(walk(v) for v in obj)
        return obj

    return walk(state["view"])


def _stored_bytes(checkpoint_id: str) -> int:
    """The bytes of every chunk and value a committed checkpoint stores, from its metadata (any backend)."""
    data = read_metadata(checkpoint_id).storage_data
    return sum(si.length for si in data.items.values()) if isinstance(data, FileStorageData) else 0
