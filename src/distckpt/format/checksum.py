"""Checksums of stored bytes: CRC-32C (Castagnoli).

Computed by ``fastcrc``, which folds with carry-less multiplication (AVX-512
or PCLMULQDQ on x86-64, PMULL on Arm) and releases the GIL, so the I/O
threads checksum in parallel, at about twice the rate of the ``crc32c``
package (docs/performance.md, "Checksums from cache", has the figures).
The format fixes the algorithm, not the library: any CRC-32C gives the same
checksums.
"""

from __future__ import annotations

from fastcrc import crc32 as _crc32

__all__ = ["crc32c", "format_crc", "parse_crc"]

# crc32c(data, value=0): the CRC-32C of ``data`` (any contiguous buffer), continuing from ``value``. The
# library's function itself, not a wrapper: a load of many small items calls it once per item.
# ("iscsi" is CRC-32C's catalogue name: poly 0x1EDC6F41, reflected, init and xorout 0xFFFFFFFF.)
crc32c = _crc32.iscsi


def format_crc(value: int) -> str:
    return f"{value:08x}"


def parse_crc(text: object) -> int:
    if not isinstance(text, str) or len(text) != 8:
        raise ValueError(f"checksum {text!r} is not 8 hex digits")
    return int(text, 16)
