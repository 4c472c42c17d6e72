"""A rank's steps in its node's tier: where a step received from a peer lands, how it takes its place, and what a
step records of itself.

A step received from a peer lands in a leased staging area beside its place (a sweep of another process leaves it
alone while this one lives) and takes its place by a rename; an older copy of the same step is replaced only
then. Whatever sits at a step's place that is not a committed step is moved aside, never deleted.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any, NamedTuple, Optional

from .. import faults
from ..backends.filesystem import FsStore
from ..backends.fs_objects import is_real_dir
from ..backends.leases import Lease
from ..errors import CheckpointError
from ..loading import load
from .exchange import reuse_spare

__all__ = ["RECORD", "Incoming", "receive_into", "commit", "discard", "make_room", "record_of"]

log = logging.getLogger("distckpt.tiers")
RECORD = "distckpt_tier"  # the key of the value each tier step stores about itself (run, save, rank, layout)


class Incoming(NamedTuple):
    """A step being received: the store of its place, its staging area, and the lease that guards it."""

    store: FsStore
    staging: FsStore
    lease: Lease


def receive_into(final: str, spare: Optional[str], manifest: list[list[Any]]) -> Incoming:
    """A leased staging area beside ``final`` to receive a step into (made from ``spare`` where one is kept)."""
    store = FsStore(final)
    save_id = uuid.uuid4().hex
    faults.point("write", f"tier staging of {final}")
    lease = Lease(store, save_id)
    staging = store.staging(save_id)
    try:
        if spare is not None and is_real_dir(spare):
            reuse_spare(spare, staging.root, manifest)
        else:
            os.mkdir(staging.root, 0o700)
    except BaseException:
        discard(Incoming(store, staging, lease))
        raise
    return Incoming(store, staging, lease)


def make_room(final: str) -> None:
    """Where ``final`` holds something that is not a committed step (what a crash left half-deleted, a file, a
    link), move it aside under a hidden name: nothing is deleted, and the step's place is free."""
    if not os.path.lexists(final):
        return
    try:
        FsStore(final).check_replaceable()
        return
    except CheckpointError:
        pass
    aside = os.path.join(os.path.dirname(final), f".aside-{uuid.uuid4().hex[:12]}-{os.path.basename(final)}")
    os.rename(final, aside)
    log.warning("%s is not a committed step (left by a crash, or put there); moved aside to %s", final, aside)


def commit(incoming: Incoming) -> None:
    """Put a received step in place (replacing an older copy of the same step), then give its lease back."""
    try:
        make_room(incoming.store.root)
        incoming.store.commit(incoming.staging, overwrite=True, sync=False)
    except BaseException:
        discard(incoming)
        raise
    incoming.lease.release()


def discard(incoming: Incoming) -> None:
    try:
        incoming.store.discard(incoming.staging)
    finally:
        incoming.lease.release()


def record_of(path: str) -> dict[str, Any]:
    """The tier's record stored in the step at ``path`` ({} where there is no committed step there)."""
    if not FsStore(path).is_committed():
        return {}
    holder: dict[str, Any] = {RECORD: {"fingerprint": "", "run": "", "save": ""}}
    load(holder, checkpoint_id=path, no_dist=True)
    return holder[RECORD]
