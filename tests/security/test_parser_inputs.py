"""Regression tests for what fuzzing the parsers of checkpoint bytes found (tests/fuzz): each input here once
escaped as a bare built-in, parsed into something a writer could not write again, or took minutes."""

import json
import math
import random
import struct
import time

import pytest
import torch

from distckpt import CorruptCheckpointError, UnsafeValueError
from distckpt.format.checksum import crc32c
from distckpt.format.codec import encode_metadata, parse_metadata, stored_files
from distckpt.format.datafile import read_header
from distckpt.format.locations import _overlapping_pair, check_cover
from distckpt.format.values import decode_value, encode_value
from distckpt.metadata import BytesStorageMetadata, ChunkStorageMetadata, Metadata


def _sealed(body: bytes) -> bytes:
    return body + b',"crc32c":"' + f"{crc32c(body):08x}".encode() + b'"}\n'


def _document(**members) -> bytes:
    body = {"format": "distckpt", "format_version": "2.0", "state_dict_metadata": {"v": {"type": "bytes"}}, "storage_data": None,
            "planner_data": None, "storage_meta": None, **members}
    return _sealed(json.dumps(body, separators=(",", ":"), allow_nan=True).encode()[:-1])


def _file(header: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + data


def _pread(blob: bytes):
    return lambda n, offset: blob[offset:offset + n]


def _with_table(table: bytes, version: bytes = b"2.0") -> bytes:
    return _sealed(b'{"format":"distckpt","format_version":"' + version + b'","state_dict_metadata":{},'
                   b'"storage_data":{"$files":' + table + b'},"planner_data":null,"storage_meta":null')


@pytest.mark.parametrize("table", [b'{"save_id":"s","files":[["data-00000.safetensors",1e999,0,0]]}',  # int(inf): OverflowError
                                   b'{"save_id":"s","files":[["data-00000.safetensors",1.5,0,0]]}',
                                   b'{"save_id":"s","files":{"a":1}}',
                                   b"[" * 100_000])  # RecursionError
def test_stored_file_table_is_checked(table):
    with pytest.raises(CorruptCheckpointError):
        stored_files(_with_table(table))


def test_stored_files_of_a_good_document():
    files = stored_files(_with_table(b'{"save_id":"s","files":[["data-00000.safetensors",4096,0,7]]}'))
    assert (files.save_id, files.own, files.references) == ("s", {"data-00000.safetensors": 4096}, {})


@pytest.mark.parametrize("rank", [b"1e999", b"-1e999", b"1.5", b'"1e999"', b'"-7"', b"null", b'"' + b"9" * 5000 + b'"'])
def test_data_file_rank_is_an_integer(rank):
    blob = _file(b'{"__metadata__":{"format":"distckpt","save_id":"s","rank":' + rank + b"}}")
    with pytest.raises(CorruptCheckpointError, match="header rank"):
        read_header(_pread(blob), len(blob), "data-00000.safetensors")


@pytest.mark.parametrize("rank, want", [(b'"3"', 3), (b"3", 3), (b'"-1"', -1)])
def test_data_file_rank_as_written(rank, want):
    blob = _file(b'{"__metadata__":{"format":"distckpt","save_id":"s","rank":' + rank + b"}}")
    assert read_header(_pread(blob), len(blob), "data-00000.safetensors").rank == want


def test_lone_surrogate_in_a_data_file_header():
    blob = _file(b'{"__metadata__":{"format":"distckpt","save_id":"s","rank":"0"},"\\udc00":'
                 b'{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}')
    with pytest.raises(CorruptCheckpointError, match="surrogate"):
        read_header(_pread(blob), len(blob), "data-00000.safetensors")


def test_lone_surrogate_in_metadata():
    document = _document(state_dict_metadata={"\ud800": {"type": "bytes"}})  # json.dumps escapes it: "\ud800"
    with pytest.raises(CorruptCheckpointError, match="surrogate"):
        parse_metadata(document, "metadata.json")
    paired = parse_metadata(_document(state_dict_metadata={"\U0001F600": {"type": "bytes"}}), "metadata.json")
    assert list(paired.state_dict_metadata) == ["\U0001F600"]  # a pair, escaped or not, is one character


@pytest.mark.parametrize("meta", [{"save_id": float("inf")}, {"checkpoint_id": 4}, {"load_id": []}, {"modules": "abc"},
                                  {"modules": [1]}, [], "x"])
def test_storage_meta_is_checked(meta):
    with pytest.raises(CorruptCheckpointError, match="storage_meta"):
        parse_metadata(_document(storage_meta=meta), "metadata.json")


def test_storage_meta_as_written():
    md = parse_metadata(_document(storage_meta={"checkpoint_id": "/c", "save_id": None, "load_id": "l", "modules": ["m"]}), "m")
    assert (md.storage_meta.checkpoint_id, md.storage_meta.save_id, md.storage_meta.load_id, md.storage_meta.modules) == \
        ("/c", None, "l", ["m"])


@pytest.mark.parametrize("reserved", ["$files", "$fs"])
def test_opaque_data_named_like_storage_data_reads_back(reserved):
    """A dict whose one member is named "$files" (storage data) or "$fs" was written as it is, and read back as
    distckpt's own storage data, or refused."""
    value = {reserved: {"save_id": "s", "files": []}}
    md = Metadata({"v": BytesStorageMetadata()}, planner_data=dict(value), storage_data=dict(value))
    again = parse_metadata(encode_metadata(md), "metadata.json")
    assert again.storage_data == value and again.planner_data == value


def test_stored_value_with_a_lone_surrogate():
    with pytest.raises(CorruptCheckpointError, match="surrogate"):
        decode_value(b'DCKV1\n{"":"\\ud800on"}')  # loaded, it could not be saved again
    assert decode_value(b'DCKV1\n["\\ud83d\\ude00"]') == ["\U0001F600"]
    with pytest.raises(UnsafeValueError, match="surrogate"):  # was a bare UnicodeEncodeError at save
        encode_value({"k": "\udc80"})


def test_stored_size_beyond_int64():
    """torch.Size holds any Python int, then fails to print or be used: a stored size is held to 64 bits."""
    with pytest.raises(CorruptCheckpointError, match="size"):
        decode_value(b'DCKV1\n{"$t":"size","v":[18446744073709551616]}')
    assert decode_value(b'DCKV1\n{"$t":"size","v":[9223372036854775807]}') == torch.Size([2**63 - 1])


def _brick_wall(rows: int, cols: int, width: int) -> list:
    """Rows of height 1, each cut into bricks of ``width`` at a shift of its own: an exact cover of rows x cols whose
    grid of cuts is rows x cols cells, and no brick one cell of it."""
    chunks = []
    for r in range(rows):
        shift = (r * 7) % width
        starts = [0] + list(range(shift or width, cols, width))
        for a, b in zip(starts, starts[1:] + [cols]):
            chunks.append(ChunkStorageMetadata(torch.Size([r, a]), torch.Size([1, b - a])))
    return chunks


def test_irregular_cover_is_checked_in_n_log_n():
    """37k chunks whose grid is too fine to draw (4096 x 8192 cells) were compared pair by pair: 15 s (and 45
    minutes for 500k, a 20 MB document); a sweep takes a fraction of a second."""
    chunks = _brick_wall(4096, 8192, 1024)
    start = time.perf_counter()
    check_cover(chunks, torch.Size([4096, 8192]), "key 'w'")
    assert time.perf_counter() - start < 3.0
    chunks[-1] = ChunkStorageMetadata(torch.Size([4095, 8100]), torch.Size([1, 92]))  # overlaps its neighbour ...
    chunks.append(ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([1, 0])))  # (the element count still matches)
    held = sum(math.prod(c.sizes) for c in chunks)
    chunks[0] = ChunkStorageMetadata(chunks[0].offsets, torch.Size([1, chunks[0].sizes[1] + 4096 * 8192 - held]))
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        check_cover(chunks, torch.Size([4096, 8192]), "key 'w'")


def _brute(off, end):
    n = len(off)
    return any(all(off[i][k] < end[j][k] and off[j][k] < end[i][k] for k in range(len(off[i])))
               for i in range(n) for j in range(i + 1, n) if all(e > o for o, e in zip(off[i], end[i]))
               and all(e > o for o, e in zip(off[j], end[j])))


@pytest.mark.parametrize("ndim", [2, 3, 4])
def test_overlap_sweep_agrees_with_every_pair(ndim, monkeypatch):
    import numpy as np

    from distckpt.format import locations

    monkeypatch.setattr(locations, "MAX_GRID_CELLS", 0)  # never draw the grid: always sweep
    rng = random.Random(ndim)
    for _ in range(300):
        n = rng.randrange(2, 14)
        off = [[rng.randrange(0, 6) for _ in range(ndim)] for _ in range(n)]
        end = [[o + rng.randrange(0, 4) for o in row] for row in off]
        pair = _overlapping_pair(np.array(off, dtype=np.int64), np.array(end, dtype=np.int64))
        assert (pair is not None) == _brute(off, end), (off, end)
        if pair is not None:
            i, j = pair
            assert i != j and _brute([off[i], off[j]], [end[i], end[j]]), (off, end, pair)
