"""Flattening nested state dicts into dotted keys, and setting values back.

Dicts are always traversed. A list or tuple is traversed only if it holds a
tensor somewhere inside; otherwise it is one value (so an optimizer's
``param_groups[i]["params"]`` stays a list). ``RankLocal`` values get a
per-rank key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from ..errors import CheckpointError
from .tensors import is_sharded_tensor

__all__ = ["leaves", "map_leaves", "flatten_state_dict", "stored_paths", "rank_local_hint", "expand_to_match", "set_element", "get_element",
           "RankLocal", "rank_local_key"]

Path = tuple


@dataclass
class RankLocal:
    """Marks a value that belongs to one rank only.

    Plain tensors and values under the same key on several ranks are taken to
    be replicas, and written once. Wrap a value in ``RankLocal`` to keep every
    rank's copy: it is stored under ``"<key>@rank<r>"`` and each rank loads its
    own back (the load needs the same rank to exist). A dict or list inside is
    flattened as anywhere else, each leaf rank-local. Plain keys may not end
    in ``@rank<r>``: those names belong to rank-local values.
    """

    value: Any


RANK_LOCAL = "$rank_local"  # the step into a RankLocal in a key path; reserved as a key
_RANK_SUFFIX = re.compile(r"@rank\d+\Z")


def rank_local_key(fqn: str, rank: int) -> str:
    return f"{fqn}@rank{rank}"


def rank_local_hint(missing: list[str], stored: Iterable[str]) -> str:
    """What to say when RankLocal values of ``missing`` are not among the ``stored`` keys: they were saved by
    other ranks than this load has (a new world size), and each rank loads only its own copy."""
    local = [k for k in missing if _RANK_SUFFIX.search(k)]
    if not local:
        return ""
    key = local[0]
    base = key[:_RANK_SUFFIX.search(key).start()]
    ranks = sorted(int(k[len(base) + 5:]) for k in stored if k.startswith(base + "@rank") and k[len(base) + 5:].isdigit())
    saved = (f"the checkpoint holds it for rank(s) {ranks[:8]}{' ...' if len(ranks) > 8 else ''}, so it was saved by "
             f"{len(ranks)} rank(s)") if ranks else "the checkpoint holds it for no rank"
    return (f" {base!r} is a RankLocal value, kept one copy per rank ({key!r} is this rank's): {saved}, and this load runs "
            "at a rank it lacks. Load at the world size it was saved with, or leave the RankLocal values out of the state "
            "dict (or pass allow_partial_load=True) and set them afresh at the new world size.")


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor) or is_sharded_tensor(obj):
        return True
    if isinstance(obj, dict):
        return any(_has_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(v) for v in obj)
    return False


def leaves(obj: Any, path: Path = (), local: bool = False) -> Iterator[tuple[Path, Any, bool]]:
    """Every leaf of ``obj``, in traversal order, with its key path and whether it lies inside a RankLocal.

    The one walk of a state dict that saving, staging and loading share: non-empty dicts are traversed,
    lists and tuples only where they hold a tensor, and a RankLocal adds the step ``RANK_LOCAL``.
    """
    if isinstance(obj, RankLocal):
        yield from leaves(obj.value, path + (RANK_LOCAL,), True)
    elif isinstance(obj, dict) and obj:
        for k, v in obj.items():
            if k == RANK_LOCAL:
                raise CheckpointError(f"state dict key {k!r} at {'.'.join(map(str, path)) or '<root>'} is reserved by "
                                      "distckpt (it marks a RankLocal in key paths); rename it")
            yield from leaves(v, path + (k,), local)
    elif isinstance(obj, (list, tuple)) and _has_tensor(obj):
        for i, v in enumerate(obj):
            yield from leaves(v, path + (i,), local)
    else:
        yield path, obj, local


def map_leaves(obj: Any, fn: Callable[[Path, Any], Any], path: Path = ()) -> Any:
    """``obj`` rebuilt with each leaf, as :func:`leaves` walks it, replaced by ``fn(path, leaf)``: new dicts, lists,
    tuples and RankLocals around whatever ``fn`` returns (the leaf itself, where nothing is to change)."""
    if isinstance(obj, RankLocal):
        return RankLocal(map_leaves(obj.value, fn, path + (RANK_LOCAL,)))
    if isinstance(obj, dict) and obj:
        return {k: map_leaves(v, fn, path + (k,)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and _has_tensor(obj):
        out = [map_leaves(v, fn, path + (i,)) for i, v in enumerate(obj)]
        return out if isinstance(obj, list) else tuple(out)
    return fn(path, obj)


def flatten_state_dict(state_dict: dict, rank: int = 0) -> tuple[dict[str, Any], dict[str, Path]]:
    """Return ``(flat, mappings)``: dotted key -> value, and dotted key -> path into ``state_dict``."""
    flat: dict[str, Any] = {}
    mappings: dict[str, Path] = {}
    for k, v in state_dict.items():
        if not isinstance(k, str):
            raise CheckpointError(f"top-level state dict key {k!r} must be a str")
        if type(v) is torch.Tensor and k != RANK_LOCAL and "@rank" not in k:  # a model's flat keys: the walk's answer
            _add(k, v, (k,), flat, mappings)
            continue
        for path, value, local in leaves(v, (k,)):
            _add(_key(path, local, rank), value, path, flat, mappings)
    return flat, mappings


def stored_paths(mappings: dict[str, Path], state_dict: dict) -> dict[str, Path]:
    """``mappings`` as a checkpoint records them (``planner_data``): a step into a list is an int, a step
    into a dict by an int key is that key in a 1-tuple (``(0,)``), so the nesting can be rebuilt exactly
    from the checkpoint alone (an optimizer's ``state`` is a dict keyed by int, its ``param_groups`` a list).

    A top-level key (path ``(key,)``) is not recorded: readers take a key without a path as top-level
    (docs/format.md), and a state dict of many flat keys would otherwise store and parse each twice."""
    out = {}
    for key, path in mappings.items():
        if len(path) == 1 and path[0] == key:
            continue
        if any(type(p) is int for p in path):
            obj: Any = state_dict
            steps = []
            for p in path:
                steps.append((p,) if type(p) is int and isinstance(obj, dict) else p)
                obj = obj.value if p == RANK_LOCAL else obj[p]
            path = tuple(steps)
        out[key] = path
    return out


def expand_to_match(flat: dict[str, Any], mappings: dict[str, Path], stored: Any) -> tuple[dict[str, Any], dict[str, Path]]:
    """``flat`` with each value the checkpoint has no key for, but keys under, split into those keys.

    DCP flattens a list of dicts (an optimizer's ``param_groups``) into one key per leaf
    (``optim.param_groups.0.lr``), where distckpt keeps the list as one value. A state dict laid out
    the same way then loads from a checkpoint DCP wrote (or one converted from it) key by key, each
    leaf set back at its place. ``stored`` is the checkpoint's keys (a container of str)."""
    missing = [k for k, v in flat.items() if k not in stored and isinstance(v, (dict, list, tuple))]
    if not missing:
        return flat, mappings
    parents = {key.rsplit(".", depth)[0] for key in stored for depth in range(1, key.count(".") + 1)}
    if not any(k in parents for k in missing):
        return flat, mappings
    out: dict[str, Any] = {}
    out_map: dict[str, Path] = {}
    for key, value in flat.items():
        if key in parents and key not in stored and isinstance(value, (dict, list, tuple)):
            for sub, leaf in _dcp_leaves(value, ()):
                _add(".".join([key, *map(str, sub)]), leaf, mappings[key] + sub, out, out_map)
        else:
            out[key], out_map[key] = value, mappings[key]
    return out, out_map


def _dcp_leaves(obj: Any, path: Path) -> Iterator[tuple[Path, Any]]:
    """DCP's walk: dicts are traversed; a list only if it holds a dict or tensor somewhere inside."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _dcp_leaves(v, path + (k,))
    elif isinstance(obj, list) and _holds_dict_or_tensor(obj):
        for i, v in enumerate(obj):
            yield from _dcp_leaves(v, path + (i,))
    else:
        yield path, obj


def _holds_dict_or_tensor(obj: Any) -> bool:
    if isinstance(obj, (dict, torch.Tensor)) or is_sharded_tensor(obj):
        return True
    return isinstance(obj, list) and any(_holds_dict_or_tensor(v) for v in obj)


def _key(path: Path, local: bool, rank: int) -> str:
    """The dotted key of the leaf at ``path``."""
    for depth, k in enumerate(path):
        if not isinstance(k, (str, int)):
            raise CheckpointError(f"state dict key {k!r} at {'.'.join(map(str, path[:depth])) or '<root>'} must be a str or int")
    key = ".".join(str(p) for p in path if p != RANK_LOCAL)
    if local:
        return rank_local_key(key, rank)
    if _RANK_SUFFIX.search(key):
        raise CheckpointError(
            f"key {key!r} ends like the stored name of a RankLocal value (<key>@rank<r>), which it could be taken "
            "for on another rank; rename it, or wrap the value in distckpt.RankLocal(...)")
    return key


def _add(key: str, value: Any, path: Path, flat: dict[str, Any], mappings: dict[str, Path]) -> None:
    if key in flat:
        raise CheckpointError(
            f"two entries of the state dict flatten to the same key {key!r} ({mappings[key]} and {path}); rename one of them"
        )
    flat[key] = value
    mappings[key] = path


def get_element(root: Any, path: Path) -> Any:
    obj = root
    for p in path:
        if p == RANK_LOCAL:
            obj = obj.value
        else:
            obj = obj[p]
    return obj


def set_element(root: Any, path: Path, value: Any) -> None:
    """Put ``value`` at ``path`` inside ``root``, in place."""
    parent = root
    for p in path[:-1]:
        parent = parent.value if p == RANK_LOCAL else parent[p]
    last = path[-1]
    if last == RANK_LOCAL:
        parent.value = value
    elif isinstance(parent, tuple):
        raise CheckpointError(f"cannot set {'.'.join(map(str, path))}: it is inside a tuple; use a list")
    else:
        parent[last] = value
