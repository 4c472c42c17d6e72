"""Incremental saves: chunks whose bytes did not change since the previous save are referenced, not written.

A rank keeps, from its previous committed save of a run, a fingerprint of every chunk and value it stored:
where the stored bytes are (the data file, in that step or in the earlier one it referenced), their
checksum and codec, and a BLAKE3 hash of the chunk's bytes. At the next save the write engine hashes each
chunk on the host copy the save has anyway; a chunk whose key, box, dtype and codec match and whose hash
equals the kept one is not written again, and the new step's metadata points at the stored bytes
(format 4.0 references, docs/format.md 3.2). Nothing of the old checkpoint is read back.

Why a cryptographic hash and not the CRC-32C every chunk has: a CRC decides equality wrongly for one changed
chunk in 2**32, so over the chunks of many saves a silent corruption is a matter of time, and it is easy to
forge. A 256-bit cryptographic hash collides by accident with probability about 2**-128 even over all chunks
ever saved, and nobody can make a collision on purpose. BLAKE3 is one (from the BLAKE2 authors), and the
fastest: 4.6 GB/s a core here against SHA-256's 1.8 (docs/performance.md), where a save hashes every byte it
holds. SHA-256 stands in where the blake3 package is missing; fingerprints live in one process, so the two
are never compared.
"""

from __future__ import annotations

import hashlib
import io
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..format.records import FileInfo, referenced_name
from .tensor_bytes import host_bytes

try:
    from blake3 import blake3 as _blake3
except ImportError:  # pragma: no cover - the package is a dependency; SHA-256 where it cannot be installed
    _blake3 = None

HASH_NAME = "blake3" if _blake3 is not None else "sha256"
_THREADED_BYTES = 1 << 20  # a buffer at least this large is hashed by several threads of the hash's own


def new_hasher(threads: int = 1) -> Any:
    """A fresh content hash (``update``, ``digest``)."""
    if _blake3 is None:
        return hashlib.sha256()
    return _blake3(max_threads=max(1, threads))


def content_hash(data: Any, threads: int = 1) -> bytes:
    """The content hash of the bytes of ``data`` (a buffer)."""
    view = memoryview(data)
    hasher = new_hasher(threads if view.nbytes >= _THREADED_BYTES else 1)
    hasher.update(view)
    return hasher.digest()

__all__ = ["Stored", "Reuse", "chunk_key", "digest_of", "digests", "new_hasher", "content_hash", "HASH_NAME"]


def chunk_key(fqn: str, offsets: Optional[tuple], sizes: Optional[tuple], dtype: Any) -> tuple:
    """What must match for a chunk to be the same chunk as one saved before (a value: its key alone)."""
    return (fqn, None if offsets is None else tuple(offsets), None if sizes is None else tuple(sizes), str(dtype))


@dataclass(frozen=True)
class Stored:
    """Where a chunk's bytes are stored: ``file`` of ``checkpoint`` (save ``save_id``), and their hash."""

    checkpoint: str
    file: str
    save_id: str
    info: FileInfo  # the data file's size, rank and header checksum, as its own checkpoint records them
    offset: int
    length: int
    crc32c: int
    codec: str
    digest: bytes

    def table_name(self) -> str:
        return referenced_name(self.checkpoint, self.file)

    def file_info(self) -> FileInfo:
        return FileInfo(self.info.size, self.info.rank, self.info.header_crc32c, self.save_id)


@dataclass
class Reuse:
    """One rank's incremental save: the fingerprints of its previous committed save (``previous``), and those
    of this one once written (``fingerprints``, kept for the next save only after this one commits).

    ``checkpoint`` is the name this save's checkpoint has among its siblings (the step's folder or prefix).

    A save never references a file stored under its own checkpoint's name (docs/format.md, section 6): such a file
    belongs to the save this one replaces (an overwrite, or a step saved again after its deletion), and a table
    keys references by ``<checkpoint>/<file>``, so one document can name one save of each checkpoint only."""

    checkpoint: str
    previous: dict = field(default_factory=dict)
    fingerprints: dict = field(default_factory=dict)
    base: Optional[tuple] = None  # (name, identity of its metadata) of the step ``previous`` comes from, as chosen
    written_bytes: int = 0
    referenced_bytes: int = 0

    def __post_init__(self) -> None:
        if any(st.checkpoint == self.checkpoint for st in self.previous.values()):
            self.previous = {key: st for key, st in self.previous.items() if st.checkpoint != self.checkpoint}


def digest_of(data: Any, dtype: Any) -> bytes:
    """The content hash of what a save would store for ``data`` before any codec: a tensor's elements in ``dtype``, as the
    write engine lays them out; a value's bytes."""
    if isinstance(data, io.BytesIO):
        data = data.getvalue()
    if isinstance(data, (bytes, bytearray, memoryview)):
        return content_hash(data)
    tensor = data.detach()
    if tensor.dtype == torch.bool and dtype == torch.bool and tensor.numel():
        tensor = tensor.view(torch.uint8).ne(0)  # stored as 0 and 1 (format.md, section 4)
    view, _owner = host_bytes(tensor.to(dtype) if tensor.dtype != dtype else tensor)
    return content_hash(view)


def digests(items: list[tuple[Any, Any]], threads: int) -> list[bytes]:
    """:func:`digest_of` of each (data, dtype), host data on ``threads`` threads (hashlib releases the GIL on large
    buffers); a device tensor's in the calling thread, whose stream orders its copy after the work that made it."""
    out: list = [None] * len(items)
    host = [i for i, (d, _) in enumerate(items) if not (isinstance(d, torch.Tensor) and d.device.type != "cpu")]
    for i in sorted(set(range(len(items))) - set(host)):
        out[i] = digest_of(*items[i])
    if threads <= 1 or len(host) < 2:
        for i in host:
            out[i] = digest_of(*items[i])
    else:
        with ThreadPoolExecutor(threads, thread_name_prefix="distckpt-hash") as pool:
            for i, d in zip(host, pool.map(lambda j: digest_of(*items[j]), host)):
                out[i] = d
    return out
