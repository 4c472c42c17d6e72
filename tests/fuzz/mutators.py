"""A structure-aware mutator for the targets whose input holds JSON, used beside libFuzzer's byte mutations.

Byte mutations find bugs in the bytes around the JSON (length prefixes, checksums, encodings) but seldom
turn a string into a list or an integer into 1e999 while keeping the rest valid, and it is there that a
parser of JSON trips (``code not in table`` on an unhashable list, ``int(inf)``). Half the time, this
mutator parses the input's JSON, changes one node (a value of another type or at a boundary, a member
dropped or copied from elsewhere in the document), writes it back and frames it as its target expects:
the metadata document re-sealed with its checksum, a header behind its length prefix, a value behind its
marker. The other half, and whenever the JSON does not parse, libFuzzer mutates the bytes.
"""

from __future__ import annotations

import json
import random
import struct
from typing import Any, Callable, Optional

from .targets import resealed

_TRAILER = b',"crc32c":"'
_MAGIC = b"DCKV1\n"

# values a parser may not expect where it finds them: every JSON type, and integers and floats at the edges
_ODD = [None, True, False, 0, 1, -1, 7, 2**31, 2**32, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30,
        0.5, -0.0, 1e300, float("inf"), float("-inf"), float("nan"), "", "a", "0", "-1", "1e999", "\ud800", "\0",
        "x" * 300, "../x", "F32", "U8", "float32", "bytes", "tensor", [], [0], [[]], [0, 0], [-1, 1], {}, {"": 0},
        {"$t": "tuple", "v": []}, {"$t": "dict", "v": [[[], 0]]}, {"$t": "size", "v": [2**64]}, {"$fs": {}}, {"$files": {}}]


def _nodes(value: Any, path: tuple = (), out: Optional[list] = None, limit: int = 4000) -> list:
    """The paths of ``value``'s nodes, breadth first, at most ``limit`` of them."""
    out = [] if out is None else out
    queue = [(value, path)]
    while queue and len(out) < limit:
        node, at = queue.pop(0)
        out.append(at)
        if isinstance(node, dict):
            queue.extend((v, at + (k,)) for k, v in node.items())
        elif isinstance(node, list):
            queue.extend((v, at + (i,)) for i, v in enumerate(node))
    return out


def _get(root: Any, path: tuple) -> Any:
    for p in path:
        root = root[p]
    return root


def _set(root: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    _get(root, path[:-1])[path[-1]] = value
    return root


def mutate_tree(root: Any, rng: random.Random) -> Any:
    """``root`` with one node changed (in place where it can be)."""
    paths = _nodes(root)
    path = rng.choice(paths)
    node = _get(root, path)
    op = rng.randrange(8)
    if op == 0 and path:  # drop it from its parent
        parent = _get(root, path[:-1])
        del parent[path[-1]]
        return root
    if op == 1:  # a subtree from elsewhere in the document in its place
        return _set(root, path, json.loads(json.dumps(_get(root, rng.choice(paths)))))
    if op == 2 and isinstance(node, (dict, list)) and len(node) > 0:  # one more of its members
        if isinstance(node, list):
            node.insert(rng.randrange(len(node) + 1), json.loads(json.dumps(rng.choice(node))))
        else:
            key = rng.choice(list(node))
            node[key + rng.choice(["", "x", ".0", "@0"])] = json.loads(json.dumps(node[key]))
        return root
    if op == 3 and type(node) is int:  # an integer near it
        return _set(root, path, node + rng.choice([-1, 1, -node - 1, node, 2**32, -(2**63)]))
    if op == 4:  # wrapped, or unwrapped
        if isinstance(node, list) and len(node) == 1:
            return _set(root, path, node[0])
        return _set(root, path, [node])
    if op == 5 and path and isinstance(path[-1], str):  # renamed
        parent = _get(root, path[:-1])
        parent[rng.choice(["", "__metadata__", "$t", "$files", "$fs", path[-1] + "\ud800", path[-1].upper()])] = parent.pop(path[-1])
        return root
    return _set(root, path, json.loads(json.dumps(rng.choice(_ODD))))


def _dumps(value: Any, compact: bool) -> bytes:
    sep = (",", ":") if compact else (", ", ": ")
    return json.dumps(value, separators=sep, ensure_ascii=True).encode("ascii")  # lone surrogates as \ud800 escapes


def _split(kind: str, data: bytes) -> Optional[tuple[Any, Callable[[Any], bytes]]]:
    """The JSON value ``data`` holds and how to frame a changed one as ``kind``; None where it holds none."""
    if kind == "document":
        at = data.rfind(_TRAILER)
        body = data[:at] if at >= 0 else data
        return json.loads(body + b"}"), lambda v: resealed(_dumps(v, True)[:-1]) if isinstance(v, dict) else _dumps(v, True)
    if kind == "framed":
        (n,) = struct.unpack("<Q", data[:8])
        rest = data[8 + n:]

        def frame(v: Any) -> bytes:
            text = _dumps(v, True)
            text += b" " * (-(8 + len(text)) % 8)
            return struct.pack("<Q", len(text)) + text + rest

        return json.loads(data[8:8 + n]), frame
    if kind == "value":
        if not data.startswith(_MAGIC):
            return None
        return json.loads(data[len(_MAGIC):]), lambda v: _MAGIC + _dumps(v, True)
    return json.loads(data), lambda v: _dumps(v, False)


KINDS = {"metadata": "document", "datafile": "framed", "hf_shard": "framed", "value": "value", "hf_index": "plain"}


def json_mutator(kind: str, byte_mutate: Callable[[bytes, int], bytes]) -> Callable[[bytes, int, int], bytes]:
    """A libFuzzer custom mutator: (data, max_size, seed) -> new data."""

    def mutate(data: bytes, max_size: int, seed: int) -> bytes:
        rng = random.Random(seed)
        if rng.random() < 0.5:
            return byte_mutate(data, max_size)
        try:
            value, frame = _split(kind, data)
            out = frame(mutate_tree(value, rng))
        except (ValueError, TypeError, KeyError, IndexError, RecursionError, struct.error):  # not JSON: bytes it is
            return byte_mutate(data, max_size)
        return out if len(out) <= max_size else byte_mutate(data, max_size)

    return mutate
