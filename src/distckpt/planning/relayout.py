"""Declarative re-layout between a checkpoint's keys and shapes and a model's: the rules and their piece math.

Rules are declared in the checkpoint -> model direction, with name templates:
``{name}`` matches a non-empty run of characters without a dot, ``{*name}`` any
non-empty run; both sides of a rule use the same placeholders. A model key
belongs to the first rule whose model-side template matches it; a key no rule
matches maps to itself. Keys are never passed through two rules.

Every rule answers, for a model key and its global shape, a list of
:class:`Piece`: a box of the model tensor, the checkpoint key it lies in, and
the box it fills there, with at most one unit dimension that one side has and
the other lacks (Stack's per-layer keys, Unstack's stacked key). A rank's local
block of a model tensor is cut along those boxes into views (:func:`place`),
gathered per checkpoint key into a :class:`Frame`: the checkpoint key's global
size and dtype, and the views this rank holds with their offsets, as a
ShardedTensor's local shards. Nothing here calls torch.distributed or does I/O.
See docs/relayout.md.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from ..errors import CheckpointError, RelayoutError, ShapeMismatchError
from .key_templates import LAYER, KeyTemplate, same_placeholders
from .resharding import intersect, volume

__all__ = ["RelayoutError", "Rename", "Fuse", "Split", "Stack", "Unstack", "Drop", "Relayout", "Piece", "Translation",
           "Frame", "place", "frames"]

_MAX_SHOWN = 5  # keys an error lists at most
Shape = tuple
#: the size of a stored tensor (load), or None where the checkpoint has no tensor under that key (or on save)
StoredSize = Callable[[str], Optional[Shape]]


def _dim(rule: Any, dim: int, ndim: int, key: str) -> int:
    if not -ndim <= dim < ndim:
        raise RelayoutError(f"{rule}: dim {dim} is out of range for key {key!r} ({ndim} dimension(s))")
    return dim % ndim


@dataclass(frozen=True)
class Piece:
    """A box of model key ``model_key`` that fills box (``offsets``, ``sizes``) of checkpoint key ``key`` (of global
    size ``size``). ``model_unit``: a dimension of the model box, of length 1, that the checkpoint box lacks;
    ``stored_unit``: one of the checkpoint box that the model box lacks."""

    model_key: str
    model_offsets: Shape
    model_sizes: Shape
    key: str
    offsets: Shape
    sizes: Shape
    size: Shape
    model_unit: Optional[int] = None
    stored_unit: Optional[int] = None


def _whole(model_key: str, shape: Shape, key: str) -> Piece:
    zeros = (0,) * len(shape)
    return Piece(model_key, zeros, shape, key, zeros, shape, shape)


def _with(shape: Shape, dim: int, n: int) -> Shape:
    return shape[:dim] + (n,) + shape[dim + 1:]


# ---------------------------------------------------------------- the rules
#
# Each rule has ``model_side`` (its model-side templates) and ``resolve(members, shapes, stored)``: for a group of
# model keys that the rule matched (a Split's parts, an Unstack's layers: the keys filling one checkpoint key; else a
# key alone), ``({model key: pieces}, {model key: checkpoint keys it needs that the checkpoint lacks})``. ``stored``
# is None on save. ``group(j, captures)`` says which group a match belongs to.


class Rename:
    """Checkpoint key ``checkpoint`` is model key ``model``: ``Rename("model.{*rest}", "{*rest}")``."""

    def __init__(self, checkpoint: str, model: str) -> None:
        self.checkpoint, self.model = KeyTemplate(checkpoint), KeyTemplate(model)
        same_placeholders(repr(self), self.checkpoint, self.model)
        self.model_side = [self.model]

    def __repr__(self) -> str:
        return f"Rename({self.checkpoint.text!r}, {self.model.text!r})"

    def group(self, model_key: str, j: int, captures: dict) -> Any:
        return model_key

    def stored_key(self, captures: dict) -> str:
        return self.checkpoint.fill(captures)

    def resolve(self, members: list, shapes: dict, stored: Optional[StoredSize]) -> tuple[dict, dict]:
        (model_key, _, captures), = members
        return {model_key: [_whole(model_key, shapes[model_key], self.stored_key(captures))]}, {}


class Fuse:
    """Checkpoint keys ``parts``, concatenated along ``dim``, are model key ``into`` (Hugging Face's q/k/v into a
    fused qkv). Part sizes come from the checkpoint on load, from ``sizes`` (else an equal split) on save."""

    def __init__(self, parts: Sequence[str], into: str, dim: int = 0, sizes: Optional[Sequence[int]] = None) -> None:
        if isinstance(parts, str) or not parts:
            raise RelayoutError(f"Fuse: parts must be a non-empty list of key templates, not {parts!r}")
        self.parts, self.into, self.dim = [KeyTemplate(p) for p in parts], KeyTemplate(into), int(dim)
        if len({p.text for p in self.parts}) != len(self.parts):
            raise RelayoutError(f"{self!r}: a part is named twice")
        self.sizes = None if sizes is None else [int(n) for n in sizes]
        if self.sizes is not None and (len(self.sizes) != len(self.parts) or min(self.sizes) < 0):
            raise RelayoutError(f"{self!r}: sizes must give one non-negative size per part")
        for p in self.parts:
            same_placeholders(repr(self), p, self.into)
        self.model_side = [self.into]

    def __repr__(self) -> str:
        return f"Fuse({[p.text for p in self.parts]!r}, {self.into.text!r}, dim={self.dim})"

    def group(self, model_key: str, j: int, captures: dict) -> Any:
        return model_key

    def resolve(self, members: list, shapes: dict, stored: Optional[StoredSize]) -> tuple[dict, dict]:
        (model_key, _, captures), = members
        shape = shapes[model_key]
        d = _dim(self, self.dim, len(shape), model_key)
        keys = [p.fill(captures) for p in self.parts]
        sizes = self._stored_sizes(model_key, shape, d, keys, stored) if stored is not None else self._sizes(model_key, shape, d)
        if isinstance(sizes, dict):
            return {}, sizes
        pieces, at = [], 0
        for key, n in zip(keys, sizes):
            part = _with(shape, d, n)
            zeros = (0,) * len(shape)
            pieces.append(Piece(model_key, _with(zeros, d, at), part, key, zeros, part, part))
            at += n
        return {model_key: pieces}, {}

    def _sizes(self, model_key: str, shape: Shape, d: int) -> list[int]:
        total, n = shape[d], len(self.parts)
        if self.sizes is not None:
            if sum(self.sizes) != total:
                raise RelayoutError(f"{self!r}: sizes {self.sizes} sum to {sum(self.sizes)}, but model key {model_key!r} "
                                    f"has {total} at dim {d}")
            return self.sizes
        if total % n:
            raise RelayoutError(f"{self!r}: model key {model_key!r} has {total} at dim {d}, which does not split into "
                                f"{n} equal parts; give the parts' sizes, Fuse(..., sizes=[...])")
        return [total // n] * n

    def _stored_sizes(self, model_key: str, shape: Shape, d: int, keys: list[str], stored: StoredSize) -> Any:
        sizes, absent = [], []
        for j, key in enumerate(keys):
            got = stored(key)
            if got is None:
                if self.sizes is None:
                    absent.append(key)
                sizes.append(None if self.sizes is None else self.sizes[j])
                continue
            if len(got) != len(shape):
                raise ShapeMismatchError(f"{self!r}: checkpoint key {key!r} has shape {list(got)}, model key {model_key!r} "
                                         f"has {len(shape)} dimensions {list(shape)}")
            sizes.append(got[d])
        if absent:
            return {model_key: absent}
        if self.sizes is not None and sizes != self.sizes:
            raise ShapeMismatchError(f"{self!r}: the checkpoint's parts of model key {model_key!r} have sizes {sizes} at "
                                     f"dim {d}, the rule says {self.sizes}")
        if sum(sizes) != shape[d]:
            raise ShapeMismatchError(
                f"{self!r}: the checkpoint's parts {keys} of model key {model_key!r} have sizes {sizes} at dim {d}, "
                f"which sum to {sum(sizes)}, but the model's tensor has {shape[d]} (shape {list(shape)})")
        return sizes


class Split:
    """Checkpoint key ``part`` holds model keys ``into`` concatenated along ``dim`` (a fused checkpoint, a model of
    separate tensors). Offsets come from the model keys' sizes in the order given; all must be in the state dict."""

    def __init__(self, part: str, into: Sequence[str], dim: int = 0) -> None:
        if isinstance(into, str) or not into:
            raise RelayoutError(f"Split: into must be a non-empty list of key templates, not {into!r}")
        self.part, self.into, self.dim = KeyTemplate(part), [KeyTemplate(t) for t in into], int(dim)
        if len({t.text for t in self.into}) != len(self.into):
            raise RelayoutError(f"{self!r}: a model key is named twice")
        for t in self.into:
            same_placeholders(repr(self), self.part, t)
        self.model_side = self.into

    def __repr__(self) -> str:
        return f"Split({self.part.text!r}, {[t.text for t in self.into]!r}, dim={self.dim})"

    def group(self, model_key: str, j: int, captures: dict) -> Any:
        return self.part.fill(captures)

    def resolve(self, members: list, shapes: dict, stored: Optional[StoredSize]) -> tuple[dict, dict]:
        by_j = {j: (key, captures) for key, j, captures in members}
        captures = members[0][2]
        key = self.part.fill(captures)
        lacking = [t.fill(captures) for j, t in enumerate(self.into) if j not in by_j]
        if lacking:
            raise RelayoutError(f"{self!r}: checkpoint key {key!r} holds model keys {[t.fill(captures) for t in self.into]}, "
                                f"but the state dict lacks {lacking}; every part must be in the state dict")
        names = [by_j[j][0] for j in range(len(self.into))]
        first = shapes[names[0]]
        d = _dim(self, self.dim, len(first), names[0])
        for name in names[1:]:
            s = shapes[name]
            if len(s) != len(first) or _with(s, d, 0) != _with(first, d, 0):
                raise RelayoutError(f"{self!r}: model keys {names[0]!r} {list(first)} and {name!r} {list(s)} differ in a "
                                    f"dimension other than {d}, so they cannot be concatenated into {key!r}")
        if stored is not None and stored(key) is None:
            return {}, {name: [key] for name in names}
        size = _with(first, d, sum(shapes[n][d] for n in names))
        out, at = {}, 0
        for name in names:
            s = shapes[name]
            out[name] = [Piece(name, (0,) * len(s), s, key, _with((0,) * len(s), d, at), s, size)]
            at += s[d]
        return out, {}


class Stack:
    """Checkpoint keys ``per_layer`` (a template with ``{i}``, a decimal integer), stacked along a new ``dim``, are
    model key ``into``, whose size at ``dim`` is the number of layers."""

    def __init__(self, per_layer: str, into: str, dim: int = 0) -> None:
        self.per_layer, self.into, self.dim = KeyTemplate(per_layer, layer=True), KeyTemplate(into), int(dim)
        same_placeholders(repr(self), self.per_layer, self.into, layer=LAYER)
        self.model_side = [self.into]

    def __repr__(self) -> str:
        return f"Stack({self.per_layer.text!r}, {self.into.text!r}, dim={self.dim})"

    def group(self, model_key: str, j: int, captures: dict) -> Any:
        return model_key

    def resolve(self, members: list, shapes: dict, stored: Optional[StoredSize]) -> tuple[dict, dict]:
        (model_key, _, captures), = members
        shape = shapes[model_key]
        d = _dim(self, self.dim, len(shape), model_key)
        layer = shape[:d] + shape[d + 1:]
        keys = [self.per_layer.fill({**captures, LAYER: i}) for i in range(shape[d])]
        if stored is not None:
            absent = [k for k in keys if stored(k) is None]
            if absent:
                return {}, {model_key: absent}
        zeros = (0,) * len(shape)
        return {model_key: [Piece(model_key, _with(zeros, d, i), _with(shape, d, 1), key, zeros[1:], layer, layer, model_unit=d)
                            for i, key in enumerate(keys)]}, {}


class Unstack:
    """Checkpoint key ``stacked`` (shape ``[L at dim, ...]``) holds model keys ``per_layer`` (a template with
    ``{i}``); the model's layers must be exactly 0 to L-1."""

    def __init__(self, stacked: str, per_layer: str, dim: int = 0) -> None:
        self.stacked, self.per_layer, self.dim = KeyTemplate(stacked), KeyTemplate(per_layer, layer=True), int(dim)
        same_placeholders(repr(self), self.per_layer, self.stacked, layer=LAYER)
        self.model_side = [self.per_layer]

    def __repr__(self) -> str:
        return f"Unstack({self.stacked.text!r}, {self.per_layer.text!r}, dim={self.dim})"

    def group(self, model_key: str, j: int, captures: dict) -> Any:
        return self.stacked.fill(captures)

    def resolve(self, members: list, shapes: dict, stored: Optional[StoredSize]) -> tuple[dict, dict]:
        captures = members[0][2]
        key = self.stacked.fill(captures)
        by_layer = {int(c[LAYER]): name for name, _, c in members}
        names = [by_layer[i] for i in sorted(by_layer)]
        layer = shapes[names[0]]
        for name in names[1:]:
            if shapes[name] != layer:
                raise RelayoutError(f"{self!r}: model keys {names[0]!r} {list(layer)} and {name!r} {list(shapes[name])} "
                                    f"differ in shape, so they cannot be stacked into {key!r}")
        d = _dim(self, self.dim, len(layer) + 1, key)
        if stored is None:
            count = len(names)
        else:
            got = stored(key)
            if got is None:
                return {}, {name: [key] for name in names}
            if len(got) != len(layer) + 1:
                raise ShapeMismatchError(f"{self!r}: checkpoint key {key!r} has shape {list(got)}, which does not stack "
                                         f"layers of shape {list(layer)} (model key {names[0]!r})")
            count = got[d]
        layers = sorted(by_layer)
        if len(layers) != count or (layers and layers[-1] != count - 1):  # distinct layers from 0: exactly 0 .. count-1
            # the count is the checkpoint's claim: list what is lacking without counting up to it
            lacking = list(itertools.islice((self.per_layer.fill({**captures, LAYER: i}) for i in range(count)
                                             if i not in by_layer), _MAX_SHOWN))
            extra = [by_layer[i] for i in layers if i >= count][:_MAX_SHOWN]
            error = RelayoutError if stored is None else ShapeMismatchError
            raise error(f"{self!r}: checkpoint key {key!r} stacks {count} layers at dim {d}, so the model needs exactly "
                        f"layers 0 to {count - 1}" + (f"; the state dict lacks {lacking}" if lacking else "")
                        + (f"; it has {extra} beyond them" if extra else ""))
        size = layer[:d] + (count,) + layer[d:]
        zeros = (0,) * len(layer)
        return {by_layer[i]: [Piece(by_layer[i], zeros, layer, key, _with((0,) * len(size), d, i), _with(size, d, 1), size,
                                    stored_unit=d)] for i in range(count)}, {}


class Drop:
    """Checkpoint keys matching ``template`` are neither loaded (nor "unexpected" in the checkpoint) nor saved."""

    def __init__(self, template: str) -> None:
        self.template = KeyTemplate(template)

    def __repr__(self) -> str:
        return f"Drop({self.template.text!r})"


_RULES = (Rename, Fuse, Split, Stack, Unstack)


# ---------------------------------------------------------------- the mapping


@dataclass
class Translation:
    """A state dict's tensors in checkpoint terms: ``pieces`` per model key; ``absent``: model keys whose pieces
    could not be placed, with the checkpoint keys they need that the checkpoint lacks (load); ``dropped``: model keys
    every piece of which Drop removed."""

    pieces: dict[str, list[Piece]] = field(default_factory=dict)
    absent: dict[str, list[str]] = field(default_factory=dict)
    dropped: set[str] = field(default_factory=set)
    rule: dict[str, Any] = field(default_factory=dict)  # model key -> the rule that mapped it (None: itself)

    def keys(self) -> set[str]:
        """Every checkpoint key the state dict's tensors name."""
        named = {p.key for ps in self.pieces.values() for p in ps}
        return named.union(*self.absent.values()) if self.absent else named


class Relayout:
    """The mapping: ``rules`` tried in order (Drop rules apply to every checkpoint key, wherever they stand)."""

    def __init__(self, rules: Sequence[Any]) -> None:
        self.rules, self.drops = [], []
        for rule in rules:
            if isinstance(rule, Drop):
                self.drops.append(rule)
            elif isinstance(rule, _RULES):
                self.rules.append(rule)
            else:
                raise RelayoutError(f"Relayout takes Rename, Fuse, Split, Stack, Unstack and Drop rules, not {rule!r}")

    def __repr__(self) -> str:
        return f"Relayout({self.rules + self.drops!r})"

    def dropped(self, key: str) -> bool:
        """Whether checkpoint key ``key`` is dropped."""
        return any(d.template.match(key) is not None for d in self.drops)

    def match(self, model_key: str) -> Optional[tuple[Any, int, dict]]:
        """``(rule, which of its model-side templates, captures)`` of the first rule matching ``model_key``."""
        for rule in self.rules:
            for j, template in enumerate(rule.model_side):
                captures = template.match(model_key)
                if captures is not None:
                    return rule, j, captures
        return None

    def value_key(self, model_key: str) -> Optional[str]:
        """The checkpoint key of a non-tensor value (None: dropped); only Rename applies to values."""
        hit = self.match(model_key)
        if hit is None:
            key = model_key
        elif isinstance(hit[0], Rename):
            key = hit[0].stored_key(hit[2])
        else:
            raise RelayoutError(f"{hit[0]!r} matches key {model_key!r}, which holds a non-tensor value; only Rename "
                                "applies to values")
        return None if self.dropped(key) else key

    def translate(self, shapes: dict[str, Shape], stored: Optional[StoredSize] = None,
                  tied: Callable[[str, str], bool] = lambda a, b: False) -> Translation:
        """The pieces of every model tensor (``shapes``: model key -> global shape). ``stored`` (load only) gives a
        checkpoint tensor's size; ``tied(a, b)`` whether two model keys are one tensor (which may fill one region)."""
        out = Translation()
        groups: dict = {}
        for name, shape in shapes.items():
            hit = self.match(name)
            if hit is None:
                out.pieces[name] = [_whole(name, tuple(shape), name)]
                out.rule[name] = None
                continue
            rule, j, captures = hit
            out.rule[name] = rule
            groups.setdefault((id(rule), rule.group(name, j, captures)), (rule, []))[1].append((name, j, captures))
        shapes = {k: tuple(v) for k, v in shapes.items()}
        for rule, members in groups.values():
            pieces, absent = rule.resolve(members, shapes, stored)
            out.pieces.update(pieces)
            out.absent.update(absent)
        if self.drops:
            for name in list(out.pieces):
                kept = [p for p in out.pieces[name] if not self.dropped(p.key)]
                if out.pieces[name] and not kept:
                    out.dropped.add(name)
                out.pieces[name] = kept
            for name in list(out.absent):
                keys = [k for k in out.absent[name] if not self.dropped(k)]
                if keys:
                    out.absent[name] = keys
                else:
                    del out.absent[name]
                    out.dropped.add(name)
        _check_disjoint(out, tied)
        return out


def _check_disjoint(out: Translation, tied: Callable[[str, str], bool]) -> None:
    """Pieces of one checkpoint key agree on its size and never overlap (unless tied keys fill one region alike)."""
    by_key: dict[str, list[Piece]] = {}
    for ps in out.pieces.values():
        for p in ps:
            by_key.setdefault(p.key, []).append(p)
    for key, ps in by_key.items():
        if len(ps) < 2:
            continue
        for p in ps[1:]:
            if p.size != ps[0].size:
                raise RelayoutError(f"model keys {ps[0].model_key!r} and {p.model_key!r} both map to checkpoint key {key!r}, "
                                    f"as a tensor of shape {list(ps[0].size)} and of shape {list(p.size)}")
        full = [p for p in ps if volume(p.sizes)]
        if len(full) < 2:
            continue
        # sweep along the dimension where pieces start in the most places: partitions meet only their neighbours
        ndim = len(full[0].offsets)
        d = max(range(ndim), key=lambda k: len({p.offsets[k] for p in full})) if ndim else None
        order = sorted(full, key=lambda p: p.offsets[d]) if d is not None else full
        active: list[Piece] = []
        for p in order:
            if d is not None:
                active = [q for q in active if q.offsets[d] + q.sizes[d] > p.offsets[d]]
            for q in active:
                if intersect(q.offsets, q.sizes, p.offsets, p.sizes) is None:
                    continue
                if (q.offsets, q.sizes, q.model_offsets, q.model_sizes) == (p.offsets, p.sizes, p.model_offsets, p.model_sizes) \
                        and tied(q.model_key, p.model_key):
                    continue
                raise RelayoutError(
                    f"the mapping places model keys {q.model_key!r} and {p.model_key!r} on overlapping regions of "
                    f"checkpoint key {key!r} (offsets {list(q.offsets)} and {list(p.offsets)}), so a load would read that "
                    "region twice and a save write it twice; check the rules")
            active.append(p)


# ---------------------------------------------------------------- one rank's blocks


def place(piece: Piece, local: torch.Tensor, offsets: Shape, sizes: Shape) -> Optional[tuple[torch.Tensor, Shape, Shape]]:
    """Where a local block (``local`` at ``offsets``, ``sizes`` in the model tensor) meets ``piece``: a view of
    ``local`` and its offsets and sizes in the checkpoint key; None if they do not meet."""
    box = intersect(offsets, sizes, piece.model_offsets, piece.model_sizes)
    if box is None:
        return None
    lo, lengths = box
    view = local
    for d, (a, n, o, s) in enumerate(zip(lo, lengths, offsets, sizes)):
        if a != o or n != s:
            view = view.narrow(d, a - o, n)
    rel, lens = [a - m for a, m in zip(lo, piece.model_offsets)], list(lengths)
    if piece.model_unit is not None:
        u = piece.model_unit
        view = view.squeeze(u)
        del rel[u], lens[u]
    if piece.stored_unit is not None:
        u = piece.stored_unit
        view = view.unsqueeze(u)
        rel.insert(u, 0)
        lens.insert(u, 1)
    return view, tuple(o + r for o, r in zip(piece.offsets, rel)), tuple(lens)


@dataclass
class Frame:
    """One checkpoint key as this rank sees it: its global ``size``, ``dtype`` and ``requires_grad``, the model
    keys that fill it (``owners``), and the blocks this rank holds: ``pieces`` of (view, offsets, sizes)."""

    key: str
    size: Shape
    dtype: torch.dtype
    requires_grad: bool
    owners: list[str] = field(default_factory=list)
    pieces: list[tuple[torch.Tensor, Shape, Shape]] = field(default_factory=list)
    by_offsets: dict = field(default_factory=dict)

    def at(self, offsets: Any) -> torch.Tensor:
        """The view of the block at ``offsets``."""
        view = self.by_offsets.get(tuple(offsets or ()))
        if view is None:
            raise CheckpointError(f"checkpoint key {self.key!r}: this rank holds no block at offsets {list(offsets or ())}")
        return view

    def add(self, view: torch.Tensor, offsets: Shape, sizes: Shape, owner: str) -> None:
        other = self.by_offsets.get(offsets)
        if other is not None:
            if _same_memory(other, view):
                return  # tied weights: one block, filled (or written) once
            raise RelayoutError(f"model keys {self.owners[0]!r} and {owner!r} both hold the block at offsets {list(offsets)} "
                                f"of checkpoint key {self.key!r} in different memory; the mapping uses that region twice")
        self.by_offsets[offsets] = view
        self.pieces.append((view, offsets, sizes))


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr(), a.shape, a.stride(), a.dtype, a.device) == (b.data_ptr(), b.shape, b.stride(), b.dtype, b.device)


def frames(translation: Translation, local: dict[str, list], dtypes: dict[str, tuple[torch.dtype, bool]],
           skip: Any = ()) -> dict[str, Frame]:
    """This rank's frames: ``local`` gives each model key's blocks, as ``local_pieces`` does; ``dtypes`` its
    ``(dtype, requires_grad)``; model keys in ``skip`` are left out. A frame is made for every checkpoint key the
    translation names, even where this rank holds nothing of it."""
    out: dict[str, Frame] = {}
    for name, pieces in translation.pieces.items():
        if name in skip:
            continue
        dtype, requires_grad = dtypes[name]
        blocks = local.get(name, ())
        for piece in pieces:
            frame = out.get(piece.key)
            if frame is None:
                frame = out[piece.key] = Frame(piece.key, piece.size, dtype, requires_grad)
            elif frame.dtype != dtype:
                raise RelayoutError(f"model keys {frame.owners[0]!r} ({frame.dtype}) and {name!r} ({dtype}) both fill "
                                    f"checkpoint key {piece.key!r}; give them one dtype")
            if name not in frame.owners:
                frame.owners.append(name)
            if not volume(piece.size):
                if blocks and not frame.pieces:  # an empty key is still stored: one empty chunk, from every holder
                    zeros = (0,) * len(piece.size)
                    frame.add(blocks[0][0].new_empty(piece.size), zeros, piece.size, name)
                continue
            for block, offsets, sizes in blocks:
                hit = place(piece, block, tuple(offsets), tuple(sizes))
                if hit is not None:
                    frame.add(hit[0], hit[1], hit[2], name)
    return out
