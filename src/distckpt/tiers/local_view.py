"""A rank's local view of a state: every DTensor as its local shard, Stateful objects as their state dicts.

The view is what the node-local tier stores for a rank. Its tensors are the state's own memory (a DTensor's
shard is a view of it), so loading into the view in place fills the state; :meth:`LocalView.write_back` then
puts the loaded non-tensor values back and hands each Stateful object its state dict. Every walk goes the way
the package's own does (``planning.flatten``): the view's paths are the state's.
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..errors import CheckpointError
from ..planning.flatten import Path, get_element, leaves, map_leaves, set_element
from ..stateful import Stateful

__all__ = ["LocalView", "host_state", "as_saved"]


def _is_stateful(value: Any) -> bool:
    return isinstance(value, Stateful) and not isinstance(value, (torch.Tensor, dict))


def _shard_layout(t: DTensor) -> dict[str, Any]:
    return _layout(tuple(t.shape), t.device_mesh, tuple(t.placements), t.dtype)


_fingerprints: dict[tuple, tuple[str, tuple]] = {}


@functools.lru_cache(maxsize=4096)
def _plain_layout(shape: tuple, dtype: torch.dtype) -> dict[str, Any]:
    return {"local": list(shape), "dtype": str(dtype)}


@functools.lru_cache(maxsize=4096)
def _layout(shape: tuple, mesh: Any, placements: tuple, dtype: torch.dtype) -> dict[str, Any]:
    """One DTensor's layout on this rank; a model's thousands of DTensors have a few dozen (the save's blocked
    time would otherwise pay torch's shard arithmetic for each, at every save)."""
    local, offset = compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)
    return {"global": list(shape), "local": list(local), "offset": list(offset), "dtype": str(dtype),
            "placements": [str(p) for p in placements], "mesh": list(mesh.shape)}


class LocalView:
    """``view``: the state with each DTensor replaced by its local shard (``dtensors`` keeps each one by its path)
    and each Stateful by its state dict; ``fingerprint``: the layout it was taken at (rank, world size, and each
    tensor's shape, dtype and, for a DTensor, global shape, offset, placements and mesh)."""

    def __init__(self, state: dict[str, Any], rank: int, world_size: int) -> None:
        self.state = state
        self.layout: dict[str, Any] = {}
        self.statefuls: dict[str, tuple[Any, Any]] = {}
        self.dtensors: dict[Path, DTensor] = {}
        view: dict[str, Any] = {}
        with torch.no_grad():
            for key, value in state.items():
                if _is_stateful(value):
                    sd = value.state_dict()
                    self.statefuls[key] = (value, sd)
                    value = sd
                view[key] = map_leaves(value, self._local, (key,))
        self.view = view
        # a layout dict is shared by every tensor of the same layout (see _layout): the same names with the same
        # dicts are the same fingerprint, which a save then need not encode and hash again
        # (the cache holds the dicts themselves, so that no id in a key can be reused while the key is there)
        key = (rank, world_size, tuple((name, id(entry)) for name, entry in self.layout.items()))
        cached = _fingerprints.get(key)
        if cached is None:
            fingerprint = hashlib.sha256(json.dumps({"rank": rank, "world": world_size, "layout": self.layout},
                                                    sort_keys=True).encode()).hexdigest()
            if len(_fingerprints) > 64:
                _fingerprints.clear()
            cached = _fingerprints[key] = (fingerprint, tuple(self.layout.values()))
        self.fingerprint = cached[0]

    def _local(self, path: Path, leaf: Any) -> Any:
        name = ".".join(map(str, path))
        if isinstance(leaf, DTensor):
            self.layout[name] = _shard_layout(leaf)
            self.dtensors[path] = leaf
            return leaf.to_local()
        if isinstance(leaf, torch.Tensor):
            self.layout[name] = _plain_layout(tuple(leaf.shape), leaf.dtype)
        return leaf

    def write_back(self) -> None:
        """After a load into :attr:`view`: the state's non-tensor values take the loaded ones, and each Stateful
        object gets ``load_state_dict`` with its state dict (DTensors in it already hold the loaded shards)."""
        for key in list(self.state):
            if key in self.statefuls:
                obj, sd = self.statefuls[key]
                obj.load_state_dict(_merge(sd, self.view[key]))
            else:
                self.state[key] = _merge(self.state[key], self.view[key])


def _merge(original: Any, loaded: Any) -> Any:
    """``original`` with its non-tensor leaves taken from ``loaded`` (tensors were filled in place): in place, so
    that a caller's references into the state see the loaded values; rebuilt where a tuple is in the way."""
    if isinstance(original, torch.Tensor):
        return original
    found = []
    for path, leaf, _ in leaves(original):
        if isinstance(leaf, torch.Tensor):
            continue
        try:
            found.append((path, get_element(loaded, path)))
        except (KeyError, IndexError, TypeError, AttributeError):
            continue  # not in what was loaded: kept
    if found and found[0][0] == ():  # the value is a leaf itself
        return found[0][1]
    try:
        for path, value in found:
            set_element(original, path, value)
        return original
    except CheckpointError:  # inside a tuple
        values = dict(found)
        return map_leaves(original, lambda path, leaf: values.get(path, leaf))


def host_state(view: LocalView, device: str) -> dict[str, Any]:
    """Fresh tensors on ``device`` shaped like ``view``'s, in the same structure, and the DTensors to rebuild (keyed
    by the ``id`` of the fresh tensor that stands for each)."""
    dtensors: dict[int, Any] = {}

    def fresh(path: tuple, leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        t = torch.empty(leaf.shape, dtype=leaf.dtype, device=device)
        if path in view.dtensors:
            dtensors[id(t)] = view.dtensors[path]
        return t

    return {"view": {k: map_leaves(v, fresh, (k,)) for k, v in view.view.items()}, "dtensors": dtensors}


def as_saved(state: dict[str, Any]) -> dict[str, Any]:
    """The host state with each DTensor's shard wrapped back as a DTensor of the same mesh and placements."""
    dtensors = state["dtensors"]

    def wrap(_path: tuple, leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and id(leaf) in dtensors:
            src = dtensors[id(leaf)]
            return DTensor.from_local(leaf, src.device_mesh, src.placements, run_check=False, shape=src.shape,
                                      stride=src.stride())
        return leaf

    return {k: map_leaves(v, wrap, (k,)) for k, v in state["view"].items()}
