"""Committed checkpoints written again another way: valid documents and headers whose bytes differ from what
distckpt writes, for tests that a reader decides by parsing, never by matching bytes.

Each function rewrites one committed checkpoint in place, through its store (any scheme), and leaves it valid:
it loads bit-exact and verifies. ``reordered`` and ``spaced`` change the metadata document's layout;
``lookalike_table`` adds a data-file table where only the document's own ``storage_data`` may be read
(inside ``planner_data``); ``header_reordered`` moves the ``__metadata__`` member of a data file's header to
its end, at the same length, and records the header's new checksum in every document of the run that lists
the file.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Callable

from ..backends.schemes import store_for
from ..engine.blobs import BlobStore
from ..format import METADATA_FILE
from ..format.checksum import crc32c
from ..format.codec import stored_files
from ..format.records import split_reference

__all__ = ["reordered", "spaced", "lookalike_table", "header_reordered", "REWRITES", "HEADER_REWRITES"]

_ORDER = ("storage_meta", "planner_data", "storage_data", "tensors", "state_dict_metadata", "format_version", "format")


def _read(store: BlobStore, name: str = METADATA_FILE) -> bytes:
    blob = store.open(name)
    try:
        return blob.pread(blob.size, 0)
    finally:
        blob.close()


def _body(document: bytes) -> dict:
    return json.loads(document[: document.rindex(b',"crc32c":')] + b"}")


def _seal(text: bytes) -> bytes:
    """A document of the JSON object ``text`` (which ends in ``}``) with its checksum member last, as the format asks."""
    prefix = text.rstrip()[:-1].rstrip()
    return prefix + b',"crc32c":"' + f"{crc32c(prefix):08x}".encode() + b'"}\n'


def _rewrite(checkpoint_id: str, change: Callable[[dict], bytes]) -> None:
    store = store_for(checkpoint_id)
    store.put_atomic(METADATA_FILE, _seal(change(_body(_read(store)))), sync=False)


def reordered(checkpoint_id: str) -> None:
    """The document's members in another order (``format`` last but for the checksum), compact as distckpt writes."""
    _rewrite(checkpoint_id, lambda body: json.dumps({k: body[k] for k in _ORDER if k in body},
                                                    separators=(",", ":")).encode())


def spaced(checkpoint_id: str) -> None:
    """The document indented with ordinary JSON spacing."""
    _rewrite(checkpoint_id, lambda body: json.dumps(body, indent=1).encode())


def lookalike_table(checkpoint_id: str) -> None:
    """``planner_data`` holding a data-file table of its own that lists no file, after the document's real one: a
    member ``storage_data`` beside what the planner recorded there (a state dict's nesting, which stays as it is)."""
    def change(body: dict) -> bytes:
        lookalike = {"$files": {"save_id": "lookalike", "files": []}}
        planner = body.get("planner_data")
        if planner is None:
            body["planner_data"] = {"storage_data": lookalike}
        elif isinstance(planner, dict) and ("storage_data" not in planner or "$files" in (planner["storage_data"] or {})):
            body["planner_data"] = {**planner, "storage_data": lookalike}  # (again, where a rewrite put one there)
        else:
            raise ValueError(f"{checkpoint_id}: planner_data {str(planner)[:80]} has no room for a lookalike member")
        return json.dumps(body, separators=(",", ":")).encode()

    _rewrite(checkpoint_id, change)


HEADER_REWRITES = ("reordered", "spaced", "extra_member")


def _header_text(header: dict, how: str) -> bytes:
    meta = header.pop("__metadata__")
    if how == "reordered":  # the save's record last
        return json.dumps({**header, "__metadata__": meta}, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if how == "spaced":  # ordinary JSON spacing
        return json.dumps({"__metadata__": meta, **header}, separators=(", ", ": "), ensure_ascii=False).encode("utf-8")
    if how == "extra_member":  # an entry with a member of its own that looks like the save's record
        first = next(iter(header))
        header[first] = {**header[first], "save_id": meta["save_id"]}
        return json.dumps({"__metadata__": meta, **header}, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raise ValueError(f"no header rewrite {how!r}; one of {HEADER_REWRITES}")


def header_reordered(checkpoint_id: str, run_checkpoints: list[str], how: str = "reordered") -> list[str]:
    """Write the header of every data file checkpoint ``checkpoint_id`` stores again (its length unchanged): its save's
    record (``__metadata__``) moved last (``how="reordered"``), with ordinary JSON spacing (``"spaced"``), or with an
    entry carrying a ``save_id`` member of its own (``"extra_member"``); and record each header's new checksum in
    the document of every checkpoint of ``run_checkpoints`` that lists it (``checkpoint_id``'s own, and the steps
    that reference the file). Returns the names of the files rewritten."""
    store = store_for(checkpoint_id)
    files = stored_files(_read(store))
    assert files is not None, f"{checkpoint_id}: not a distckpt checkpoint"
    data = store.data_store(files.save_id)
    crcs, rewritten_files = {}, {}
    for name in sorted(files.own):  # every file is rewritten in memory first: one that cannot be leaves the step as it is
        raw = _read(data, name)
        (n,) = struct.unpack("<Q", raw[:8])
        text = _header_text(json.loads(raw[8:8 + n]), how)
        if len(text) > n:
            raise ValueError(f"{checkpoint_id}: the header of {name}, written again, is {len(text)} bytes, over its {n}")
        lead = raw[:8] + text + b" " * (n - len(text))
        rewritten_files[name] = lead + raw[8 + n:]
        crcs[name] = crc32c(lead)
    for name, blob in rewritten_files.items():
        data.put_atomic(name, blob, sync=False)
    own_name = checkpoint_id.rstrip("/").rsplit("/", 1)[-1]

    def change(body: dict) -> bytes:
        for row in body["storage_data"]["$files"]["files"]:
            key = row[0]
            if len(row) == 4 and body["storage_data"]["$files"]["save_id"] == files.save_id and key in crcs:
                row[3] = crcs[key]
            elif len(row) == 5 and row[4] == files.save_id:
                parts = split_reference(key)
                if parts is not None and parts[0] == own_name and parts[1] in crcs:
                    row[3] = crcs[parts[1]]
        return json.dumps(body, separators=(",", ":")).encode()

    for other in run_checkpoints:
        _rewrite(other, change)
    return sorted(crcs)


REWRITES: dict[str, Any] = {"reordered": reordered, "spaced": spaced, "lookalike_table": lookalike_table}
