"""Send a framework's calls of torch.distributed.checkpoint to distckpt, with one line.

Frameworks that checkpoint through DCP themselves (accelerate's FSDP helpers, Lightning's strategies)
call ``torch.distributed.checkpoint.save``/``load``/``async_save`` with DCP's own classes. After
``route_dcp_calls()`` those calls are distckpt's (the classes are swapped for distckpt's with their
options, see :mod:`distckpt.torch_classes`), until the returned object is closed; as a context manager,
for the block only::

    distckpt.integrations.dcp_routing.route_dcp_calls()      # the rest of the process
    with route_dcp_calls():                                    # or one block
        accelerator.save_state(output_dir)

Only the module attributes are replaced: code that bound DCP's functions to its own names before the
call (``from torch.distributed.checkpoint import save``) keeps DCP's.
"""

from __future__ import annotations

import threading
from typing import Any

import torch.distributed.checkpoint as _dcp
import torch.distributed.checkpoint.state_dict_loader as _dcp_loader
import torch.distributed.checkpoint.state_dict_saver as _dcp_saver

from ..loading import load, load_state_dict
from ..saving import save, save_state_dict
from ..staging import async_save

__all__ = ["route_dcp_calls"]

_OURS = {"save": save, "load": load, "async_save": async_save, "save_state_dict": save_state_dict,
         "load_state_dict": load_state_dict}
_MODULES = (_dcp, _dcp_saver, _dcp_loader)
_lock = threading.Lock()
_depth = 0
_originals: dict = {}


class _Routing:
    """Routing in force until :meth:`close` (or the end of a ``with`` block)."""

    def __init__(self) -> None:
        global _depth
        with _lock:
            if _depth == 0:
                for module in _MODULES:
                    for name, ours in _OURS.items():
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


def route_dcp_calls() -> _Routing:
    """Make ``torch.distributed.checkpoint``'s save, load and async_save (and the deprecated names) distckpt's,
    until the returned object is closed; nested routings undo only when the outermost closes."""
    return _Routing()
