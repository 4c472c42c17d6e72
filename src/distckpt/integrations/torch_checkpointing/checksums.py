"""A file's CRC-32C per block, as its JSON sidecar holds them, and the streams that compute them while writing
and check them while reading."""

from __future__ import annotations

import errno
import io
import json
from typing import Optional

from ...engine.blobs import BlobReader
from ...errors import CorruptCheckpointError
from ...format.checksum import crc32c, format_crc, parse_crc
from ...format.json_text import parse_json


class BlockCrcs:
    """The CRC-32C of each block of a file, as its sidecar holds them."""

    def __init__(self, size: int, block: int, crcs: list[int]):
        self.size, self.block, self.crcs = size, block, crcs

    def encode(self) -> bytes:
        return json.dumps({"format": "distckpt.block-crc32c", "version": 1, "size": self.size, "block_bytes": self.block,
                           "crc32c": [format_crc(c) for c in self.crcs]}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes, where: str) -> "BlockCrcs":
        doc = parse_json(raw, where)
        try:
            if not isinstance(doc, dict) or doc.get("format") != "distckpt.block-crc32c" or doc.get("version") != 1:
                raise ValueError("not a distckpt block-checksum document of version 1")
            size, block, crcs = doc["size"], doc["block_bytes"], doc["crc32c"]
            if type(size) is not int or type(block) is not int or size < 0 or block < 4096 or not isinstance(crcs, list):
                raise ValueError("size, block_bytes or crc32c of the wrong type")
            if len(crcs) != -(-size // block):
                raise ValueError(f"{len(crcs)} checksums for {size} bytes in blocks of {block}")
            return cls(size, block, [parse_crc(c) for c in crcs])
        except (KeyError, ValueError) as exc:
            raise CorruptCheckpointError(f"{where}: {exc}; the checksum file is damaged") from None


class ChecksummingWriter(io.RawIOBase):
    """A write stream into one blob: bytes go to the blob in order while each block's CRC is computed."""

    def __init__(self, blob, block: int, where: str, finish):
        self._blob, self._block, self._where, self._finish = blob, block, where, finish
        self._pos = 0
        self._crc = 0
        self._fill = 0
        self._crcs: list[int] = []
        self._done = False
        self._failed: Optional[BaseException] = None  # a write that failed: close then commits nothing

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def write(self, data) -> int:
        if self._done or self.closed:
            raise ValueError("I/O operation on closed file")
        view = memoryview(data)
        if not view.c_contiguous:
            view = memoryview(bytes(view))
        view = view.cast("B")
        n = len(view)
        if n:
            try:
                self._blob.pwrite(view, self._pos)
            except BaseException as exc:
                self._failed = exc  # the blob now holds an unknown part of these bytes: never committed
                raise
            at = 0
            while at < n:
                take = min(n - at, self._block - self._fill)
                self._crc = crc32c(view[at: at + take], self._crc)
                self._fill += take
                at += take
                if self._fill == self._block:
                    self._crcs.append(self._crc)
                    self._crc, self._fill = 0, 0
            self._pos += n
        return n

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()
        return super().__exit__(exc_type, exc, tb)

    def abort(self) -> None:
        if not self._done:
            self._done = True
            try:
                self._blob.abort()
            finally:
                self._finish(None)
        super().close()

    def close(self) -> None:
        if not self._done and self._failed is not None:
            failed = self._failed
            self.abort()
            code = failed.errno if isinstance(failed, OSError) and failed.errno else errno.EIO
            raise OSError(code, f"{self._where} was not written: a write to it failed ({failed}), so closing it "
                                "committed nothing and removed what was written") from None
        if not self._done:
            self._done = True
            if self._fill:
                self._crcs.append(self._crc)
            try:
                self._finish(BlockCrcs(self._pos, self._block, self._crcs))
            except BaseException:
                super().close()
                raise
        super().close()


class VerifyingReader(io.RawIOBase):
    """A seekable read stream over one blob that checks the CRC of every block it hands out bytes of."""

    def __init__(self, blob: BlobReader, crcs: Optional[BlockCrcs], where: str):
        self._blob, self._crcs, self._where = blob, crcs, where
        self.size = blob.size
        self._pos = 0
        self._cached: tuple[int, Optional[bytearray]] = (-1, None)  # the last partly read block, verified
        if crcs is not None and crcs.size != blob.size:
            raise CorruptCheckpointError(f"{where} holds {blob.size} bytes, but its checksums were written for "
                                         f"{crcs.size}; the file is damaged or was replaced")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._checkClosed()
        if whence not in (io.SEEK_SET, io.SEEK_CUR, io.SEEK_END):
            raise ValueError(f"invalid whence ({whence!r}, should be {io.SEEK_SET}, {io.SEEK_CUR} or {io.SEEK_END})")
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise OSError(errno.EINVAL, f"seek before the start of {self._where}")
        self._pos = base + offset
        return self._pos

    def _check(self, index: int, data) -> None:
        want = self._crcs.crcs[index]
        got = crc32c(data)
        if got != want:
            start = index * self._crcs.block
            raise CorruptCheckpointError(
                f"{self._where}: bytes {start}-{start + len(data) - 1} fail their CRC-32C (stored {format_crc(want)}, "
                f"read {format_crc(got)}); the file is damaged. Load an intact checkpoint.")

    def _fill(self, view: memoryview, offset: int) -> None:
        got = self._blob.readinto(view, offset)
        if got != len(view):
            raise CorruptCheckpointError(f"{self._where}: {got} bytes where {len(view)} were expected at offset {offset}; "
                                         "the file is shorter than when it was written")

    def readinto(self, buffer) -> int:
        # Every view of the caller's buffer is released before an error leaves: torch_checkpointing fills an
        # mmap through this call and closes it on the way out, which a live view would turn into BufferError.
        if self.closed:
            raise ValueError("I/O operation on closed file")
        error = None
        with memoryview(buffer) as outer, outer.cast("B") as view:
            try:
                return self._readinto(view)
            except (CorruptCheckpointError, OSError) as exc:
                error = exc.with_traceback(None)
        raise error

    def _readinto(self, view: memoryview) -> int:
        n = max(0, min(len(view), self.size - self._pos))
        if n == 0:
            return 0
        if self._crcs is None:
            self._fill(view[:n], self._pos)
            self._pos += n
            return n
        block = self._crcs.block
        done = 0
        while done < n:
            at = self._pos + done
            index, start = divmod(at, block)
            length = min(block, self.size - index * block)
            if start == 0 and n - done >= length:  # a whole block: straight into the caller's memory
                self._fill(view[done: done + length], at)
                self._check(index, view[done: done + length])
                done += length
                continue
            if self._cached[0] != index:
                scratch = bytearray(length)
                self._fill(memoryview(scratch), index * block)
                self._check(index, scratch)
                self._cached = (index, scratch)
            take = min(length - start, n - done)
            view[done: done + take] = self._cached[1][start: start + take]
            done += take
        self._pos += n
        return n

    def readall(self) -> bytes:
        self._checkClosed()
        out = bytearray(max(0, self.size - self._pos))
        self.readinto(out)
        return bytes(out)

    def close(self) -> None:
        if not self.closed:
            self._blob.close()
        super().close()
