"""What the clients of Google Cloud Storage and Azure Blob Storage share: bounded retries of a request, the latch
that stops waiting on an endpoint that stopped answering, objects streamed in order in parts, ranged reads in
parallel pieces.

The S3 client has its own (botocore retries on its side); these serve SDKs whose retries are time-based or
unbounded by default, so that every request here is bounded by the same knobs as S3's: attempts
(``DISTCKPT_S3_MAX_ATTEMPTS``), connect and read timeouts, and backoff of at most 2 s between attempts.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, TypeVar

from .. import events, faults, knobs
from ..engine.blobs import BlobReader, BlobWriter
from ..errors import CheckpointError, StorageIOError
from .s3_objects import _pool

T = TypeVar("T")


def backoff_s(attempt: int) -> float:
    """Seconds to wait before attempt ``attempt + 1``: doubling from 0.1 s, at most 2 s."""
    return min(2.0, 0.1 * 2 ** attempt)


class Requests:
    """The requests of one store object (one save's or one load's, as the storage layer opens a store for each):
    each tried up to the attempts knob, and none at all once the endpoint stopped answering every attempt of an
    earlier one: cleanup after such a failure is skipped rather than waited for (later cleanup removes what it
    leaves, by the lease rules).

    ``transient(exc)`` says whether a failure is worth another attempt (a timeout, a reset, 429, 5xx);
    ``unreachable(exc)`` whether it means the endpoint did not answer at all; ``error(action, where, exc)`` the
    typed error of a failure.
    """

    def __init__(self, service: str, fix: str, transient: Callable[[BaseException], bool],
                 unreachable: Callable[[BaseException], bool], error: Callable[[str, str, BaseException], CheckpointError],
                 failures: Callable[[], tuple]):
        self.service, self.fix = service, fix
        self.transient, self.unreachable, self.error, self.failures = transient, unreachable, error, failures
        self.gone: Optional[str] = None  # what the endpoint failed to answer, once it stopped answering
        self.gone_at = 0.0

    def run(self, action: str, where: str, call: Callable[[], T], attempts: Optional[int] = None) -> T:
        """``call()``, tried again after a transient failure; a typed error naming ``where`` after the last."""
        if self.gone is not None:
            # the requests that follow a failure at once (its cleanup) are skipped; a later operation of a long-lived
            # store (a manager's next save, its retention) tries again: the endpoint may be back
            if time.monotonic() - self.gone_at < _latch_s():
                raise StorageIOError(f"{self.service} {action} {where} skipped: the endpoint stopped answering earlier in "
                                     f"this operation ({self.gone}); {self.fix}")
            self.gone = None
        attempts = knobs.s3_max_attempts() if attempts is None else attempts
        for attempt in range(attempts):
            try:
                return call()
            except CheckpointError:
                raise
            except self.failures() as exc:
                if attempt + 1 < attempts and self.transient(exc):
                    events.add_retry()
                    time.sleep(backoff_s(attempt))
                    continue
                if self.unreachable(exc):
                    self.gone, self.gone_at = f"{action} {where}: {type(exc).__name__}", time.monotonic()
                raise self.error(action, where, exc) from exc
        raise AssertionError("unreachable")  # the loop returns or raises


def _latch_s() -> float:
    """How long requests after an unanswered one are skipped: one request's bound (connect and read timeouts), the
    time the cleanup of the failed operation takes to begin, not the life of the store."""
    connect, read = timeouts()
    return connect + read


def timeouts() -> tuple[float, float]:
    """(connect, read) seconds of each request: the S3 knobs, which bound every object store's requests."""
    return knobs.s3_connect_timeout_s(), knobs.s3_read_timeout_s()


class InOrderWriter(BlobWriter):
    """Streams one object whose bytes arrive in ascending offsets (a gap is zero-filled), as distckpt writes data
    files: an object smaller than one part goes up whole at close (one request); a larger one part by part, each
    handed to ``_send(part)`` as it fills, and finished by ``_finish()``. Subclasses bound how many parts are in
    flight; this class holds at most the one part that fills."""

    def __init__(self, where: str, part_size: int):
        self.where = where
        self.part_size = part_size
        self.buf = bytearray()
        self.pos = 0
        self.started = False  # a part went out: the object is a multi-part upload
        self.lock = threading.Lock()
        self.closed = False

    def pwrite(self, data: memoryview, offset: int) -> None:
        self.pwritev([data], offset)

    def pwritev(self, buffers: list, offset: int) -> None:
        with self.lock:
            faults.point("write", self.where)
            if self.closed:
                raise CheckpointError(f"{self.where}: written after it was closed")
            if offset < self.pos:
                raise CheckpointError(f"{self.where}: object stores take bytes in order; a write at byte {offset} "
                                      f"came after {self.pos} bytes were written")
            if offset > self.pos:
                self._append(memoryview(bytes(offset - self.pos)))
            for b in buffers:
                self._append(memoryview(b).cast("B"))

    def _append(self, view: memoryview) -> None:
        while len(view):
            room = self.part_size - len(self.buf)
            self.buf += view[:room]
            self.pos += min(room, len(view))
            view = view[room:]
            if len(self.buf) >= self.part_size:
                part, self.buf = self.buf, bytearray()
                self.started = True
                self._send(part)

    def close(self, sync: bool) -> None:
        """Send what is buffered and finish the object (both services make it durable before answering)."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            faults.point("fsync", self.where)
            part, self.buf = self.buf, bytearray()
            try:
                if not self.started:
                    self._whole(bytes(part))
                else:
                    if part:
                        self._send(part)
                    self._finish()
            except BaseException:
                self._give_up()
                raise

    def abort(self) -> None:
        with self.lock:
            self.closed = True
            self.buf = bytearray()
            if self.started:
                self._give_up()

    def _whole(self, data: bytes) -> None:
        raise NotImplementedError

    def _send(self, part: bytearray) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError

    def _give_up(self) -> None:
        """Drop what a multi-part upload holds (best effort: the save is discarded, and cleanup removes the rest)."""


class PiecewiseReader(BlobReader):
    """Ranged reads of one version of an object. A read of at least two pieces (``DISTCKPT_S3_READ_PIECE_BYTES``)
    is fetched in parallel pieces; each piece is one request, ``_read_range(views, offset)``, which fills its
    views back to back (many small views of one read share a request)."""

    size: int

    def readinto(self, buf: memoryview, offset: int) -> int:
        return self.readv([buf], offset)

    def readv(self, views: list, offset: int) -> int:
        piece = knobs.s3_read_piece_bytes()
        pieces: list[tuple[list, int]] = [([], offset)]
        filling = total = 0  # bytes in the last piece; bytes in all
        for v in views:
            v = memoryview(v).cast("B")[: max(0, self.size - offset - total)]
            while len(v):
                if filling == piece:
                    pieces.append(([], offset + total))
                    filling = 0
                take = v[: piece - filling]
                pieces[-1][0].append(take)
                filling, total, v = filling + len(take), total + len(take), v[len(take):]
        pieces = [p for p in pieces if p[0]]
        if len(pieces) < 2:
            for piece_views, at in pieces:
                self._read_range(piece_views, at)
            return total
        for future in [_pool().submit(self._read_range, piece_views, at) for piece_views, at in pieces]:
            future.result()
        return total

    def _read_range(self, views: list, offset: int) -> None:
        raise NotImplementedError


class ViewSink:
    """A file-like object that SDK downloads write into, filling ``views`` back to back (and no further)."""

    def __init__(self, views: list):
        self.views = views
        self.size = sum(len(v) for v in views)
        self.filled = 0

    def write(self, data: Any) -> int:
        data = memoryview(data).cast("B")
        if self.filled + len(data) > self.size:
            raise StorageIOError(f"the service sent more bytes than the {self.size} asked for")
        at, start = self.filled, 0
        for v in self.views:
            if at >= len(v):
                at -= len(v)
                continue
            n = min(len(v) - at, len(data) - start)
            v[at: at + n] = data[start: start + n]
            start, at = start + n, 0
            if start == len(data):
                break
        self.filled += len(data)
        return len(data)

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence != 0:
            raise OSError("ViewSink seeks from the start only")
        self.filled = pos
        return pos

    def tell(self) -> int:
        return self.filled
