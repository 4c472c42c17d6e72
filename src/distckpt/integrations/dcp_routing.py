"""Send a framework's calls of torch.distributed.checkpoint to distckpt, with one line.

Frameworks that checkpoint through DCP themselves (accelerate's FSDP helpers, Lightning's strategies)
call ``torch.distributed.checkpoint.save``/``load``/``async_save`` with DCP's own classes. After
``route_dcp_calls()`` those calls are distckpt's (the classes are swapped for distckpt's with their
options, see :mod:`distckpt.torch_classes`), until the returned object is closed; as a context manager,
for the block only::

    distckpt.integrations.dcp_routing.route_dcp_calls()      # the rest of the process
    with route_dcp_calls():                                    # or one block
        accelerator.save_state(output_dir)

Routed saves keep DCP's replace-on-save: a save given only a ``checkpoint_id`` replaces a committed
checkpoint there (atomically: the old one stays whole until the new one commits), because frameworks
written for DCP save ``last.ckpt`` or ``pytorch_model_fsdp_0`` again and again into one folder. That
includes a checkpoint DCP itself wrote there before the switch to distckpt (a folder holding only its
``.metadata`` and ``__<rank>_<n>.distcp`` files): it is replaced by distckpt's, so a run that changes
to distckpt goes on saving where it saved. ``route_dcp_calls(overwrite=False)`` keeps distckpt's
refusal instead. A save given a storage writer follows that writer's own setting.

Nesting: routings may be opened inside one another. The one opened last and still open decides
``overwrite`` (for its block, in every thread); when it closes, the setting of the one that was in force
before holds again, and DCP's own functions come back when the last one closes.

What was routed is told: the first routed call after routing begins logs one line (INFO, logger
``distckpt``) naming DCP's function, that distckpt handled it, and, for a save, where and in which format it
saves (a framework's log names DCP's calls, whose files these are not), as does the first save where a load
came first; later ones log at DEBUG; every
routing counts the calls routed while it was open (``routing.calls``, by function in
``routing.counts``), and :func:`routed_calls` gives the count of the whole process.

Only the module attributes are replaced: code that bound DCP's functions to its own names before the
call (``from torch.distributed.checkpoint import save``) keeps DCP's.

Only what calls DCP is routed, and a framework that does not call it is not told about: on CPU, accelerate
(1.15) drops an ``fsdp_plugin`` silently (it takes FSDP only on accelerators, ``accelerate/state.py``), wraps
the model in DDP, and ``Accelerator.save_state`` writes its own ``model.safetensors`` and ``optimizer.bin``
with no DCP call: nothing is routed, and nothing fails. ``routing.calls == 0`` after a save says so.
Lightning's ``ModelParallelStrategy`` keeps its pickled ``meta.pt`` beside routed files;
:class:`distckpt.integrations.lightning.DistckptModelParallelStrategy` stores it in the checkpoint instead.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
from typing import Any, Callable

import torch.distributed.checkpoint as _dcp
import torch.distributed.checkpoint.state_dict_loader as _dcp_loader
import torch.distributed.checkpoint.state_dict_saver as _dcp_saver

from ..async_saving import async_save
from ..backends.blob_storage import BlobStorageWriter
from ..loading import load, load_state_dict
from ..saving import save, save_state_dict
from .announce import DISTCKPT_FORMAT

__all__ = ["route_dcp_calls", "routed_calls"]

log = logging.getLogger("distckpt")

_PLAIN = {"load": load, "save_state_dict": save_state_dict, "load_state_dict": load_state_dict}
_SAVES = {"save": save, "async_save": async_save}
_MODULES = (_dcp, _dcp_saver, _dcp_loader)
_lock = threading.Lock()
_open: list["_Routing"] = []  # the routings in force, in the order they were opened
_originals: dict = {}
_total = 0  # calls routed in this process, ever
_told = False  # whether the first routed call since routing began was logged
_told_save = False  # and the first save (a resume loads first: the save's place and format still need saying)


class _Routing:
    """Routing in force until :meth:`close` (or the end of a ``with`` block).

    ``calls`` counts DCP calls distckpt handled while it was open, ``counts`` the same by DCP's function name.
    """

    def __init__(self, overwrite: bool) -> None:
        global _told, _told_save
        self.overwrite = bool(overwrite)
        self.calls = 0
        self.counts: collections.Counter = collections.Counter()
        with _lock:
            if not _open:
                routed = {**{name: _routed(name, fn, False) for name, fn in _PLAIN.items()},
                          **{name: _routed(name, fn, True) for name, fn in _SAVES.items()}}
                for module in _MODULES:
                    for name, ours in routed.items():
                        if hasattr(module, name):
                            _originals[(module, name)] = getattr(module, name)
                            setattr(module, name, ours)
                _told = _told_save = False
            _open.append(self)
        self.open = True

    def close(self) -> None:
        with _lock:
            if not self.open:
                return
            self.open = False
            _open.remove(self)
            if not _open:
                for (module, name), original in _originals.items():
                    setattr(module, name, original)
                _originals.clear()

    def __enter__(self) -> "_Routing":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"route_dcp_calls(overwrite={self.overwrite}) [{'open' if self.open else 'closed'}, {self.calls} calls routed]"


def _routed(name: str, fn: Callable, is_save: bool) -> Callable:
    """``fn`` as DCP's ``name``: counted and told; a save that names no storage writer gets ``overwrite`` from
    the routing in force."""

    @functools.wraps(fn)
    def routed(*args: Any, **kwargs: Any) -> Any:
        global _total, _told, _told_save
        with _lock:
            overwrite = _open[-1].overwrite if _open else True
            for routing in _open:
                routing.calls += 1
                routing.counts[name] += 1
            _total += 1
            first = not _told or (is_save and not _told_save)
            _told, _told_save = True, _told_save or is_save
        log.log(logging.INFO if first else logging.DEBUG,
                "distckpt: torch.distributed.checkpoint.%s was routed to distckpt (route_dcp_calls), which handled it%s",
                name, f": distckpt saves at {_where(args, kwargs)}, in {DISTCKPT_FORMAT}" if is_save and first else "")
        if is_save and kwargs.get("storage_writer") is None and len(args) < 2:
            kwargs.setdefault("overwrite", overwrite)
        return fn(*args, **kwargs)

    return routed


def _where(args: tuple, kwargs: dict) -> str:
    """The place a routed save writes: its ``checkpoint_id``, or that of the storage writer it was given."""
    writer = kwargs.get("storage_writer", args[1] if len(args) > 1 else None)
    place = kwargs.get("checkpoint_id")
    if place is None and isinstance(writer, BlobStorageWriter):  # distckpt's writers name their place; others may not
        place = writer.checkpoint_id
    return str(place) if place is not None else "the place its storage writer names"


def route_dcp_calls(overwrite: bool = True) -> _Routing:
    """Make ``torch.distributed.checkpoint``'s save, load and async_save (and the deprecated names) distckpt's,
    until the returned object is closed. Nested, the routing opened last decides ``overwrite`` while it is open;
    DCP's functions come back when the last routing closes (see the module text)."""
    return _Routing(overwrite)


def routed_calls() -> int:
    """How many calls of torch.distributed.checkpoint distckpt handled in this process, through any routing."""
    with _lock:
        return _total
