"""Damage of any kind is detected, named, and leaves destinations untouched where the issue is structural."""

import os
import random

import pytest
import torch

import distckpt
from distckpt import CheckpointError, CorruptCheckpointError

from .helpers import blank_like, copy, make_checkpoint, snapshot


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("good") / "ck")
    sd = make_checkpoint(path)
    return path, sd


def _files(path):
    return sorted(os.listdir(path))


def _damage(path, name, kind, rng):
    p = os.path.join(path, name)
    data = bytearray(open(p, "rb").read())
    if kind == "flip1":
        off = rng.randrange(len(data))
        data[off] ^= 1 << rng.randrange(8)
        where = off
    elif kind == "flip2":
        off = rng.randrange(len(data))
        off2 = rng.randrange(len(data))
        data[off] ^= 1 << rng.randrange(8)
        data[off2] ^= 1 << rng.randrange(8)
        where = off
    else:  # zeroed 4 KiB page
        page = rng.randrange(max(1, len(data) // 4096 + (len(data) % 4096 > 0)))
        before = bytes(data[page * 4096:(page + 1) * 4096])
        data[page * 4096:(page + 1) * 4096] = bytes(len(before))
        where = page * 4096
    original = open(p, "rb").read()
    if bytes(data) == original:
        return None
    open(p, "wb").write(bytes(data))
    return where


@pytest.mark.parametrize("kind", ["flip1", "flip2", "zero_page"])
@pytest.mark.parametrize("target", ["data", "metadata"])
def test_random_damage_is_always_detected(good, tmp_path, kind, target):
    path, sd = good
    rng = random.Random(f"{kind}-{target}")
    cases = 25
    detected = 0
    for i in range(cases):
        ck = copy(path, str(tmp_path / f"c{i}"))
        name = "metadata.json" if target == "metadata" else [f for f in _files(ck) if f.endswith(".safetensors")][0]
        if _damage(ck, name, kind, rng) is None:
            detected += 1  # the damage happened to change nothing
            continue
        with pytest.raises(CheckpointError) as exc_info:
            distckpt.verify(ck)
        assert name in str(exc_info.value) or "metadata" in str(exc_info.value)
        with pytest.raises(CheckpointError) as load_info:
            distckpt.load(blank_like(sd), checkpoint_id=ck)
        assert name in str(load_info.value) or "metadata" in str(load_info.value)
        detected += 1
    assert detected == cases


def test_checksum_error_names_key_chunk_file_and_offset(good, tmp_path):
    path, sd = good
    ck = copy(path, str(tmp_path / "c"))
    md = distckpt.read_metadata(ck)
    si = md.storage_data.items[distckpt.metadata.MetadataIndex("w", [0, 0])]
    p = os.path.join(ck, si.file)
    data = bytearray(open(p, "rb").read())
    data[si.offset + 100] ^= 0x10
    open(p, "wb").write(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=rf"'w'.*chunk \[0, 0\].*{si.file}.*offset {si.offset}"):
        distckpt.load(blank_like(sd), checkpoint_id=ck)
    with pytest.raises(CorruptCheckpointError, match=rf"'w'.*chunk \[0, 0\].*{si.file}.*offset {si.offset}"):
        distckpt.verify(ck)
    # skipping verification is an explicit choice
    out = blank_like(sd)
    distckpt.load(out, storage_reader=distckpt.FileSystemReader(ck, verify_checksums=False))
    assert not torch.equal(out["w"], sd["w"]) and torch.equal(out["ids"], sd["ids"])


@pytest.mark.parametrize("action", ["truncate", "delete"])
def test_truncated_or_deleted_files_leave_destinations_untouched(good, tmp_path, action):
    path, sd = good
    for name in _files(path):
        ck = copy(path, str(tmp_path / f"{action}-{name}"))
        p = os.path.join(ck, name)
        if action == "delete":
            os.remove(p)
        else:
            size = os.path.getsize(p)
            with open(p, "r+b") as f:
                f.truncate(size - 1)
        dest = blank_like(sd)
        dest["w"].fill_(7.0)
        before = snapshot(dest)
        with pytest.raises(CheckpointError) as exc_info:
            distckpt.load(dest, checkpoint_id=ck)
        assert name in str(exc_info.value) or "metadata" in str(exc_info.value)
        for k, v in before.items():
            assert torch.equal(dest[k], v), f"{k} was modified although {name} was {action}d"
        with pytest.raises(CheckpointError):
            distckpt.verify(ck)


def test_data_file_from_another_save_is_detected(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    sd = make_checkpoint(a, seed=1)
    make_checkpoint(b, seed=2)  # same shapes, other values
    name = [f for f in _files(a) if f.endswith(".safetensors")][0]
    os.replace(os.path.join(b, name), os.path.join(a, name))
    dest = blank_like(sd)
    before = snapshot(dest)
    with pytest.raises(CorruptCheckpointError, match="another checkpoint|another save|belongs to save"):
        distckpt.load(dest, checkpoint_id=a)
    assert all(torch.equal(dest[k], v) for k, v in before.items())
    with pytest.raises(CorruptCheckpointError, match=name):
        distckpt.verify(a)


def test_verify_passes_a_good_checkpoint_and_counts_bytes(good):
    path, _ = good
    report = distckpt.verify(path)
    assert report.ok and report.items == 7 and report.bytes_checked > 64 * 48 * 4


def test_verify_reads_through_the_load_engine_and_reports_every_problem(tmp_path, monkeypatch):
    """verify() streams each chunk through the engine's read buffers (within the memory budget, several
    threads) and keeps going after a problem: a damaged chunk in one file and a damaged header in another
    are both reported, with the items of the healthy parts checked."""
    from distckpt.engine import read

    monkeypatch.setenv("DISTCKPT_MIN_FILE_BYTES", str(4096))  # several data files
    monkeypatch.setenv("DISTCKPT_IO_THREADS", "3")
    sd = {f"w{i}": torch.randn(256, 64, generator=torch.Generator().manual_seed(i)) for i in range(6)}
    sd["step"] = 9
    path = str(tmp_path / "ck")
    md = distckpt.save(sd, checkpoint_id=path)
    files = sorted(md.storage_data.files)
    assert len(files) == 3
    slabs = []
    real = read.Read.read_slab
    monkeypatch.setattr(read.Read, "read_slab", lambda self, *a: slabs.append(1) or real(self, *a))
    monkeypatch.setenv("DISTCKPT_MEMORY_BUDGET_BYTES", str(16 << 10))  # a chunk is 64 KiB: it goes in slabs
    assert distckpt.verify(path).ok and len(slabs) >= 6 * 4
    in_first = [ix for ix, si in md.storage_data.items.items() if si.file == files[0] and ix.fqn.startswith("w")][0]
    si = md.storage_data.items[in_first]
    with open(os.path.join(path, si.file), "r+b") as f:
        f.seek(si.offset + 100)
        byte = f.read(1)
        f.seek(si.offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with open(os.path.join(path, files[1]), "r+b") as f:
        f.seek(20)
        byte = f.read(1)
        f.seek(20)
        f.write(bytes([byte[0] ^ 0xFF]))
    report = distckpt.verify(path, raise_on_error=False)
    assert len(report.problems) == 2, report.problems
    assert any(repr(in_first.fqn) in p and "checksum mismatch" in p for p in report.problems)
    assert any(files[1] in p for p in report.problems)
    in_second = sum(1 for s in md.storage_data.items.values() if s.file == files[1])
    assert report.files == 3 and report.items == len(md.storage_data.items) - in_second - 1
    with pytest.raises(CorruptCheckpointError, match="2 problem"):
        distckpt.verify(path)
