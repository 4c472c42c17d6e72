"""Pickle-free encoding of non-tensor values.

Values become JSON with a small set of tags for what JSON lacks::

    None, bool, int, str, finite float  -> themselves
    list                                -> JSON array
    dict with str keys (no "$t" key)    -> JSON object
    non-finite float                    -> {"$t": "float", "v": "nan" | "inf" | "-inf"}
    tuple                               -> {"$t": "tuple", "v": [...]}
    bytes / bytearray                   -> {"$t": "bytes", "v": "<base64>"}
    io.BytesIO                          -> {"$t": "bytesio", "v": "<base64 of its buffer>"} (loads at position 0)
    other dict                          -> {"$t": "dict", "v": [[key, value], ...]}
    torch.dtype                         -> {"$t": "dtype", "v": "float32"}
    torch.Size                          -> {"$t": "size", "v": [...]}
    anything else, only if pickling was explicitly allowed
                                        -> {"$t": "pickle", "v": "<base64>"}

The types are taken exactly: a subclass (an IntEnum, a str Enum, numpy's
float64, a namedtuple, an OrderedDict, a list subclass) is not plain data,
whatever its base: storing it as the base would lose its type silently, so
it is refused like any other object unless pickling is allowed. Convert it
first (``int(x)``, ``float(x)``, ``str(x)``, ``list(x)``, ``dict(x)``).

A stored value is the bytes ``MAGIC + json``. Decoding never unpickles unless
the caller opted in; a pickled value met without opt-in raises
:class:`UnsafeValueError` naming the key.
"""

from __future__ import annotations

import base64
import io
import json
import math
from typing import Any

import torch

from ..errors import CorruptCheckpointError, UnsafeValueError
from .datafile import check_text
from .dtypes import dtype_from_name, dtype_name
from .fields import MAX_INT
from .json_text import parse_json

__all__ = ["encode_value", "decode_value", "to_data", "from_data", "MAGIC", "MAX_DEPTH"]

MAGIC = b"DCKV1\n"
MAX_DEPTH = 64
MAX_NODES = 10_000_000

_HINT = (
    "store it as plain data (numbers, strings, bytes, lists, dicts, tensors), "
    "or opt in to pickle for this save and the load with allow_pickle=True"
)


def to_data(value: Any, *, allow_pickle: bool = False, where: str = "value", _depth: int = 0) -> Any:
    """Turn ``value`` into JSON-compatible data, tagging what JSON cannot hold."""
    if _depth > MAX_DEPTH:
        raise UnsafeValueError(f"{where}: nested deeper than {MAX_DEPTH} levels; flatten it")
    kind = type(value)
    if value is None or kind is bool or kind is str or kind is int:
        return value
    if kind is float:
        if math.isfinite(value):
            return value
        return {"$t": "float", "v": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if kind is torch.Size:
        return {"$t": "size", "v": [int(x) for x in value]}
    if kind is list:
        return [to_data(v, allow_pickle=allow_pickle, where=f"{where}[{i}]", _depth=_depth + 1) for i, v in enumerate(value)]
    if kind is tuple:
        return {"$t": "tuple", "v": [to_data(v, allow_pickle=allow_pickle, where=f"{where}[{i}]", _depth=_depth + 1)
                                     for i, v in enumerate(value)]}
    if kind is bytes or kind is bytearray:
        return {"$t": "bytes", "v": base64.b64encode(bytes(value)).decode("ascii")}
    if kind is io.BytesIO:  # DCP's way to save opaque bytes (a torch.save of a list, say): kept as the bytes they are
        return {"$t": "bytesio", "v": base64.b64encode(value.getbuffer()).decode("ascii")}
    if kind is torch.dtype:
        return {"$t": "dtype", "v": dtype_name(value)}
    if type(value) is dict:
        if all(type(k) is str for k in value) and "$t" not in value:
            return {k: to_data(v, allow_pickle=allow_pickle, where=f"{where}.{k}", _depth=_depth + 1) for k, v in value.items()}
        return {
            "$t": "dict",
            "v": [
                [to_data(k, allow_pickle=allow_pickle, where=f"{where} key", _depth=_depth + 1),
                 to_data(v, allow_pickle=allow_pickle, where=f"{where}.{k}", _depth=_depth + 1)]
                for k, v in value.items()
            ],
        }
    if allow_pickle:
        import pickle

        return {"$t": "pickle", "v": base64.b64encode(pickle.dumps(value)).decode("ascii")}
    base = next((b.__name__ for b in (bool, int, float, str, bytes, list, tuple, dict) if isinstance(value, b)), None)
    if base is not None:
        raise UnsafeValueError(
            f"{where}: a value of type {type(value).__qualname__} (a subclass of {base}) is not plain data: stored as a "
            f"{base} it would load as one. Convert it first ({base}(value)), or opt in to pickle for this save and "
            "the load with allow_pickle=True")
    raise UnsafeValueError(f"{where}: a value of type {type(value).__qualname__} cannot be stored without pickle; {_HINT}")


def from_data(data: Any, *, allow_pickle: bool = False, where: str = "value") -> Any:
    """Inverse of :func:`to_data`. Malformed input raises CorruptCheckpointError."""
    budget = [MAX_NODES]
    return _from(data, allow_pickle, where, 0, budget)


def _from(data: Any, allow_pickle: bool, where: str, depth: int, budget: list[int]) -> Any:
    budget[0] -= 1
    if budget[0] < 0:
        raise CorruptCheckpointError(f"{where}: more than {MAX_NODES} nested values")
    if depth > MAX_DEPTH:
        raise CorruptCheckpointError(f"{where}: nested deeper than {MAX_DEPTH} levels")
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [_from(v, allow_pickle, where, depth + 1, budget) for v in data]
    if not isinstance(data, dict):
        raise CorruptCheckpointError(f"{where}: unexpected JSON value of type {type(data).__name__}")
    if "$t" not in data:
        return {k: _from(v, allow_pickle, where, depth + 1, budget) for k, v in data.items()}
    tag, v = data.get("$t"), data.get("v")
    if len(data) != 2:
        raise CorruptCheckpointError(f"{where}: tagged value must have exactly the keys $t and v")
    try:
        if tag == "float":
            if v not in ("nan", "inf", "-inf"):
                raise ValueError(v)
            return float(v)
        if tag == "tuple":
            _need(isinstance(v, list))
            if all(type(x) is str or type(x) is int for x in v):  # a key's path in the state dict: no nesting
                budget[0] -= len(v)
                if budget[0] < 0:
                    raise CorruptCheckpointError(f"{where}: more than {MAX_NODES} nested values")
                return tuple(v)
            return tuple(_from(x, allow_pickle, where, depth + 1, budget) for x in v)
        if tag == "bytes":
            _need(isinstance(v, str))
            return base64.b64decode(v.encode("ascii"), validate=True)
        if tag == "bytesio":
            _need(isinstance(v, str))
            return io.BytesIO(base64.b64decode(v.encode("ascii"), validate=True))
        if tag == "dtype":
            return dtype_from_name(v, where)
        if tag == "size":  # at most 64-bit, as torch holds them: a larger one would build, then fail to print or use
            _need(isinstance(v, list) and all(type(x) is int and 0 <= x <= MAX_INT for x in v))
            return torch.Size(v)
        if tag == "dict":
            _need(isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 for p in v))
            out = {}
            for k, val in v:
                key = _from(k, allow_pickle, where, depth + 1, budget)
                try:
                    hash(key)
                except TypeError:
                    raise ValueError("unhashable key") from None
                out[key] = _from(val, allow_pickle, where, depth + 1, budget)
            return out
        if tag == "pickle":
            if not allow_pickle:
                raise UnsafeValueError(
                    f"{where}: this value was stored pickled; it is not unpickled unless you pass "
                    "allow_pickle=True to load (only do so for a checkpoint you trust)"
                )
            _need(isinstance(v, str))
            import pickle

            return pickle.loads(base64.b64decode(v.encode("ascii"), validate=True))
    except (ValueError, TypeError, base64.binascii.Error) as exc:
        if isinstance(exc, UnsafeValueError) or isinstance(exc, CorruptCheckpointError):
            raise
        raise CorruptCheckpointError(f"{where}: malformed tagged value {tag!r}: {exc}") from None
    raise CorruptCheckpointError(f"{where}: unknown value tag {tag!r}")


def _need(cond: bool) -> None:
    if not cond:
        raise ValueError("wrong payload type")


def encode_value(value: Any, *, allow_pickle: bool = False, where: str = "value") -> bytes:
    """Bytes of a stored non-tensor value."""
    data = to_data(value, allow_pickle=allow_pickle, where=where)
    try:
        return MAGIC + json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")
    except UnicodeEncodeError:
        raise UnsafeValueError(f"{where}: a string in it holds a lone UTF-16 surrogate (\\ud800-\\udfff), which UTF-8 "
                               "cannot store; pair it or drop it (s.encode('utf-8', 'replace').decode())") from None


def decode_value(raw: bytes, *, allow_pickle: bool = False, where: str = "value") -> Any:
    """Decode bytes written by :func:`encode_value`."""
    if not raw.startswith(MAGIC):
        raise CorruptCheckpointError(f"{where}: stored value does not start with the distckpt value marker")
    data = parse_json(raw[len(MAGIC):], f"{where}: stored value")
    try:
        check_text(raw, data)  # "\\ud800" would load as a str that no save could store again
    except ValueError as exc:
        raise CorruptCheckpointError(f"{where}: stored value: {exc}; the file is damaged or was not written by distckpt") from None
    return from_data(data, allow_pickle=allow_pickle, where=where)
