"""I/O in cache-sized windows: every byte lands where it belongs and is checksummed exactly once."""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import distckpt
from distckpt.engine import data_files
from distckpt.engine import read as reading
from distckpt.engine.windows import windows
from distckpt.errors import CorruptCheckpointError
from distckpt.format import datafile
from distckpt.format.checksum import crc32c
from distckpt.testing.states import seeded


@settings(deadline=None)
@given(st.lists(st.integers(0, 50), max_size=8), st.integers(1, 40))
def test_windows_cover_each_view_in_order_and_fill_every_window_but_the_last(sizes, size):
    views = [memoryview(bytes(range(n))) for n in sizes]
    got = list(windows(views, size))
    for j, view in enumerate(views):
        assert b"".join(bytes(p) for w in got for i, p in w if i == j) == bytes(view)
        assert any(i == j for w in got for i, _ in w)  # even an empty view is seen
    lengths = [sum(len(p) for _, p in w) for w in got]
    assert all(n == size for n in lengths[:-1]) and (not lengths or lengths[-1] <= size)
    order = [i for w in got for i, p in w if len(p)]
    assert order == sorted(order)


def _state():
    return seeded({"big": 5 << 18, "small": 100, "ids": torch.arange(1000)})  # big: 5 MiB, split over three windows


def test_save_and_load_across_windows_are_exact_and_a_flip_in_a_later_window_is_caught(tmp_path):
    sd = _state()
    ck = str(tmp_path / "ck")
    distckpt.save(sd, checkpoint_id=ck)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    distckpt.load(out, checkpoint_id=ck)
    assert all(torch.equal(out[k], sd[k]) for k in sd)

    info = distckpt.read_metadata(ck).storage_data.items[distckpt.metadata.MetadataIndex("big", [0])]
    assert info.crc32c == crc32c(sd["big"].numpy().tobytes())  # the save checksummed its windows in order
    distckpt.verify(ck)
    path = os.path.join(ck, info.file)
    with open(path, "r+b") as f:
        f.seek(info.offset + (3 << 20) + 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(CorruptCheckpointError, match=rf"'big'.*{info.file}.*offset {info.offset}"):
        distckpt.load({k: torch.zeros_like(v) for k, v in sd.items()}, checkpoint_id=ck)


@pytest.mark.parametrize("verify", [True, False])
def test_load_checksums_the_data_once_or_not_at_all(tmp_path, monkeypatch, verify):
    sd = _state()
    ck = str(tmp_path / "ck")
    distckpt.save(sd, checkpoint_id=ck)
    checked = []

    def counting(data, value=0):
        checked.append(len(memoryview(data).cast("B")))
        return crc32c(data, value)
    monkeypatch.setattr(reading, "crc32c", counting)
    monkeypatch.setattr(data_files, "crc32c", counting)  # the lead's, where the header is the one the metadata implies
    monkeypatch.setattr(datafile, "crc32c", counting)  # the header's, checked whenever a file is opened
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    distckpt.load(out, storage_reader=distckpt.FileSystemReader(ck, verify_checksums=verify))
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    data = sum(v.numel() * v.element_size() for v in sd.values())
    header = sum(checked) - (data if verify else 0)  # the file header's checksum proves the file belongs to the save
    assert 0 < header < 64 << 10
