"""A check of a pickle's opcodes before any unpickler runs on it.

Python's C unpickler grows its memo to whatever index a PUT names: nine bytes that name index 2**29 take 4 GiB,
and 2**31 the whole machine. A pickle's memo indices are its own count of memoized objects, so an index larger
than the pickle itself is a forgery.
"""

from __future__ import annotations

import pickletools

from ..errors import CorruptCheckpointError

__all__ = ["check_memo"]

_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}


def check_memo(data: bytes, where: str) -> None:
    """Raise CorruptCheckpointError where a pickle memoizes at an index larger than its length, or is malformed."""
    limit = len(data)
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in _PUTS and not 0 <= int(arg) <= limit:
                raise CorruptCheckpointError(f"{where}: the pickle memoizes an object at index {arg}, beyond any it "
                                             "could hold; it is damaged or forged")
    except CorruptCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - pickletools raises ValueError and others on malformed input
        raise CorruptCheckpointError(f"{where}: not a pickle ({type(exc).__name__}: {exc})") from None
