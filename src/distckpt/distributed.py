"""The coordinator: collectives over torch.distributed, error aggregation, single-process mode.

Every phase of a save or load runs a function on every rank and exchanges its
outcome, success or failure, with the coordinator. A rank that raises still
takes part in the exchange, so no rank is left waiting; then every rank
raises one :class:`RankFailuresError` naming each failing rank. Payloads are
bytes (JSON plans and results), never pickles.

Every message also carries the identity of the save or load it belongs to:
the operation's number on its process group and its checkpoint id. A rank
whose message belongs to another operation (it skipped or repeated a call)
fails that phase on every rank instead of pairing one save's data with
another's; the operation numbers then resume in step.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import threading
import time
import traceback
import weakref
from datetime import timedelta
from typing import Any, Callable, NamedTuple, Optional, TypeVar

import torch

from . import errors, faults, knobs, process_state
from .errors import (
    CheckpointError,
    ProcessGroupBrokenError,
    RankFailuresError,
    RemoteRankError,
    StalledRanksError,
    WrappedException,
    describe_type,
)
from .stall_census import absent_ranks, named

try:
    import torch.distributed as dist
except ImportError:  # pragma: no cover
    dist = None  # type: ignore[assignment]

T = TypeVar("T")
R = TypeVar("R")


class Wire(NamedTuple):
    """How one direction of a phase travels: ``encode`` a value to bytes on one side, ``decode`` it on the other."""

    encode: Callable[[Any], bytes]
    decode: Callable[[bytes], Any]


RAW = Wire(lambda b: b, lambda b: b)  # values that are bytes already
JSON = Wire(lambda value: json.dumps(value, sort_keys=True).encode(), lambda raw: json.loads(raw.decode("utf-8")))

_OK, _ERR, _ABORT = 0, 1, 2

# bytes this rank sent and received in each phase of its latest save or load, for observability
# (status byte and body; the operation's identity, a constant per message, is not counted)
phase_bytes: dict[str, int] = {}
_IDENTITY_BYTES = 256  # of an operation's identity, in the exchange that names the operations of ranks out of step

# the number of the latest save or load on each process group (weakly keyed: a destroyed group's count goes with it)
_op_numbers: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
_op_numbers_by_id: dict[int, int] = {}
# process groups whose transport failed (torch's backend raised in a collective): gloo tears such a group down, and
# every later collective on it fails at once. Group -> what broke it, for the error of every later call.
_broken: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
_broken_by_id: dict[int, str] = {}

_REBUILD = ("rebuild it (torch.distributed.destroy_process_group() and init_process_group() again; under torchrun, "
            "restart the job), or pass another process_group=")


def _group_key(group: Any) -> tuple[Any, Any]:
    group = group if group is not None else dist.group.WORLD
    try:
        weakref.ref(group)
        return _broken, group
    except TypeError:
        return _broken_by_id, id(group)


def mark_broken(group: Any, reason: str) -> None:
    """Record that ``group``'s transport failed (``reason``): later calls on it raise ProcessGroupBrokenError."""
    table, key = _group_key(group)
    with _op_lock:
        table.setdefault(key, reason)


def broken_reason(group: Any) -> Optional[str]:
    """Why ``group`` can no longer carry collectives, or None."""
    table, key = _group_key(group)
    with _op_lock:
        return table.get(key)
_op_lock = threading.Lock()


def _fresh_lock_in_child() -> None:
    global _op_lock
    _op_lock = threading.Lock()  # a parent's thread may have held it at the fork


process_state.on_fork_child(_fresh_lock_in_child)


class Coordinator:
    """Runs checkpoint phases across the ranks of ``process_group``.

    ``coordinator_rank`` is a rank within the group. Without an initialised
    process group, or with ``no_dist``, this is a group of one and no
    collective is called.
    """

    def __init__(self, process_group: Any = None, coordinator_rank: int = 0, timeout_s: Optional[float] = None,
                 no_dist: bool = False):
        self.timeout_s = timeout_s if timeout_s is not None else knobs.collective_timeout_s()
        self.use_dist = not no_dist and dist is not None and dist.is_available() and dist.is_initialized()
        self.group = process_group
        if self.use_dist:
            self.rank = dist.get_rank(process_group)
            self.world_size = dist.get_world_size(process_group)
            if not 0 <= coordinator_rank < self.world_size:
                raise CheckpointError(f"coordinator_rank {coordinator_rank} is outside the group of {self.world_size} ranks")
            self._dst = dist.get_global_rank(process_group, coordinator_rank) if process_group is not None else coordinator_rank
            backend = str(dist.get_backend(process_group)).lower()
            if "nccl" in backend and torch.cuda.is_available():
                self.device = torch.device("cuda", torch.cuda.current_device())
            else:
                self.device = torch.device("cpu")
        else:
            self.rank, self.world_size, self._dst = 0, 1, 0
            self.device = torch.device("cpu")
        if self.world_size == 1:  # a group of one: nothing to exchange, skip encoding plans for transport
            self.use_dist = False
        self.coordinator_rank = coordinator_rank
        self.is_coordinator = self.rank == coordinator_rank
        self.identity = ""
        self.transport_failed = False  # a collective timed out or broke: this group is no longer in step
        self._number: Optional[int] = None
        self._own_failure: Optional[BaseException] = None  # raised by this rank's global step, if it failed
        self._phase = ""  # the phase whose collectives run now, for the error of one that stalls
        faults.set_rank(self.rank)

    def begin(self, operation: str, checkpoint_id: Any = None, number: Optional[int] = None) -> str:
        """Name the save or load this coordinator runs; every message of it carries the name.

        ``number`` defaults to the next operation number on this process group
        (every rank counts the saves and loads it takes part in).
        """
        if number is None:
            number = self._next_number()
        self._number = number
        where = "" if checkpoint_id is None else f" of {str(checkpoint_id)!r:.200}"
        self.identity = f"{operation} #{number}{where}"
        return self.identity

    def arrive(self, operation: str) -> None:
        """Wait, at most DISTCKPT_ARRIVAL_TIMEOUT_S, until every rank of the group has called this ``operation``
        (save or load), before any of them does work that the others would wait for."""
        if not self.use_dist:
            return
        self._check_not_broken(operation)
        self._phase = "arrival"
        limit = min(knobs.arrival_timeout_s(), self.timeout_s)
        mine = self._row(0, 0)
        out = [torch.zeros_like(mine) for _ in range(self.world_size)]
        table = None
        begun = time.monotonic()
        try:
            if dist.all_gather(out, mine, group=self.group, async_op=True).wait(timeout=timedelta(seconds=limit)):
                table = [r.cpu().tolist() for r in out]
            reason: object = "timed out"
        except CheckpointError:
            self.transport_failed = True
            raise
        except Exception as exc:  # gloo raises on its timeout; a dead peer raises too
            reason = exc
            if isinstance(exc, RuntimeError) and time.monotonic() - begun < 0.9 * limit:
                # no rank waited: the group itself failed (a peer died, or an earlier collective tore it down)
                self.transport_failed = True
                mark_broken(self.group, f"{self.identity} on rank {self.rank}: {exc}")
                raise ProcessGroupBrokenError(
                    f"{self.identity}: the process group failed at once on rank {self.rank} ({exc}): a rank died, or "
                    f"an earlier collective timed out and torch's backend tore the group down. It can no longer carry "
                    f"collectives; {_REBUILD}.") from exc
        if table is not None:
            self._in_step(operation, table)  # ranks in other operations: raised alike on every rank, still in step
            return
        self.transport_failed = True
        absent = absent_ranks(self.group, self.identity, self.rank, self.world_size, limit)
        raise StalledRanksError(
            f"{self.identity}, phase arrival: rank {self.rank} waited {limit:.0f}s for {named(absent)} to call "
            f"{operation} ({reason}). Every rank of the group must call {operation}; to {operation} from one process "
            f"alone, pass no_dist=True. If ranks arrive this far apart, raise DISTCKPT_ARRIVAL_TIMEOUT_S.",
            "arrival", absent or (), limit)

    @property
    def number(self) -> int:
        """This operation's number on its process group (0 before :meth:`begin`, or alone)."""
        return self._number or 0

    def _counts(self) -> tuple[Any, Any]:
        """Where this group's operation count lives, and its key there (groups that take no weak
        reference are counted by id, for the life of the process)."""
        group = self.group if self.group is not None else dist.group.WORLD
        try:
            weakref.ref(group)
            return _op_numbers, group
        except TypeError:
            return _op_numbers_by_id, id(group)

    def _next_number(self) -> int:
        if not self.use_dist:
            return 0
        with _op_lock:
            counts, key = self._counts()
            number = counts.get(key, 0) + 1
            counts[key] = number
            return number

    def _resume_at(self, number: int) -> None:
        """After operations out of step: count on from the highest number any rank reached."""
        if self.use_dist and self._number is not None:
            with _op_lock:
                counts, key = self._counts()
                counts[key] = max(counts.get(key, 0), number)

    # ------------------------------------------------------------ phases

    def reduce_scatter(self, phase: str, local_fn: Callable[[], T], global_fn: Callable[[list[T]], list[R]],
                       up: Wire, down: Wire) -> R:
        """local_fn on every rank; global_fn on the coordinator over all results; each rank gets its own part.

        ``up`` carries each rank's result to the coordinator, ``down`` each rank's part back.
        """
        enc_local, dec_local, enc_out, dec_out = up.encode, up.decode, down.encode, down.decode
        if not self.use_dist:
            return self._single(phase, lambda: global_fn([local_fn()])[0])
        local, local_exc = self._run(local_fn, enc_local)
        gathered = self._gather(phase, local)
        outs: Optional[list[bytes]] = None
        framing = 2 + len(self.identity.encode())
        phase_bytes[phase] = len(local) - framing
        if self.is_coordinator:
            values, failure = self._decode_all(gathered, dec_local)
            if failure is None:
                try:
                    results = global_fn(values)
                    if len(results) != self.world_size:
                        raise CheckpointError(f"global planning returned {len(results)} plans for {self.world_size} ranks")
                    outs = [self._frame(_OK, enc_out(r)) for r in results]
                except Exception as exc:  # noqa: BLE001 - reported to every rank
                    failure = self._abort({self.rank: self._own(exc)})
            if failure is not None:
                outs = [failure] * self.world_size
        mine = self._scatter(outs)
        phase_bytes[phase] += len(mine) - framing
        return self._unwrap(phase, mine, dec_out, local_exc)

    def all_reduce(self, phase: str, local_fn: Callable[[], T], global_fn: Callable[[list[T]], R], up: Wire, down: Wire) -> R:
        """local_fn on every rank; global_fn on the coordinator; its one result goes to every rank (``up``, ``down``:
        as for :meth:`reduce_scatter`)."""
        enc_local, dec_local, enc_out, dec_out = up.encode, up.decode, down.encode, down.decode
        if not self.use_dist:
            return self._single(phase, lambda: global_fn([local_fn()]))
        local, local_exc = self._run(local_fn, enc_local)
        gathered = self._gather(phase, local)
        out: Optional[bytes] = None
        if self.is_coordinator:
            values, failure = self._decode_all(gathered, dec_local)
            if failure is None:
                try:
                    out = self._frame(_OK, enc_out(global_fn(values)))
                except Exception as exc:  # noqa: BLE001
                    failure = self._abort({self.rank: self._own(exc)})
            if failure is not None:
                out = failure
        return self._unwrap(phase, self._broadcast(out), dec_out, local_exc)

    def vote(self, phase: str, failure: Optional[BaseException], flag: bool) -> bool:
        """Whether any rank raised ``flag``, in one small all_gather, unless a rank brings ``failure``
        or is in another operation: then every rank raises, naming who and why (a second exchange)."""
        return any(self.vote_values(phase, failure, int(flag)))

    def vote_values(self, phase: str, failure: Optional[BaseException], value: int) -> list[int]:
        """Every rank's ``value`` (0 to 2**63 - 1), in the vote's one small all_gather (see :meth:`vote`)."""
        if not 0 <= value < 1 << 63:
            raise CheckpointError(f"checkpoint {phase}: a vote carries a number from 0 to 2**63 - 1, not {value}")
        if not self.use_dist:
            if failure is not None:
                self._single(phase, lambda: _raise(failure))
            return [value]
        table = self._rows(phase, int(failure is not None), value)
        if not any(r[0] for r in table):
            return [r[1] for r in table]

        def local() -> bytes:
            if failure is not None:
                raise failure
            return b""

        self.all_reduce(phase, local, lambda _: b"", RAW, RAW)
        raise CheckpointError(f"checkpoint {phase}: the ranks disagree, but the exchange naming why found nothing")

    def all_gather(self, phase: str, local_fn: Callable[[], None]) -> None:
        """local_fn on every rank; raise on every rank if any failed.

        Where every rank succeeded, that takes one fixed-size exchange (:meth:`vote`); only a failure costs the
        exchange that names it."""
        failure: Optional[BaseException] = None
        try:
            local_fn()
        except Exception as exc:  # noqa: BLE001 - reported to every rank by the vote
            failure = exc
        self.vote(phase, failure, False)

    # ------------------------------------------------------------ helpers

    def _single(self, phase: str, fn: Callable[[], Any]) -> Any:
        """fn alone. With no other rank to tell, its error keeps its own type name and message, said once: one of
        the CheckpointError family is raised as that class (joined with RankFailuresError, DCP's
        CheckpointException, so code written for either catches it); any other error becomes a
        RankFailuresError that quotes it. The traceback is where the error was raised."""
        try:
            return fn()
        except RankFailuresError:
            raise
        except Exception as exc:
            error = RankFailuresError.of(phase, {self.rank: exc}, single=True)
            raise error.with_traceback(exc.__traceback__) from None

    def _frame(self, status: int, body: bytes) -> bytes:
        """A message: status byte, this operation's identity (length-prefixed), body."""
        ident = self.identity.encode()
        return bytes([status]) + len(ident).to_bytes(2, "big") + ident + body

    @staticmethod
    def _unframe(raw: bytes) -> tuple[int, str, bytes]:
        n = int.from_bytes(raw[1:3], "big")
        return raw[0], raw[3:3 + n].decode(errors="replace"), raw[3 + n:]

    def _own(self, exc: BaseException) -> dict:
        """Describe an exception this rank raised, keeping it to raise in place of its rebuilt copy."""
        self._own_failure = exc
        return describe(exc)

    def _abort(self, failures: dict[int, dict], resume: Optional[int] = None) -> bytes:
        info: dict[str, Any] = {"failures": {str(r): v for r, v in failures.items()}}
        if resume is not None:
            info["resume"] = resume
        return self._frame(_ABORT, json.dumps(info).encode())

    def _run(self, fn: Callable[[], T], enc: Callable[[T], bytes]) -> tuple[bytes, Optional[BaseException]]:
        try:
            return self._frame(_OK, enc(fn())), None
        except Exception as exc:  # noqa: BLE001 - every failure is reported to the group
            return self._frame(_ERR, json.dumps(describe(exc)).encode()), exc

    def _decode_all(self, gathered: list[bytes], dec: Callable[[bytes], T]) -> tuple[list[T], Optional[bytes]]:
        failures: dict[int, dict] = {}
        values: list = []
        strangers: dict[int, str] = {}
        for rank, raw in enumerate(gathered):
            status, ident, body = self._unframe(raw)
            if ident != self.identity:
                strangers[rank] = ident
            if status == _OK:
                values.append(body)
            else:
                failures[rank] = json.loads(body.decode())
        if strangers:
            return [], self._out_of_step(strangers, failures)
        if failures:
            return [], self._abort(failures)
        decoded = []
        try:
            decoded = [dec(v) for v in values]
        except Exception as exc:  # noqa: BLE001
            return [], self._abort({self.rank: self._own(exc)})
        return decoded, None

    def _out_of_step(self, strangers: dict[int, str], failures: dict[int, dict]) -> bytes:
        """The failure of a phase whose ranks are in different saves or loads (and what else failed in it)."""
        numbers = [self.number]
        for rank, ident in strangers.items():
            own = failures.get(rank)
            failures[rank] = describe(CheckpointError(
                ("" if own is None else f"{own['type']}: {own['msg']}; and ") + self._out_of_step_message(rank, ident)))
            number = ident.partition("#")[2].split(" ", 1)[0]
            if number.isdigit():
                numbers.append(int(number))
        return self._abort(failures, resume=max(numbers))

    def _unwrap(self, phase: str, raw: bytes, dec: Callable[[bytes], R], local_exc: Optional[BaseException]) -> R:
        status, ident, body = self._unframe(raw)
        if ident != self.identity and status == _OK:
            self.transport_failed = True
            raise CheckpointError(
                f"rank {self.rank} in {self.identity} got the coordinator's reply for {ident or 'another operation'} "
                f"in checkpoint {phase}: the ranks' collectives are out of step; this group cannot be used for "
                "checkpoints until every rank has restarted its checkpoint calls")
        if status == _OK:
            return dec(body)
        info = json.loads(body.decode())
        if "resume" in info:
            self._resume_at(int(info["resume"]))
        failures = {int(r): rebuild(v) for r, v in info["failures"].items()}
        own = local_exc if local_exc is not None else self._own_failure
        if own is not None and self.rank in failures:
            failures[self.rank] = WrappedException(own, traceback.extract_tb(own.__traceback__))
        self._own_failure = None
        raise RankFailuresError.of(phase, failures) from local_exc

    # ------------------------------------------------------------ byte transport

    def _check_not_broken(self, what: str) -> None:
        reason = broken_reason(self.group) if self.use_dist else None
        if reason is not None:
            self.transport_failed = True
            raise ProcessGroupBrokenError(
                f"{self.identity or what}: the process group broke earlier ({reason}) and can no longer carry "
                f"collectives; {_REBUILD}. Nothing was written or read by this call.")

    def _collective(self, fn: Callable[[], Any]) -> Any:
        self._check_not_broken("a checkpoint collective")
        begun = time.monotonic()
        try:
            faults.point("collective", f"{self.identity}: {self._phase}")
            return fn()
        except CheckpointError:
            self.transport_failed = True
            raise
        except Exception as exc:
            self.transport_failed = True
            # torch's backend failed before any wait ran out: a peer died, or the group was torn down
            at_once = isinstance(exc, RuntimeError) and time.monotonic() - begun < 0.9 * self.timeout_s
            if at_once:
                mark_broken(self.group, f"{self.identity} on rank {self.rank}: {exc}")
            raise self._stalled(exc, at_once) from exc

    def _stalled(self, exc: BaseException, at_once: bool) -> CheckpointError:
        """The error of a collective that failed (``at_once``) or waited out the timeout: the phase, and the ranks
        that did not report reaching it to the group's store; the live ranks report there as they fail."""
        # a group torn down fails every rank at once: who reported is looked up, not waited for (the error stays
        # immediate); a wait that ran out gives the others a grace to report theirs
        absent = absent_ranks(self.group, self.identity, self.rank, self.world_size, 0.0 if at_once else self.timeout_s)
        where = f"{self.identity}, phase {self._phase or 'unknown'!r}: rank {self.rank}"
        if at_once:
            return ProcessGroupBrokenError(
                f"{where}: a collective failed at once ({exc}), waiting for {named(absent)}. A rank died, or an "
                f"earlier collective timed out and torch's backend tore the group down; the group can no longer carry "
                f"collectives: {_REBUILD}.")
        return StalledRanksError(
            f"{where} waited {self.timeout_s:.0f}s (DISTCKPT_TIMEOUT_S) for {named(absent)} ({exc}). A rank that is "
            f"stopped, hung or dead never reaches the phase: check its log; if it was only slow, raise "
            f"DISTCKPT_TIMEOUT_S.", self._phase, absent or (), self.timeout_s)

    def absent(self) -> str:
        """The ranks that have not reported failing in this operation, in words, once this rank has: for a wait
        outside the coordinator (a shared read) that failed, so that it names the ranks it waited for."""
        return named(absent_ranks(self.group, self.identity, self.rank, self.world_size, self.timeout_s))

    def _wait(self, work: Any) -> None:
        """Wait for a collective, at most the configured timeout (DISTCKPT_TIMEOUT_S or the constructor's)."""
        if not work.wait(timeout=timedelta(seconds=self.timeout_s)):
            raise TimeoutError(f"a collective did not finish within {self.timeout_s:.0f}s")

    def _to_tensor(self, payload: bytes, size: int) -> torch.Tensor:
        t = torch.zeros(size, dtype=torch.uint8)
        if payload:
            t[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return t.to(self.device)

    def _row(self, a: int, b: int) -> torch.Tensor:
        """This rank's row of a phase's first exchange: two numbers of the phase's own, then the operation's
        number and a hash of its identity."""
        tag = int.from_bytes(hashlib.blake2b(self.identity.encode(), digest_size=7).digest(), "big")
        return torch.tensor([a, b, self.number, tag], dtype=torch.int64, device=self.device)

    def _rows(self, phase: str, a: int, b: int) -> list[list[int]]:
        """Every rank's row (:meth:`_row`), once the ranks are known to be in one operation.

        Every phase of every operation begins with this exchange, of one shape: ranks whose calls are out of
        step (one loads while another saves) meet in a collective of one size, and find out together. Where
        the sizes differed, gloo would end the process instead of raising."""
        self._phase = phase
        mine = self._row(a, b)
        rows = [torch.zeros_like(mine) for _ in range(self.world_size)]
        self._collective(lambda: self._wait(dist.all_gather(rows, mine, group=self.group, async_op=True)))
        table = [r.cpu().tolist() for r in rows]
        self._in_step(phase, table)
        return table

    def _in_step(self, phase: str, table: list[list[int]]) -> None:
        """Raise on every rank alike where the rows of one exchange come from different operations, naming each
        rank's; every rank then numbers its next operation alike (the highest number any rank reached)."""
        ref = table[self.coordinator_rank][3]
        if all(r[3] == ref for r in table):
            return
        names = self._identities()
        failures = {rank: CheckpointError(self._out_of_step_message(rank, names[rank], names[self.coordinator_rank]))
                    for rank, row in enumerate(table) if row[3] != ref}
        self._resume_at(max(row[2] for row in table))
        raise RankFailuresError.of(phase, failures)

    def _out_of_step_message(self, rank: int, theirs: str, coordinators: Optional[str] = None) -> str:
        """Why rank ``rank``, in operation ``theirs``, failed this phase: the coordinator is in another."""
        return (f"rank {rank} is in {theirs or 'no distckpt operation'} while the coordinator (rank "
                f"{self.coordinator_rank}) is in {coordinators if coordinators is not None else self.identity}: the "
                "ranks' save/load calls are out of step (a rank skipped or repeated a call, or passed another "
                "checkpoint_id); nothing was written by this call, and the next call on every rank is numbered "
                "alike again")

    def _identities(self) -> list[str]:
        """Every rank's operation identity, in one fixed-size exchange (the first 256 bytes of each)."""
        mine = torch.zeros(_IDENTITY_BYTES, dtype=torch.uint8)
        raw = self.identity.encode()[:_IDENTITY_BYTES]
        if raw:
            mine[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        mine = mine.to(self.device)
        out = [torch.zeros_like(mine) for _ in range(self.world_size)]
        self._collective(lambda: self._wait(dist.all_gather(out, mine, group=self.group, async_op=True)))
        return [bytes(t.cpu().tolist()).rstrip(b"\0").decode(errors="replace") for t in out]

    def _gather(self, phase: str, payload: bytes) -> Optional[list[bytes]]:
        sizes = [row[1] for row in self._rows(phase, 0, len(payload))]

        def run():
            m = max(sizes)
            t = self._to_tensor(payload, m)
            bufs = [torch.empty(m, dtype=torch.uint8, device=self.device) for _ in range(self.world_size)] if self.is_coordinator else None
            self._wait(dist.gather(t, bufs, dst=self._dst, group=self.group, async_op=True))
            if not self.is_coordinator:
                return None
            return [b[:s].cpu().numpy().tobytes() for b, s in zip(bufs, sizes)]
        return self._collective(run)

    def _scatter(self, payloads: Optional[list[bytes]]) -> bytes:
        def run():
            sizes = torch.tensor([len(p) for p in payloads] if self.is_coordinator else [0] * self.world_size,
                                 dtype=torch.int64, device=self.device)
            self._wait(dist.broadcast(sizes, src=self._dst, group=self.group, async_op=True))
            sizes_l = [int(x) for x in sizes.cpu().tolist()]
            m = max(sizes_l)
            out = torch.empty(m, dtype=torch.uint8, device=self.device)
            lst = [self._to_tensor(p, m) for p in payloads] if self.is_coordinator else None
            self._wait(dist.scatter(out, lst, src=self._dst, group=self.group, async_op=True))
            return out[: sizes_l[self.rank]].cpu().numpy().tobytes()
        return self._collective(run)

    def _broadcast(self, payload: Optional[bytes]) -> bytes:
        def run():
            n = torch.tensor([len(payload) if self.is_coordinator else 0], dtype=torch.int64, device=self.device)
            self._wait(dist.broadcast(n, src=self._dst, group=self.group, async_op=True))
            size = int(n.item())
            t = self._to_tensor(payload if self.is_coordinator else b"", size)
            self._wait(dist.broadcast(t, src=self._dst, group=self.group, async_op=True))
            return t.cpu().numpy().tobytes()
        return self._collective(run)


def new_gloo_group(ranks: Optional[list[int]]) -> Any:
    """A gloo group over ``ranks`` (None: every rank) whose own operations end at the checkpoint timeout
    (``DISTCKPT_TIMEOUT_S``), not torch's default 30 minutes. Collective: every rank of the job calls it."""
    return dist.new_group(ranks=ranks, backend="gloo", timeout=timedelta(seconds=knobs.collective_timeout_s()))


def describe(exc: BaseException) -> dict:
    """An exception as JSON for the other ranks: its type, text, plain arguments and stack (no pickle)."""
    args = list(exc.args) if all(isinstance(a, (str, int, float, bool, type(None))) for a in exc.args) else None
    stack = [[f.filename, f.lineno, f.name, f.line or ""] for f in traceback.extract_tb(exc.__traceback__)]
    return {"module": type(exc).__module__, "type": describe_type(exc), "msg": str(exc) or repr(exc), "args": args,
            "tb": stack}


def rebuild(info: dict) -> WrappedException:
    """The exception another rank described, as an instance of its own type where that type is allowed here:
    a built-in exception or one of distckpt's errors; any other becomes a RemoteRankError."""
    module, name, msg = info.get("module"), str(info.get("type")), str(info.get("msg"))
    kind: Any = None
    if module == "builtins":
        kind = getattr(builtins, name, None)
    elif module == errors.__name__ and name in errors.__all__:
        kind = getattr(errors, name)
    stack = traceback.StackSummary.from_list([tuple(f) for f in info.get("tb") or []])
    if not (isinstance(kind, type) and issubclass(kind, BaseException)) or issubclass(kind, (RankFailuresError, RemoteRankError)):
        return WrappedException(RemoteRankError(f"{module}.{name}" if module else name, msg), stack)
    exc = _construct(kind, info.get("args"), msg)
    return WrappedException(exc if exc is not None else RemoteRankError(name, msg), stack)


def _construct(kind: type, args: Optional[list], msg: str) -> Optional[BaseException]:
    """``kind(*args)``, else ``kind(msg)``: the exception as its rank had it, or None if neither works."""
    for attempt in ([args] if args is not None else []) + [[msg]]:
        try:
            exc = kind(*attempt)
        except Exception:  # noqa: BLE001 - a type whose constructor wants other arguments
            continue
        if isinstance(exc, kind):
            return exc
    return None


def _raise(exc: BaseException) -> None:
    raise exc
