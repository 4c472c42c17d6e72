"""load() and read_metadata(): the protocol's load call sequence."""

from __future__ import annotations

import os
import warnings
from typing import Any, NamedTuple, Optional, Union

from . import events
from ._sequence import prepare, storage_by_position
from .backends.registry import pick_storage
from .capabilities import SHARED_READS, SHARED_VERIFICATION, declares, keeps_plans, supports
from .distributed import RAW, Coordinator, Wire
from .engine.shared_delivery import answer_failed
from .engine.shared_plan import table_marks
from .engine.shared_reads import PeerLost, Peers, Shares
from .errors import CheckpointError, CorruptCheckpointError
from .format.codec import dumps, loads
from .gc_pause import gc_paused
from .metadata import STATE_DICT_TYPE, Metadata
from .planner import LoadPlan, LoadPlanner
from .planning import DefaultLoadPlanner
from .storage import StorageReader
from .wire.plans import decode_load_plan, encode_load_plan

__all__ = ["load", "load_state_dict", "read_metadata", "LoadResult"]


class LoadResult(NamedTuple):
    """What a load left out, on this rank, as ``torch.nn.Module.load_state_dict`` reports it: keys of the state
    dict the checkpoint lacks (skipped where the planner allows a partial load; else the load raised), and keys
    of the checkpoint the state dict lacks (left unread). Flattened keys, as the checkpoint names them."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def load_state_dict(
    state_dict: STATE_DICT_TYPE,
    storage_reader: StorageReader,
    process_group: Any = None,
    coordinator_rank: int = 0,
    no_dist: bool = False,
    planner: Optional[LoadPlanner] = None,
) -> None:
    """DCP's deprecated name and argument order for :func:`load` (kept so code written for it runs unchanged)."""
    warnings.warn("load_state_dict is deprecated; use distckpt.load(state_dict, storage_reader=...)", FutureWarning,
                  stacklevel=2)
    load(state_dict, storage_reader=storage_reader, process_group=process_group, coordinator_rank=coordinator_rank,
         no_dist=no_dist, planner=planner)


@storage_by_position("storage_reader")
def load(
    state_dict: STATE_DICT_TYPE,
    *,
    checkpoint_id: Union[str, os.PathLike, None] = None,
    storage_reader: Optional[StorageReader] = None,
    planner: Optional[LoadPlanner] = None,
    process_group: Any = None,
    coordinator_rank: int = 0,
    no_dist: bool = False,
) -> Optional[LoadResult]:
    """Load a checkpoint into ``state_dict`` in place, collectively over ``process_group``.

    The state dict says what to load and where: each tensor (plain or DTensor,
    any sharding) is filled from whatever chunks of the checkpoint overlap it,
    so a checkpoint saved at any world size loads at any other. Non-tensor
    values are replaced; Stateful objects get ``load_state_dict`` afterwards.
    Checksums are verified as data is read. ``no_dist`` and the older call
    form ``load(state_dict, storage_reader)`` work as for :func:`save`.

    Returns a :class:`LoadResult` (this rank's missing and unexpected keys) where the planner is a
    DefaultLoadPlanner, which records them; None for other planners (DCP's load returns None).
    """
    coord = Coordinator(process_group, coordinator_rank, no_dist=no_dist)
    coord.begin("load", checkpoint_id)
    coord.arrive("load")
    with events.context(checkpoint_id=events.named(checkpoint_id), rank=coord.rank), events.phase("load", "total"):
        ready = prepare("reader", checkpoint_id, storage_reader, planner, DefaultLoadPlanner, coord.rank, state_dict)
        plain, objects = ready.plain, ready.objects
        with gc_paused():
            run_load(plain, ready.storage, ready.planner, coord, failure=ready.failure)
    for key in sorted(plain, key=str):  # one order on every rank: a load_state_dict may run collectives
        if key in objects:
            objects[key].load_state_dict(plain[key])
        else:  # top-level non-tensor values were replaced in the copy
            state_dict[key] = plain[key]
    if isinstance(ready.planner, DefaultLoadPlanner):
        return LoadResult(list(ready.planner.missing_keys), list(ready.planner.unexpected_keys))
    return None


def run_load(state_dict: STATE_DICT_TYPE, reader: Optional[StorageReader], planner: Optional[LoadPlanner],
             coord: Coordinator, failure: Optional[BaseException] = None) -> None:
    """The load sequence: read metadata, plan locally, plan globally, read (``failure``: as for run_save)."""

    def local_step() -> LoadPlan:
        if failure is not None:
            raise failure
        metadata = reader.read_metadata()
        planner.set_up_planner(state_dict, metadata, coord.is_coordinator)
        reader.set_up_storage_reader(metadata, coord.is_coordinator)
        return reader.prepare_local_plan(planner.create_local_plan())

    def global_step(all_plans: list[LoadPlan]) -> list[LoadPlan]:
        return reader.prepare_global_plan(planner.create_global_plan(all_plans))

    with events.phase("load", "plan"):
        central_plan = _plan(local_step, global_step, reader, planner, coord)

    def read_step() -> None:
        try:
            final_plan = planner.finish_plan(central_plan)
            reader.read_data(final_plan, planner).wait()
        except Exception as exc:
            _answer_peers(reader, exc)
            raise

    failure: Optional[BaseException] = None
    with events.phase("load", "read"):
        try:
            read_step()
        except PeerLost as exc:  # the ranks are out of step: the vote would wait out the timeout again, and hide why
            coord.transport_failed = True
            raise PeerLost(f"{exc} In phase 'load read' of {coord.identity}, this rank waited for {coord.absent()}.") from exc
        except Exception as exc:  # noqa: BLE001 - reported to every rank by the vote
            failure = exc
        coord.vote("load read", failure, False)


def _plan(local_step, global_step, reader: StorageReader, planner: LoadPlanner, coord: Coordinator) -> LoadPlan:
    """Planning: every rank's plan, agreed (the way depends on what the reader declares)."""
    if coord.use_dist and _plans_stay(planner, reader) and _shares_reads(reader):
        # every plan stays as its rank made it; ranks list the chunks they read, so that each chunk several
        # ranks need is read by one of them and sent to the others (engine/shared_reads.py)
        central_plan = _plan_shared_reads(local_step, reader, planner, coord)
    elif coord.use_dist and _plans_stay(planner, reader):
        # every plan stays as its rank made it: planning moves no plan bytes; ranks only list the chunks
        # they read partly, so that one reader of each verifies it whole and the others read just what they need
        central_plan = _plan_with_shared_verification(local_step, reader, coord)
    else:
        wire = Wire(lambda p: dumps(encode_load_plan(p)), lambda b: decode_load_plan(loads(b, "load plan")))
        central_plan = coord.reduce_scatter("load planning", local_step, global_step, wire, wire)
    return central_plan


def _answer_peers(reader: StorageReader, exc: BaseException) -> None:
    """A rank that failed before walking its shared reads (its planner's finish_plan, a reader's check before the
    read engine) still walks them, sending its failure for each chunk it owes, so that no rank waits for it."""
    shares = reader.shares if supports(reader, SHARED_READS) else None
    if isinstance(shares, Shares) and not shares.walked:
        answer_failed(shares, exc)


def _plans_stay(planner: LoadPlanner, reader: StorageReader) -> bool:
    """Whether both global steps declare that they keep plans, and the reader can share verification."""
    return (declares(planner, "create_global_plan", keeps_plans) and declares(reader, "prepare_global_plan", keeps_plans)
            and supports(reader, SHARED_VERIFICATION))


def _shares_reads(reader: StorageReader) -> bool:
    return supports(reader, SHARED_READS) and reader.shares_reads()


def _plan_shared_reads(local_step, reader: StorageReader, planner: LoadPlanner, coord: Coordinator) -> LoadPlan:
    """This rank's plan, once every rank has planned, and its part of the shared reads. One fixed-size vote tells
    whether any rank failed, whether any may read a chunk another rank needs too (a replicated destination, a
    chunk read partly), and which of those ranks hold the same chunk table; only then does the first rank of each
    table send it to the coordinator (ranks of a replicated state send one between them, not one each). A rank that
    may share nothing builds its table only where another may, and sends it."""
    failure: Optional[BaseException] = None
    plan, alone, mark, listed, raw = None, set(), 0, [], b""
    try:
        plan = local_step()
        alone = planner.keys_held_alone() if isinstance(planner, DefaultLoadPlanner) else set()
        if reader.may_share_reads(plan, alone):
            listed, raw = reader.read_chunks(plan, alone)
            mark = table_marks(raw)[0] << 1 | 1  # the table's digest and the flag, in one number of the vote
    except Exception as exc:  # noqa: BLE001 - reported to every rank by the vote
        failure = exc
    marks = coord.vote_values("load planning", failure, mark)
    if not any(marks):
        return plan
    first: dict[int, int] = {}
    for rank, m in enumerate(marks):
        first.setdefault(m if m else -1 - rank, rank)  # a rank that voted 0 sends its own table
    sender = first[mark if mark else -1 - coord.rank] == coord.rank

    def table() -> bytes:
        if not mark:
            listed[:], built = reader.read_chunks(plan, alone)
            raw_of[0] = built
        return raw_of[0] if sender else b""

    def assign(tables: list[bytes]) -> list[bytes]:
        whole = [tables[first[m if m else -1 - r]] for r, m in enumerate(marks)]
        return [table_marks(t)[1].to_bytes(8, "little") + p for t, p in zip(whole, _in_one_mode(reader.assign_readers)(whole))]

    raw_of = [raw]
    answer = coord.reduce_scatter("load planning", table, assign, RAW, RAW)
    collided = None
    if answer[:8] != table_marks(raw_of[0])[1].to_bytes(8, "little"):  # planned on another table of its digest
        collided = CheckpointError("the coordinator planned this rank's shared reads on another rank's chunk table "
                                   "(their digests collided); load again")
    coord.vote("load planning", collided, False)  # every rank raises together, none waits in the exchange
    reader.accept_readers(listed, answer[8:], Peers(coord.group, coord.rank, coord.world_size, coord.device,
                                                    coord.timeout_s))
    return plan


def _plan_with_shared_verification(local_step, reader: StorageReader, coord: Coordinator) -> LoadPlan:
    """This rank's plan, once every rank has planned. One fixed-size vote tells whether any rank failed and
    whether any reads a chunk partly; only then do the ranks exchange their lists of such chunks."""
    failure: Optional[BaseException] = None
    plan, chunks, table = None, [], b""
    try:
        plan = local_step()
        chunks, table = reader.partly_read_chunks(plan)
    except Exception as exc:  # noqa: BLE001 - reported to every rank by the vote
        failure = exc
    if not coord.vote("load planning", failure, bool(chunks)):
        return plan

    mask = coord.reduce_scatter("load planning", lambda: table, _in_one_mode(reader.assign_verifiers), RAW, RAW)
    reader.accept_verifiers(chunks, mask)
    return plan


def _in_one_mode(assign):
    """The coordinator's step over the ranks' chunk tables, its refusal of a table it cannot read said as what it
    means: the ranks' own code wrote them, so the ranks plan in two ways, not the checkpoint is damaged."""
    def run(tables: list[bytes]) -> list[bytes]:
        try:
            return assign(tables)
        except CorruptCheckpointError as exc:
            raise CheckpointError(f"{exc}: the ranks of this load plan their reads in different ways; give every rank "
                                  "the same DISTCKPT_SHARED_READS, and readers of the same shared_reads=") from exc
    return run


def read_metadata(checkpoint_id: Union[str, os.PathLike], storage_reader: Optional[StorageReader] = None) -> Metadata:
    """The metadata of a checkpoint: every key, its shape, dtype and chunks. Reads nothing else."""
    return pick_storage("reader", checkpoint_id, storage_reader).read_metadata()
