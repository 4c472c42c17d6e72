"""The encoding of a rank's items through chunk codecs, for the write pipeline (:mod:`.write`)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import torch

from ..format.checksum import crc32c
from ..format.chunk_codec import IDENTITY, ChunkCodec
from ..format.datafile import VALUE_FORM, Entry, stored_form
from ..format.dtypes import element_width, itemsize
from ..planning.resharding import volume

__all__ = ["Encoding"]


class Encoding:
    """The entries of a rank's items; those stored through a codec are encoded by a pool of ``threads`` workers.

    Codecs release the GIL (zstd, numpy's copies), so items encode in parallel. Values are encoded at once
    (their stored length is needed to split the rank's items into files); a tensor is encoded when its file
    is written (``write._RankWrite.encode``), so one file's encoding overlaps another's writing, and only the
    encoded bytes of the files being written are held. At most two items a worker wait for a worker, which
    bounds the host copies held at once. An item that a compression does not shrink is stored as it is."""

    def __init__(self, codecs: list[ChunkCodec], threads: int) -> None:
        self.codecs, self.threads = codecs, max(1, threads)
        self.entries: list[Optional[Entry]] = [None] * len(codecs)
        self.payloads: list[Optional[bytes]] = [None] * len(codecs)
        self.later_: dict[int, tuple[torch.dtype, tuple]] = {}  # tensor items encoded when their file is written
        self.pool: Optional[ThreadPoolExecutor] = None

    def plain(self, i: int, entry: Entry) -> None:
        self.entries[i] = entry

    def value(self, i: int, name: str, raw: bytes, codec: ChunkCodec) -> None:
        if codec.identity:
            self.payloads[i] = raw
            self.entries[i] = Entry(name, VALUE_FORM, (len(raw),), len(raw))
        else:
            stored, recorded = _encode(codec, memoryview(raw), 1)
            self.done(i, name, raw, None, stored, recorded)

    def later(self, i: int, name: str, dtype: torch.dtype, sizes: tuple) -> None:
        """A tensor encoded later: until then its entry holds the size of its bytes, which no stored form exceeds
        by much (a compression that does not shrink an item stores it as it is)."""
        nbytes = volume(sizes) * itemsize(dtype)
        self.entries[i] = Entry(name, VALUE_FORM, (nbytes,), nbytes)
        self.later_[i] = (dtype, sizes)

    def start(self, i: int, data: memoryview) -> Any:
        """Encode the bytes ``data`` of the tensor item ``i`` in the pool; :meth:`finish_one` with the result."""
        codec, width = self.codecs[i], element_width(self.later_[i][0])
        if self.threads == 1:
            return _encode(codec, data, width)
        if self.pool is None:
            self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="distckpt-encode")
        return self.pool.submit(_encode, codec, data, width)

    def finish_one(self, i: int, data: memoryview, job: Any) -> None:
        stored, recorded = job if isinstance(job, tuple) else job.result()
        self.done(i, self.entries[i].name, data, self.later_[i], stored, recorded)

    def done(self, i: int, name: str, data: Any, form: Optional[tuple], stored: Any, recorded: ChunkCodec) -> None:
        if len(stored) >= len(data) and self.codecs[i].skippable:  # not shrunk: stored as it is
            stored, recorded = (None if form is not None else data), IDENTITY  # a tensor written from its memory
        self.codecs[i] = recorded
        self.payloads[i] = stored
        if recorded.identity and form is not None:
            n = volume(form[1]) * itemsize(form[0])
            self.entries[i] = Entry(name, *stored_form(form[0], form[1], n), n)
        else:
            self.entries[i] = Entry(name, VALUE_FORM, (len(stored),), len(stored))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def _encode(codec: ChunkCodec, data: memoryview, width: int) -> tuple[bytes, ChunkCodec]:
    """The stored bytes of one item through ``codec``, and the codec to record it as stored through (with the
    CRC-32C of its bytes, where the codec records one)."""
    stored = codec.encode_item(data, width)
    return stored, codec.expecting(crc32c(data)) if codec.decoded_crc else codec


