"""Planners that apply a :class:`~distckpt.planning.relayout.Relayout`: a model laid out unlike its checkpoint
(fused qkv against separate q/k/v, stacked layers against one key per layer) loads from it and saves to it.

Both translate the flattened state dict into frames, one per checkpoint key (relayout.py), and then plan on the
frames as the default planners plan on tensors: a frame's blocks are views of the model's local tensors, so each
stored byte is read once, straight into the model's memory, and each model byte written once.
"""

from __future__ import annotations

import io
from typing import Any, Optional, Sequence, Union

import torch

from ..capabilities import resolves_columns
from ..errors import CheckpointError, DTypeMismatchError, MissingKeyError, ShapeMismatchError, UnexpectedKeyError
from ..format.dtypes import itemsize
from ..format.values import decode_value, encode_value
from ..item_columns import SHARD, ReadColumns, WriteColumns
from ..metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata
from ..planner import LoadPlan, ReadItem, SavePlan
from .flatten import stored_paths
from .load_planner import _MAX_LISTED, DefaultLoadPlanner, _identities
from .relayout import Frame, Relayout, RelayoutError, Translation, frames
from .resharding import volume
from .save_planner import DefaultSavePlanner, _check_storable
from .tensors import check_no_aliasing, dtype_of, local_pieces

__all__ = ["RelayoutLoadPlanner", "RelayoutSavePlanner"]


def _as_relayout(relayout: Union[Relayout, Sequence[Any]]) -> Relayout:
    return relayout if isinstance(relayout, Relayout) else Relayout(list(relayout))


class _Ties:
    """Which model keys are one tensor (tied weights), by the identities the default load planner uses."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.ids: dict[str, set] = {}

    def of(self, name: str) -> set:
        got = self.ids.get(name)
        if got is None:
            got = self.ids[name] = set(_identities(self.tensors[name]))
        return got

    def tied(self, a: str, b: str) -> bool:
        return bool(self.of(a) & self.of(b))


def _translate(relayout: Relayout, tensors: dict[str, torch.Tensor], stored: Any = None) -> tuple[Translation, dict, _Ties]:
    """The translation of ``tensors`` and each one's blocks on this rank."""
    blocks = {name: local_pieces(name, t) for name, t in tensors.items()}
    ties = _Ties(tensors)
    tr = relayout.translate({name: tuple(g) for name, (g, _) in blocks.items()}, stored, ties.tied)
    return tr, {name: ps for name, (_, ps) in blocks.items()}, ties


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
    return ", ".join(names[:_MAX_LISTED]) + more


def _value_keys(relayout: Relayout, state_dict: dict, taken: set) -> dict[str, str]:
    """Checkpoint key -> model key of every non-tensor value the relayout keeps (Drop leaves some out). Two values
    on one checkpoint key, or a value on a tensor's key (``taken``), raise RelayoutError naming both."""
    out: dict[str, str] = {}
    for name, obj in state_dict.items():
        if isinstance(obj, torch.Tensor):
            continue
        key = relayout.value_key(name)
        if key is None:
            continue
        if key in out or key in taken:
            raise RelayoutError(f"model keys {out.get(key, '(a tensor)')!r} and {name!r} both map to checkpoint key {key!r}")
        out[key] = name
    return out


class RelayoutLoadPlanner(DefaultLoadPlanner):
    """Loads a checkpoint laid out as ``relayout`` says into the caller's state dict (in place, any sharding).

    Args:
        relayout: a :class:`Relayout` (or its list of rules), declared checkpoint -> model.
        **kwargs: DefaultLoadPlanner's (``allow_partial_load``: a model key any of whose checkpoint keys is missing
            is skipped whole; ``allow_unexpected_keys``: as there, where keys Drop matches are never unexpected).

    Checks and errors are the default planner's, per checkpoint key, naming the model key too. A model key the
    checkpoint lacks is not missing when its tensor is the very tensor of one that loads (tied weights).
    """

    def __init__(self, relayout: Union[Relayout, Sequence[Any]], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.relayout = _as_relayout(relayout)
        self._frames: dict[str, Frame] = {}
        self._value_keys: dict[str, str] = {}  # checkpoint key -> model key, for non-tensor values

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None, "set_up_planner must be given the checkpoint metadata"
        sdm = self.metadata.state_dict_metadata
        tensors = {name: obj for name, obj in self.state_dict.items() if isinstance(obj, torch.Tensor)}

        def stored(key: str) -> Optional[tuple]:
            md = sdm.get(key)
            return tuple(md.size) if isinstance(md, TensorStorageMetadata) else None

        tr, blocks, ties = _translate(self.relayout, tensors, stored)
        problems: list[CheckpointError] = []
        missing: dict[str, list[str]] = {}
        skip = set(tr.dropped)
        for name in tensors:
            if name in tr.dropped:
                continue
            for key in dict.fromkeys(tr.absent.get(name, []) + [p.key for p in tr.pieces.get(name, ())]):
                md = sdm.get(key)
                if md is None:
                    missing.setdefault(name, []).append(key)
                elif not isinstance(md, TensorStorageMetadata):
                    problems.append(ShapeMismatchError(
                        f"key {key!r} is a non-tensor value in {self._checkpoint_name()}, but the relayout reads model key "
                        f"{name!r} (a tensor) from it"))
                    skip.add(name)
        skip.update(missing)
        cols = ReadColumns()
        self._value_keys = {}
        expected = tr.keys()
        values = _value_keys(self.relayout, self.state_dict, expected)
        expected.update(values)
        for key, name in values.items():
            md = sdm.get(key)
            if md is None:
                missing[name] = [key]
            elif not isinstance(md, BytesStorageMetadata):
                problems.append(ShapeMismatchError(
                    f"key {key!r} is a tensor in {self._checkpoint_name()}, but model key {name!r} holds a non-tensor "
                    "value; put a tensor of the saved shape there to load it"))
            else:
                self._value_keys[key] = name
                cols.add_bytes(key)
        if missing:
            loads = set().union(*(ties.of(n) for n in tensors if n not in skip and tr.pieces.get(n)))
            missing = {n: ks for n, ks in missing.items() if n not in tensors or not loads & ties.of(n)}
        if missing and not self.allow_partial_load:
            raise MissingKeyError(self._missing(missing))
        self._frames = frames(tr, blocks, {name: dtype_of(t) for name, t in tensors.items()}, skip)
        for key, frame in self._frames.items():
            try:
                self._tensor_reads(cols, key, tensors[frame.owners[0]], sdm[key], torch.Size(frame.size), frame.pieces)
            except (ShapeMismatchError, DTypeMismatchError) as exc:
                problems.append(type(exc)(f"{exc} (relayout: model key(s) {_listed(frame.owners)})"))
        check_no_aliasing([(name, block[0]) for name, bs in blocks.items() if name not in skip for block in bs])
        self._check_unexpected_keys(expected)
        if problems:
            first = problems[0]
            raise type(first)(f"{first}" + "".join(f"\n  also: {p}" for p in problems[1:_MAX_LISTED]))
        self.plan = LoadPlan(cols)
        return self.plan

    def _missing(self, missing: dict[str, list[str]]) -> str:
        shown = [f"{', '.join(repr(k) for k in keys)} (for model key {name!r})" for name, keys in missing.items()]
        return (f"Missing key in checkpoint state_dict: {_listed(shown)} ({len(missing)} key(s) of your state dict are not "
                f"in {self._checkpoint_name()} as the relayout maps them). Check the key names and the rules, or pass "
                "RelayoutLoadPlanner(relayout, allow_partial_load=True) to skip them.")

    def _check_unexpected_keys(self, expected: set[str]) -> None:
        allow = self.allow_unexpected_keys
        if allow is None:
            allow = not getattr(self.metadata.storage_data, "every_key", False)
        if allow:
            return
        unexpected = [k for k in self.metadata.state_dict_metadata if k not in expected and not self.relayout.dropped(k)]
        if unexpected:
            raise UnexpectedKeyError(
                f"Unexpected key(s) in {self._checkpoint_name()}: {_listed([repr(k) for k in unexpected])} "
                f"({len(unexpected)} key(s) that no key of the state dict maps to would not be loaded). Check that the "
                "model and the rules match the checkpoint, add Drop(...) rules for keys the model does not hold, or pass "
                "RelayoutLoadPlanner(relayout, allow_unexpected_keys=True) to leave them unread.")

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        obj = decode_value(value.getvalue(), allow_pickle=self.allow_pickle, where=f"{self._checkpoint_name()}, key {key!r}")
        self.set_value(self._value_keys.get(key, key), obj)

    @resolves_columns
    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        """The view of the model's memory that holds block ``index`` of a checkpoint key (the column's ``dest``)."""
        frame = self._frames.get(index.fqn)
        if frame is None:
            raise CheckpointError(f"the relayout gives checkpoint key {index.fqn!r} no destination on this rank")
        return frame.at(index.offset)


class RelayoutSavePlanner(DefaultSavePlanner):
    """Saves the caller's state dict laid out as ``relayout`` says (the reverse of loading with it).

    Args:
        relayout: a :class:`Relayout` (or its list of rules), declared checkpoint -> model. A Fuse splits by its
            ``sizes`` (else equally); keys a Drop matches are not written; values follow Rename only.
        **kwargs: DefaultSavePlanner's.

    Each checkpoint key is written as a tensor sharded by the blocks the ranks hold of it (views of the model's
    memory); blocks several ranks hold alike (replicas) are written once, and the coordinator checks that the
    blocks cover each key exactly once.
    """

    def __init__(self, relayout: Union[Relayout, Sequence[Any]], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.relayout = _as_relayout(relayout)
        self._frames: dict[str, Frame] = {}
        self._values: dict[str, Any] = {}

    def create_local_plan(self) -> SavePlan:
        tensors = {}
        for name, obj in self.state_dict.items():
            if isinstance(obj, torch.Tensor):
                _check_storable(name, obj)
                tensors[name] = obj
        tr, blocks, _ = _translate(self.relayout, tensors)
        self._frames = frames(tr, blocks, {name: dtype_of(t) for name, t in tensors.items()})
        cols = WriteColumns()
        for key, frame in self._frames.items():
            width = itemsize(frame.dtype)
            for view, offsets, sizes in frame.pieces:
                cols.add_tensor(key, SHARD, view, frame.dtype, frame.requires_grad, frame.size, offsets, sizes,
                                volume(sizes) * width)
        self._encoded, self._values = {}, {}
        value_keys = _value_keys(self.relayout, self.state_dict, tr.keys())
        for key, name in value_keys.items():
            obj = self.state_dict[name]
            raw = encode_value(obj, allow_pickle=self.allow_pickle, where=f"state dict key {name!r}")
            self._encoded[key], self._values[key] = raw, obj
            cols.add_bytes(key, raw)
        paths = self._paths(tr, value_keys) if self.flatten_state_dict else None
        self.plan = SavePlan(cols, planner_data=paths)
        return self.plan

    def _paths(self, tr: Translation, value_keys: dict[str, str]) -> dict:
        """Where each checkpoint key sits in a nested state dict (``planner_data``): a key the relayout keeps has its
        model key's path; a renamed one keeps the model key's enclosing dicts where its name starts with theirs, and
        is otherwise top-level (no path)."""
        paths = stored_paths(self.mappings, self.original_state_dict)
        keys_of = {name: [p.key for p in ps] for name, ps in tr.pieces.items()}
        for key, name in value_keys.items():
            keys_of[name] = [key]
        out: dict = {}
        for name, path in paths.items():
            for key in keys_of.get(name, ()):
                if key == name:
                    out[key] = path
                elif all(type(p) is str for p in path) and ".".join(path) == name:
                    prefix = ".".join(path[:-1]) + "."
                    if len(path) > 1 and key.startswith(prefix) and len(key) > len(prefix):
                        out.setdefault(key, tuple(path[:-1]) + (key[len(prefix):],))
        return out

    @resolves_columns
    def lookup_object(self, index: MetadataIndex) -> Any:
        """The view of the model's memory that is block ``index`` of a checkpoint key (the column's ``data``), or
        the value stored under a checkpoint key."""
        frame = self._frames.get(index.fqn)
        if frame is not None:
            return frame.at(index.offset)
        if index.fqn in self._values:
            return self._values[index.fqn]
        raise CheckpointError(f"planner has no checkpoint key {index.fqn!r}")
