"""A rank's local view of a state: every DTensor as its local shard, Stateful objects as their state dicts.

The view is what the node-local tier stores for a rank. Its tensors are the state's own memory (a DTensor's
shard is a view of it), so loading into the view in place fills the state; :meth:`LocalView.write_back` then
puts the loaded non-tensor values back and hands each Stateful object its state dict.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..stateful import Stateful

__all__ = ["LocalView", "local_view"]


def _is_stateful(value: Any) -> bool:
    return isinstance(value, Stateful) and not isinstance(value, (torch.Tensor, dict))


def _shard_layout(t: DTensor) -> dict[str, Any]:
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return {"global": list(t.shape), "local": list(shape), "offset": list(offset), "dtype": str(t.dtype),
            "placements": [str(p) for p in t.placements], "mesh": list(t.device_mesh.shape)}


class LocalView:
    def __init__(self, state: dict[str, Any], rank: int, world_size: int) -> None:
        self.state = state
        self.layout: dict[str, Any] = {}
        self.statefuls: dict[str, tuple[Any, Any]] = {}
        view: dict[str, Any] = {}
        with torch.no_grad():
            for key, value in state.items():
                if _is_stateful(value):
                    sd = value.state_dict()
                    self.statefuls[key] = (value, sd)
                    view[key] = self._walk(sd, key)
                else:
                    view[key] = self._walk(value, key)
        self.view = view
        self.fingerprint = hashlib.sha256(json.dumps({"rank": rank, "world": world_size, "layout": self.layout},
                                                     sort_keys=True).encode()).hexdigest()

    def _walk(self, obj: Any, path: str) -> Any:
        if isinstance(obj, DTensor):
            self.layout[path] = _shard_layout(obj)
            return obj.to_local()
        if isinstance(obj, torch.Tensor):
            self.layout[path] = {"local": list(obj.shape), "dtype": str(obj.dtype)}
            return obj
        if isinstance(obj, dict):
            return {k: self._walk(v, f"{path}.{k}") for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._walk(v, f"{path}.{i}") for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(self._walk(v, f"{path}.{i}") for i, v in enumerate(obj))
        return obj

    def write_back(self) -> None:
        """After a load into :attr:`view`: the state's non-tensor values take the loaded ones, and each Stateful
        object gets ``load_state_dict`` with its state dict (DTensors in it already hold the loaded shards)."""
        for key, value in list(self.state.items()):
            if key in self.statefuls:
                obj, sd = self.statefuls[key]
                obj.load_state_dict(_merge(sd, self.view[key]))
            else:
                self.state[key] = _merge(value, self.view[key])


def _merge(original: Any, loaded: Any) -> Any:
    """``original`` with its non-tensor leaves taken from ``loaded`` (tensors were filled in place)."""
    if isinstance(original, torch.Tensor):
        return original
    if isinstance(original, dict) and isinstance(loaded, dict):
        for k in list(original):
            if k in loaded:
                original[k] = _merge(original[k], loaded[k])
        return original
    if isinstance(original, list) and isinstance(loaded, list) and len(original) == len(loaded):
        for i in range(len(original)):
            original[i] = _merge(original[i], loaded[i])
        return original
    if isinstance(original, tuple) and isinstance(loaded, (tuple, list)) and len(original) == len(loaded):
        return tuple(_merge(a, b) for a, b in zip(original, loaded))
    return loaded


def local_view(state: dict[str, Any], rank: int, world_size: int) -> LocalView:
    return LocalView(state, rank, world_size)
