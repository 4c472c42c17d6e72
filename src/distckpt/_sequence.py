"""Helpers shared by the save and load call sequences."""

from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from .backends.registry import pick_storage
from .planning import DefaultLoadPlanner, DefaultSavePlanner
from .stateful import Stateful
from .torch_classes import adopt


def split_stateful(state_dict: dict) -> tuple[dict, dict[str, Any]]:
    """Replace top-level Stateful values by their state dicts; return the new dict and the objects.

    The objects are asked in sorted key order, the same on every rank whatever order each rank's dict has: a
    ``state_dict()`` may run collectives (an optimizer's ``get_state_dict``), which must meet in one order."""
    objects = {k: state_dict[k] for k in sorted(state_dict, key=str)
               if not isinstance(state_dict[k], torch.Tensor) and isinstance(state_dict[k], Stateful)}
    states = {k: v.state_dict() for k, v in objects.items()}
    plain = {k: (states[k] if k in objects else v) for k, v in state_dict.items()}
    return plain, objects


def call_set_up(method: Any, *args: Any, **kwargs: Any) -> None:
    """Call a storage set-up method, passing only the keyword arguments it accepts."""
    try:
        params = inspect.signature(method).parameters
    except (TypeError, ValueError):
        params = {}
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        method(*args, **kwargs)
    else:
        method(*args, **{k: v for k, v in kwargs.items() if k in params})


def tell_rank(planner: Any, rank: int) -> None:
    """Let distckpt's planners (and their subclasses) know this rank, for RankLocal keys."""
    if isinstance(planner, (DefaultSavePlanner, DefaultLoadPlanner)):
        planner.rank = rank


@dataclass
class Prepared:
    """What a save or load needs before its first collective, or the failure that stopped it on this rank
    (reported in that collective, so that every rank fails the same call)."""

    storage: Any = None
    planner: Any = None
    plain: dict = field(default_factory=dict)
    objects: dict = field(default_factory=dict)
    failure: Optional[BaseException] = None


def prepare(kind: str, checkpoint_id: Any, storage: Any, planner: Any, default_planner: Callable[[], Any], rank: int,
            state_dict: dict, overwrite: Optional[bool] = None) -> Prepared:
    """Pick the storage and planner and take the state (``kind``: writer or reader), catching any failure.

    DCP's own classes are swapped for distckpt's first (:mod:`.torch_classes`); one that has no
    counterpart raises TypeError at once, on every rank alike."""
    storage = adopt(storage, f"storage_{kind}")
    planner = adopt(planner, "planner")
    out = Prepared()
    try:
        out.storage = pick_storage(kind, checkpoint_id, storage, overwrite)
        out.planner = planner if planner is not None else default_planner()
        tell_rank(out.planner, rank)
        out.plain, out.objects = split_stateful(state_dict)
    except Exception as exc:  # noqa: BLE001 - raised on every rank by the first collective
        out.failure = exc
    return out


def storage_by_position(name: str) -> Callable:
    """Accept DCP's older call form ``fn(state_dict, storage)`` for the keyword ``name``, with a warning."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(state_dict: Any, *rest: Any, **kwargs: Any) -> Any:
            if rest:
                if len(rest) > 1 or name in kwargs:
                    raise TypeError(f"{fn.__name__}() takes the state dict and at most one positional {name}; "
                                    f"pass the other arguments by name")
                warnings.warn(f"{fn.__name__}(state_dict, {name}) is DCP's older call form; pass {name}= by name",
                              FutureWarning, stacklevel=2)
                kwargs[name] = rest[0]
            return fn(state_dict, **kwargs)

        return call

    return wrap
