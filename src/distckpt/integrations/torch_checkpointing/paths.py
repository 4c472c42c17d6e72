"""Paths and file names as this backend spells them: torch_checkpointing's paths turned into URLs, and the hidden
names it keeps beside a checkpoint's files (checksum sidecars, parts being written, directory markers)."""

from __future__ import annotations

import errno
import os
from typing import Any

from ...backends.schemes import scheme_entry, scheme_of

CRC_SUFFIX = ".distckpt-crc"
DIR_MARKER = ".distckpt-dir"
PART_MARK = ".distckpt-part-"
METADATA_PKL = "metadata.pkl"  # torch_checkpointing's metadata file (metadata_serialization.METADATA_FILE_NAME)
MANIFEST_FORMAT = "distckpt.torch_checkpointing"


def to_url(path: Any) -> str:
    """``s3:/b/x`` (what ``Path`` made of ``s3://b/x``) back to ``s3://b/x``; a local path made absolute."""
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if "\x00" in text:
        raise OSError(errno.EINVAL, f"{text!r} holds a NUL byte, which no file or object name may hold")
    if "://" in text:
        scheme, _, rest = text.partition("://")
        return f"{scheme}://{rest.strip('/')}"
    head, sep, rest = text.partition(":/")
    if sep and "/" not in head and head and scheme_entry(f"{head}://x") is not None and head != "file":
        return f"{head}://{rest.strip('/')}"
    if text.startswith("file://"):
        text = text[len("file://"):]
    return os.path.abspath(text)


def split_url(url: str) -> tuple[str, str]:
    parent, _, name = url.rpartition("/")
    return parent, name


def is_local(url: str) -> bool:
    return scheme_of(url) == "file"


def sidecar_name(name: str) -> str:
    head, sep, base = name.rpartition("/")
    return f"{head}{sep}.{base}{CRC_SUFFIX}"


def is_hidden(name: str) -> bool:
    return name == DIR_MARKER or (name.startswith(".") and (name.endswith(CRC_SUFFIX) or PART_MARK in name))


def occupied(src: str, dst: str, code: int) -> FileExistsError:
    return FileExistsError(code, f"refusing to rename {src} onto {dst}: the destination is occupied, and a rename "
                                 "commits onto unoccupied space. Remove it first if it is meant to be replaced.")
