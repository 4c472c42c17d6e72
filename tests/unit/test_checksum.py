"""The checksum every stored byte is verified with: CRC-32C, whatever library computes it."""

import crc32c as reference_lib
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distckpt.format.checksum import crc32c, format_crc, parse_crc


def _bitwise_crc32c(data: bytes, value: int = 0) -> int:
    """CRC-32C from its definition: reflected polynomial 0x82F63B78, init and final XOR 0xFFFFFFFF."""
    crc = value ^ 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_the_catalogue_check_value():
    # the check value every CRC catalogue lists for CRC-32C (docs/format.md repeats it)
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0
    assert crc32c(b"", 0x1234) == 0x1234


@settings(deadline=None)
@given(st.binary(max_size=300), st.integers(0, 300))
def test_matches_the_definition_and_continues_across_pieces(data, cut):
    cut = min(cut, len(data))
    want = _bitwise_crc32c(data)
    assert crc32c(data) == want
    assert crc32c(data[cut:], crc32c(data[:cut])) == want
    assert _bitwise_crc32c(data[cut:], _bitwise_crc32c(data[:cut])) == want


@settings(deadline=None)
@given(st.integers(0, 3 << 20), st.integers(0, 63), st.integers(0, 2**32 - 1), st.sampled_from(["uint8", "float32", "int64"]))
def test_agrees_with_an_independent_library_on_large_unaligned_buffers(n, skew, seed, dtype):
    # the folding paths for long inputs and odd starting addresses, checked against the crc32c package
    raw = np.random.default_rng(seed).integers(0, 256, n + 64, dtype=np.uint8)
    view = memoryview(raw)[skew:skew + n]
    assert crc32c(view) == reference_lib.crc32c(view)
    whole = raw[: (n + 64) // 8 * 8].view(dtype)  # typed buffers, as tensors are handed over
    assert crc32c(memoryview(whole)) == reference_lib.crc32c(memoryview(whole))


def test_writable_and_read_only_buffers_alike():
    a = np.arange(1000, dtype=np.float32)
    assert crc32c(memoryview(a)) == crc32c(a.tobytes()) == crc32c(bytearray(a.tobytes()))


def test_format_and_parse_round_trip():
    assert parse_crc(format_crc(0xE3069283)) == 0xE3069283
    assert format_crc(7) == "00000007"
    for bad in ("e306928", "e30692830", 0xE3069283, None):
        with pytest.raises(ValueError):
            parse_crc(bad)
