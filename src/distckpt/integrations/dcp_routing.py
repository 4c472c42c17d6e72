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
written for DCP save ``last.ckpt`` or ``pytorch_model_fsdp_0`` again and again into one folder.
``route_dcp_calls(overwrite=False)`` keeps distckpt's refusal instead. A save given a storage writer
follows that writer's own setting.

Only the module attributes are replaced: code that bound DCP's functions to its own names before the
call (``from torch.distributed.checkpoint import save``) keeps DCP's.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch.distributed.checkpoint as _dcp
import torch.distributed.checkpoint.state_dict_loader as _dcp_loader
import torch.distributed.checkpoint.state_dict_saver as _dcp_saver

from ..loading import load, load_state_dict
from ..saving import save, save_state_dict
from ..staging import async_save

__all__ = ["route_dcp_calls"]

_PLAIN = {"load": load, "save_state_dict": save_state_dict, "load_state_dict": load_state_dict}
_SAVES = {"save": save, "async_save": async_save}
_MODULES = (_dcp, _dcp_saver, _dcp_loader)
_lock = threading.Lock()
_depth = 0
_originals: dict = {}


class _Routing:
    """Routing in force until :meth:`close` (or the end of a ``with`` block)."""

    def __init__(self, overwrite: bool) -> None:
        global _depth
        with _lock:
            if _depth == 0:
                ours_by_name = {**_PLAIN, **{name: _overwriting(fn, overwrite) for name, fn in _SAVES.items()}}
                for module in _MODULES:
                    for name, ours in ours_by_name.items():
                        if hasattr(module, name):
                            _originals[(module, name)] = getattr(module, name)
                            setattr(module, name, ours)
            _depth += 1
        self.open = True

    def close(self) -> None:
        global _depth
        with _lock:
            if not self.open:
                return
            self.open = False
            _depth -= 1
            if _depth == 0:
                for (module, name), original in _originals.items():
                    setattr(module, name, original)
                _originals.clear()

    def __enter__(self) -> "_Routing":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _overwriting(fn: Any, overwrite: bool) -> Any:
    """``fn`` with ``overwrite`` as the default of a call that names no storage writer."""

    @functools.wraps(fn)
    def routed(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("storage_writer") is None and len(args) < 2:
            kwargs.setdefault("overwrite", overwrite)
        return fn(*args, **kwargs)

    return routed


def route_dcp_calls(overwrite: bool = True) -> _Routing:
    """Make ``torch.distributed.checkpoint``'s save, load and async_save (and the deprecated names) distckpt's,
    until the returned object is closed; nested routings undo only when the outermost closes (the outermost's
    ``overwrite`` holds for all of them)."""
    return _Routing(overwrite)
