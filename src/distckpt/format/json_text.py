"""JSON read from files distckpt did not necessarily write: every failure is one typed error.

``json.loads`` raises ``ValueError`` on text that is not JSON, ``UnicodeDecodeError`` on bytes that are not
UTF-8, and ``RecursionError`` on arrays or objects nested deeper than the interpreter's recursion limit
(``"[" * 200_000`` is a few hundred kilobytes). :func:`parse_json` turns all three into
:class:`~distckpt.errors.CorruptCheckpointError` naming what was read, so a damaged or forged file never
escapes as a bare built-in. Callers that treat unreadable text as absent keep catching ``ValueError``:
the error derives from it.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional, Union

from ..errors import CorruptCheckpointError

__all__ = ["parse_json"]


def parse_json(raw: Union[bytes, bytearray, memoryview, str], where: str,
               object_pairs_hook: Optional[Callable[[list], Any]] = None) -> Any:
    """``raw`` (UTF-8 bytes or text) parsed as JSON, or CorruptCheckpointError naming ``where``."""
    try:
        text = raw if isinstance(raw, str) else bytes(raw).decode("utf-8")
        return json.loads(text, object_pairs_hook=object_pairs_hook)
    except RecursionError:
        raise CorruptCheckpointError(f"{where}: the JSON nests arrays or objects too deeply to parse; the file is "
                                     "damaged or was not written by distckpt") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise CorruptCheckpointError(f"{where}: not valid JSON ({exc})") from None
