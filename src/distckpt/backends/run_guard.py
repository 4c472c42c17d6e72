"""Deleters and referencing saves of one run exclude each other, with no lock: each publishes a record, then looks
for the other's.

An incremental save commits a document that references data files of earlier steps. A deleter (retention,
``delete``, the sweep of retired steps, the drop of a save an overwrite replaced) decides what to keep from the
documents committed when it reads them (its mark), then deletes the rest. A deleter that stalls between its mark
and its deletes for longer than a whole incremental save would delete files that save's new commit references, and
a check of the references at that commit cannot see a deletion that has not happened yet.

So both publish records in the run's root, as leases (``leases.py``: renewed while their holder runs, and proven
dead by the same rules) of a pseudo-checkpoint named :data:`RUN_RECORDS`:

- a deleter publishes ``delete-<token>`` before it reads what savers are live, and drops it when its deletes are
  done. If a referencing save is live, it deletes nothing that any document might come to reference: a deleted
  step is retired keeping all its files, sweeps and overwrites keep everything (the next deleter removes it);
- a save that would reference files of earlier steps publishes ``reference-<token>`` before it reads what
  deleters are live, and drops it once its document is committed (or the save is discarded). If a deleter is live,
  it writes every chunk and references nothing.

Each side writes its record before it reads the other's, so of a deleter and a save that overlap at least one sees
the other (the two writes and the two reads cannot all come before each other's). A deleter looks before it reads
what the committed steps reference: a save it misses committed before the look, or saw the deleter. What stays
open (docs/format.md, section 6): a deleter on another host that is stopped (not dead) between its check and its
deletes for longer than ``DISTCKPT_LEASE_STALE_S``, whose record then counts as a dead holder's, and a deleter on a
full store, which cannot write its record.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from typing import Iterator, Optional

from ..engine.blobs import LEASES, REFERENCES, BlobStore
from ..errors import CheckpointError
from .leases import Lease, is_holder_record, lease_is_dead

__all__ = ["RUN_RECORDS", "DELETE", "REFERENCE", "deleting", "referencing", "live", "drop_dead", "records_store"]

RUN_RECORDS = ".distckpt-run"  # the pseudo-checkpoint whose leases are the run's records (hidden: no step's name)
DELETE = "delete-"
REFERENCE = "reference-"
log = logging.getLogger("distckpt")


def records_store(run: Optional[BlobStore]) -> Optional[BlobStore]:
    """Where the records of the run rooted at ``run`` are kept; None where the store keeps no leases or no
    references between checkpoints (nothing to guard)."""
    if run is None or not {LEASES, REFERENCES} <= run.capabilities:
        return None
    return run.child(RUN_RECORDS)


def live(records: BlobStore, kind: str) -> bool:
    """Whether a record of ``kind`` (:data:`DELETE` or :data:`REFERENCE`) in ``records`` has a live holder. A record
    proven dead is dropped on the way (its holder is gone; see ``leases.py``); one that is no holder's record (not
    a regular file, not the JSON distckpt writes) is not distckpt's: it counts for nothing and is left alone."""
    found = False
    for token in records.lease_ids():
        if not token.startswith(kind):
            continue
        lease = records.read_lease(token)
        if lease is None or not is_holder_record(lease[0]):
            continue
        if lease_is_dead(token, *lease):
            records.drop_lease(token)
        else:
            found = True
    return found


def drop_dead(run: Optional[BlobStore]) -> None:
    """Drop the records in the run rooted at ``run`` whose holders are proven dead (a deleter or a save that
    crashed): what a restart's cleanup does, so that a run left alone holds no record."""
    records = records_store(run)
    if records is not None:
        live(records, DELETE)
        live(records, REFERENCE)


def _publish(records: BlobStore, kind: str) -> Lease:
    return Lease(records, kind + secrets.token_hex(12))


class Deleting:
    """A deleter's record, held for the whole of its mark and deletes (:func:`deleting`)."""

    def __init__(self, records: Optional[BlobStore]) -> None:
        self.records = records

    def savers_live(self) -> bool:
        """Whether a save that may reference files of this run is in flight: the deleter then keeps everything.

        A deleter whose record could not be written (a full store) still looks: a save on that store cannot write its
        own record either, and then writes every chunk. Keeping everything there instead would leave a full disk
        full for good (docs/format.md, section 6, says what stays open)."""
        return self.records is not None and live(self.records, REFERENCE)


@contextlib.contextmanager
def deleting(run: Optional[BlobStore]) -> Iterator[Deleting]:
    """Hold a deleter's record in the run rooted at ``run`` while the block runs; the block asks
    :meth:`Deleting.savers_live` after its mark and, if True, deletes nothing a document may reference."""
    records = records_store(run)
    lease = None
    if records is not None:
        try:
            lease = _publish(records, DELETE)
        except (OSError, CheckpointError) as exc:
            log.warning("distckpt: %s: the deleter's record could not be written (%s); it deletes unseen by saves "
                        "in flight", records.describe(), exc)
    try:
        yield Deleting(records)
    except Exception:
        _release(lease)  # a deleter that failed deletes no more: its record would only hold saves back
        raise
    except BaseException:
        if lease is not None:
            lease.abandon()  # interrupted: the record names this process, seen dead once it is
        raise
    _release(lease)


def _release(lease: Optional[Lease]) -> None:
    if lease is not None:
        try:
            lease.release()
        except (OSError, CheckpointError):
            lease.abandon()  # left behind: a dead holder's to every reader, as after a crash


class Referencing:
    """A referencing save's record (:func:`referencing`); ``allowed`` says whether the save may reference."""

    def __init__(self, lease: Optional[Lease], allowed: bool) -> None:
        self.lease, self.allowed = lease, allowed

    def release(self) -> None:
        """Drop the record (idempotent): once the save's document is committed, or the save is discarded."""
        lease, self.lease = self.lease, None
        _release(lease)


def referencing(run: Optional[BlobStore]) -> Referencing:
    """Publish a referencing save's record in the run rooted at ``run`` and decide whether the save may reference
    files of earlier steps: not while a deleter is live, nor where the record cannot be written (the save then
    writes every chunk). Where the run keeps no records (``run`` None, or a store that declares no leases),
    references are allowed and deleters go unguarded, as before there were records."""
    records = records_store(run)
    if records is None:
        return Referencing(None, True)
    try:
        lease = _publish(records, REFERENCE)
    except (OSError, CheckpointError) as exc:  # unseen by deleters, the save must reference nothing
        log.warning("distckpt: %s: the save's record could not be written (%s); it writes every chunk",
                    records.describe(), exc)
        return Referencing(None, False)
    try:
        deleter = live(records, DELETE)
    except (OSError, CheckpointError) as exc:  # the look failed: the save writes every chunk, holding no deleter back
        log.warning("distckpt: %s: looking for deleters failed (%s); the save writes every chunk", records.describe(), exc)
        deleter = True
    except BaseException:
        _release(lease)
        raise
    guard = Referencing(lease, not deleter)
    if deleter:
        guard.release()
    return guard
