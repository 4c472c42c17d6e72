"""distckpt.open on hostile checkpoints (HOSTILE.md): each damage load refuses, open refuses with a typed error
of the same kind, naming the key or file, before it allocates anything for what the metadata claims, and reads
are bounded by the files as validated."""

import os
import resource

import pytest
import torch

import distckpt
from distckpt.errors import CorruptCheckpointError, NotRegularFileError

from .helpers import blank_like, copy, make_checkpoint, read_body, write_body


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("good") / "ck")
    return path, make_checkpoint(path)


def _data_file(path):
    return os.path.join(path, next(n for n in sorted(os.listdir(path)) if n.endswith(".safetensors")))


def _both_refuse(path, sd, error=CorruptCheckpointError, key="w", index=slice(2, 4)):
    """load and open (a slice of ``key``) raise ``error``; return the two errors."""
    with pytest.raises(error) as by_load:
        distckpt.load(blank_like(sd), checkpoint_id=path, no_dist=True)
    with pytest.raises(error) as by_open:
        with distckpt.open(path) as ckpt:
            ckpt[key][index]
    return by_load.value, by_open.value


def test_a_truncated_data_file_is_refused_before_a_byte_is_delivered(good, tmp_path):
    path, sd = good
    ck = copy(path, str(tmp_path / "ck"))
    name = _data_file(ck)
    os.truncate(name, os.path.getsize(name) - 1)
    _, err = _both_refuse(ck, sd)
    assert os.path.basename(name) in str(err) and "truncated" in str(err)


def test_a_flipped_bit_in_a_header_or_a_chunk_read_whole_is_refused(good, tmp_path):
    path, sd = good
    ck = copy(path, str(tmp_path / "header"))
    with open(_data_file(ck), "r+b") as f:
        f.seek(20)
        byte = f.read(1)[0]
        f.seek(20)
        f.write(bytes([byte ^ 0x01]))
    _both_refuse(ck, sd)  # the header is validated before any slice, even one read in part
    ck = copy(path, str(tmp_path / "chunk"))
    info = distckpt.read_metadata(ck).storage_data.items[distckpt.metadata.MetadataIndex("ids", (0,))]
    with open(os.path.join(ck, info.file), "r+b") as f:
        f.seek(info.offset + 8)
        f.write(b"\xff")
    _, err = _both_refuse(ck, sd, key="ids", index=slice(None))
    assert "checksum mismatch" in str(err) and "'ids'" in str(err) and info.file in str(err)


@pytest.mark.parametrize("shift", [1 << 40, 4, -4])
def test_forged_chunk_extents_are_refused_without_reading_there(good, tmp_path, shift):
    path, sd = good
    ck = copy(path, str(tmp_path / "ck"))
    body = read_body(ck)
    chunk = body["state_dict_metadata"]["w"]["chunks"][0]
    chunk[3] += shift  # the chunk's offset: far past the file's end, or a few bytes off its place
    write_body(ck, body)
    _, err = _both_refuse(ck, sd)
    assert "'w'" in str(err)


@pytest.mark.parametrize("forge", ["dtype", "shape"])
def test_metadata_forged_to_other_bytes_of_the_same_length_disagrees_with_the_header(good, tmp_path, forge):
    path, sd = good
    ck = copy(path, str(tmp_path / "ck"))
    body = read_body(ck)
    entry = body["state_dict_metadata"]["w"]
    if forge == "dtype":
        entry["properties"][0] = "int32"
    else:
        entry["size"] = entry["chunks"][0][1] = [48, 64]
    write_body(ck, body)
    with pytest.raises(CorruptCheckpointError, match="header stores it as F32"):
        with distckpt.open(ck) as ckpt:
            ckpt["w"][1:3]  # a slice read in part: its chunk is still checked against the header first
    with pytest.raises(CorruptCheckpointError, match="header stores it as F32"):
        distckpt.load({"w": torch.zeros(tuple(entry["size"]), dtype=getattr(torch, entry["properties"][0]))},
                      checkpoint_id=ck, no_dist=True, planner=distckpt.DefaultLoadPlanner(allow_partial_load=True))


def test_huge_claimed_shapes_are_refused_before_allocation(good, tmp_path):
    path, sd = good
    ck = copy(path, str(tmp_path / "ck"))
    body = read_body(ck)
    entry = body["state_dict_metadata"]["w"]
    entry["size"] = [1 << 40, 48]
    entry["chunks"][0][1] = [1 << 40, 48]  # one chunk claiming 2**40 rows: the cover check passes
    write_body(ck, body)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CorruptCheckpointError):
        with distckpt.open(ck) as ckpt:
            ckpt["w"].read()  # 2**40 x 48 float32 claimed: 192 TiB
    with pytest.raises(CorruptCheckpointError):
        with distckpt.open(ck) as ckpt:
            ckpt["w"][0]
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 256 * 1024  # KiB: no large allocation
    with pytest.raises(CorruptCheckpointError):
        distckpt.load({"w": torch.zeros(4, 48)}, checkpoint_id=ck, no_dist=True, planner=distckpt.DefaultLoadPlanner(
            allow_partial_load=True))


def test_a_symlinked_data_file_is_not_followed(good, tmp_path):
    path, sd = good
    ck = copy(path, str(tmp_path / "ck"))
    name = _data_file(ck)
    outside = tmp_path / "outside.bin"
    os.replace(name, outside)
    os.symlink(outside, name)
    _, err = _both_refuse(ck, sd, error=NotRegularFileError)
    assert "symbolic link" in str(err)


def test_a_data_file_of_another_save_is_refused(good, tmp_path):
    path, sd = good
    other = str(tmp_path / "other")
    make_checkpoint(other)  # the same state: files of the same names and sizes, another save id
    ck = copy(path, str(tmp_path / "ck"))
    name = os.path.basename(_data_file(ck))
    os.replace(os.path.join(other, name), os.path.join(ck, name))
    _, err = _both_refuse(ck, sd)
    assert "belongs to save" in str(err)


def test_a_file_truncated_after_it_was_opened_fails_the_read_not_the_process(good, tmp_path):
    path, sd = good
    ck = copy(path, str(tmp_path / "ck"))
    with distckpt.open(ck) as ckpt:
        assert torch.equal(ckpt["w"][0:2], sd["w"][0:2])  # the file is open and validated now
        os.truncate(_data_file(ck), 4096)
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            ckpt["w"][30:40]
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            ckpt["step"]
