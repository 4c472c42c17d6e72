"""Checksums of stored bytes: CRC-32C (Castagnoli), hardware accelerated, GIL released."""

from __future__ import annotations

import crc32c as _crc

__all__ = ["crc32c", "format_crc", "parse_crc"]


def crc32c(data, value: int = 0) -> int:
    """CRC-32C of ``data`` (any buffer), continuing from ``value``."""
    return _crc.crc32c(data, value)


def format_crc(value: int) -> str:
    return f"{value:08x}"


def parse_crc(text: object) -> int:
    if not isinstance(text, str) or len(text) != 8:
        raise ValueError(f"checksum {text!r} is not 8 hex digits")
    return int(text, 16)
