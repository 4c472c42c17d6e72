"""distckpt as torch_checkpointing's storage backend (torch-checkpointing==0.1.1, the test extra's pin).

torch_checkpointing's own CheckpointManager saves, loads and reshards (DTensor, DefaultResharder) through
DistckptStorage at 1 to 3 ranks on disk, in memory:// and on S3 (moto's server on loopback); a rank killed
mid-save leaves the last committed step loadable; a flipped bit fails the load with a typed error.
"""

from __future__ import annotations

import errno
import os
import pickle
from pathlib import Path

import pytest
import torch

pytest.importorskip("torch_checkpointing")

from distckpt.errors import CorruptCheckpointError, NotRegularFileError, UnsafeValueError  # noqa: E402
from distckpt.format.values import MAGIC  # noqa: E402
from distckpt.integrations.torch_checkpointing import DistckptStorage, DistckptStorageConfig  # noqa: E402
from distckpt.testing import run_ranks  # noqa: E402

from . import torch_checkpointing_workers as workers  # noqa: E402

# ---------------------------------------------------------------- the Storage contract, on each store


@pytest.fixture(scope="module")
def s3_root():
    pytest.importorskip("moto")
    import boto3

    from tests.storage.s3_server import new_bucket, s3_server

    with s3_server() as endpoint:
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        yield f"s3://{new_bucket(client)}/run"


@pytest.fixture(params=["file", "memory", "s3"])
def root(request, tmp_path):
    if request.param == "file":
        return str(tmp_path)
    if request.param == "memory":
        return f"memory://tc-{os.urandom(4).hex()}"
    return request.getfixturevalue("s3_root") + f"/{os.urandom(4).hex()}"


def test_files_directories_and_the_rename_table(root):
    s = DistckptStorage(DistckptStorageConfig(block_bytes=4096))
    data = os.urandom(10_000)
    s.mkdir(Path(f"{root}/tmp_a"))
    s.write(Path(f"{root}/tmp_a/x.bin"), data)
    with s.stream_write(Path(f"{root}/tmp_a/y.bin")) as f:
        f.write(data[:5000])
        f.write(memoryview(data)[5000:])
    assert s.read(Path(f"{root}/tmp_a/x.bin")) == data
    assert s.getsize(Path(f"{root}/tmp_a/y.bin")) == len(data)
    with s.stream_read(Path(f"{root}/tmp_a/y.bin")) as r:  # ranged reads across block edges
        r.seek(4090)
        assert r.read(20) == data[4090:4110]
        buf = bytearray(8192)
        r.seek(4096)
        assert r.readinto(buf) == 5904 and bytes(buf[:5904]) == data[4096:]
    assert s.ls(Path(f"{root}/tmp_a")) == ["x.bin", "y.bin"]  # the checksum files stay out of sight
    assert s.isdir(Path(f"{root}/tmp_a")) and not s.isdir(Path(f"{root}/tmp_a/x.bin"))
    assert s.exists(Path(f"{root}/tmp_a/x.bin")) and not s.exists(Path(f"{root}/tmp_a/z.bin"))

    # directory onto absent: commit, contents land AT the destination
    s.rename(Path(f"{root}/tmp_a"), Path(f"{root}/a"), is_directory=True)
    assert not s.exists(Path(f"{root}/tmp_a"))
    assert s.ls(Path(f"{root}/a")) == ["x.bin", "y.bin"] and s.read(Path(f"{root}/a/y.bin")) == data
    assert "a" in s.ls(Path(root))
    # directory onto a populated directory, or onto a file: OSError, nothing merged or lost
    s.mkdir(Path(f"{root}/tmp_b"))
    s.write(Path(f"{root}/tmp_b/x.bin"), b"other")
    with pytest.raises(OSError):
        s.rename(Path(f"{root}/tmp_b"), Path(f"{root}/a"), is_directory=True)
    with pytest.raises(OSError):
        s.rename(Path(f"{root}/tmp_b"), Path(f"{root}/a/x.bin"), is_directory=True)
    assert s.read(Path(f"{root}/a/x.bin")) == data and s.read(Path(f"{root}/tmp_b/x.bin")) == b"other"
    # a committed directory is never written into again
    if "://" in root:
        with pytest.raises(OSError):
            s.write(Path(f"{root}/a/z.bin"), b"z")
    # directory onto an empty directory: replace it
    s.mkdir(Path(f"{root}/c"))
    s.rename(Path(f"{root}/tmp_b"), Path(f"{root}/c"), is_directory=True)
    assert s.read(Path(f"{root}/c/x.bin")) == b"other"
    s.rmdir(Path(f"{root}/c"))
    assert not s.exists(Path(f"{root}/c"))


def test_local_file_rows_of_the_rename_table(tmp_path):
    s = DistckptStorage()
    s.write(tmp_path / "f", b"one")
    s.write(tmp_path / "g", b"two")
    s.rename(tmp_path / "f", tmp_path / "h")  # file onto absent: commit
    s.rename(tmp_path / "g", tmp_path / "h")  # file onto file: replace, with its checksums
    assert s.read(tmp_path / "h") == b"two" and not s.exists(tmp_path / "g")
    (tmp_path / "d").mkdir()
    with pytest.raises(OSError) as info:  # file onto a directory, empty or not
        s.rename(tmp_path / "h", tmp_path / "d")
    assert info.value.errno == errno.EISDIR
    s.delete(tmp_path / "h")
    assert sorted(os.listdir(tmp_path)) == ["d"]


def test_links_and_non_regular_files_are_refused(tmp_path):
    s = DistckptStorage()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"keep")
    (tmp_path / "ckpt").mkdir()
    os.symlink(outside / "secret", tmp_path / "ckpt" / "model_0.pt")
    with pytest.raises(NotRegularFileError):
        s.read(tmp_path / "ckpt" / "model_0.pt")
    with pytest.raises(NotRegularFileError):
        s.delete(tmp_path / "ckpt" / "model_0.pt")
    os.symlink(outside, tmp_path / "linked")
    with pytest.raises(NotRegularFileError):
        s.write(tmp_path / "linked" / "x", b"x")
    with pytest.raises(NotRegularFileError):
        s.rmdir(tmp_path / "linked")
    os.mkfifo(tmp_path / "ckpt" / "fifo")
    with pytest.raises(NotRegularFileError):
        s.read(tmp_path / "ckpt" / "fifo")
    with pytest.raises(NotRegularFileError):  # a tree holding a link is not removed whole, and nothing outside goes
        s.rmdir(tmp_path / "ckpt")
    assert (outside / "secret").read_bytes() == b"keep" and os.listdir(outside) == ["secret"]


# ---------------------------------------------------------------- metadata.pkl without pickle


def test_metadata_is_json_on_disk_and_a_planted_pickle_is_never_loaded(tmp_path):
    s = DistckptStorage()
    s.mkdir(tmp_path / "c")
    meta = {"metadata": {"model": {"rank_to_layout_info": {0: None}, "x": (1, 2)}}, "world_size": 1, "version": "2.0"}
    s.write(tmp_path / "c" / "metadata.pkl", pickle.dumps(meta))
    assert (tmp_path / "c" / "metadata.pkl").read_bytes().startswith(MAGIC)
    assert pickle.loads(s.read(tmp_path / "c" / "metadata.pkl")) == meta  # what torch_checkpointing unpickles

    class Boom:
        def __reduce__(self):
            return (os.mkdir, (str(tmp_path / "pwned"),))

    with pytest.raises(UnsafeValueError, match="pickled_metadata"):
        s.write(tmp_path / "c" / "metadata.pkl", pickle.dumps({"x": Boom()}))
    forged = DistckptStorage(DistckptStorageConfig(verify=False))
    (tmp_path / "c" / "metadata.pkl").write_bytes(pickle.dumps(Boom()))
    with pytest.raises(UnsafeValueError):
        forged.read(tmp_path / "c" / "metadata.pkl")
    assert not (tmp_path / "pwned").exists()


def test_the_storage_says_at_its_first_file_that_distckpt_holds_the_checkpoints_where_and_how(tmp_path, caplog):
    import logging

    s = DistckptStorage()
    s.mkdir(tmp_path / "tmp_step_1")
    with caplog.at_level(logging.INFO, logger="distckpt"):
        with s.stream_write(tmp_path / "tmp_step_1" / "model_0.pt") as f:
            f.write(b"weights")
        s.write(tmp_path / "tmp_step_1" / "step_0.pt", b"7")
    said = [r.getMessage() for r in caplog.records if r.name == "distckpt" and "saved by distckpt" in r.getMessage()]
    assert len(said) == 1, said
    assert str(tmp_path / "tmp_step_1") in said[0] and "sidecar" in said[0] and "metadata.pkl as JSON" in said[0]


# ---------------------------------------------------------------- torch_checkpointing's own save, load, reshard


def test_save_at_two_ranks_load_at_one_two_and_three(tmp_path):
    path = str(tmp_path / "step_5")
    run_ranks(workers.save, 2, path, 5)
    assert sorted(os.listdir(tmp_path)) == ["step_5"]
    assert (tmp_path / "step_5" / "metadata.pkl").read_bytes().startswith(MAGIC)
    for world in (1, 3):
        for rank, (whole, step) in enumerate(run_ranks(workers.load, world, path, 2)):
            assert step == (5 if rank < 2 else -1) and torch.equal(whole, workers.full(5))


def test_memory_store_one_process():
    path = f"memory://tc-{os.urandom(4).hex()}/step_3"
    run_ranks(_memory_round_trip, 1, path)


def _memory_round_trip(rank, world_size, path):
    workers.save(rank, world_size, path, 3)
    whole, step = workers.load(rank, world_size, path)
    assert step == 3 and torch.equal(whole, workers.full(3))


def test_s3_save_at_two_ranks_load_at_one(s3_root):
    path = f"{s3_root}/reshard/step_7"
    run_ranks(workers.save, 2, path, 7)
    [(whole, step)] = run_ranks(workers.load, 1, path, 2)
    assert step == 7 and torch.equal(whole, workers.full(7))
    s = DistckptStorage()
    assert s.ls(Path(f"{s3_root}/reshard")) == ["step_7"]  # the temporary directory is gone


def test_a_rank_killed_mid_save_leaves_the_last_committed_step(tmp_path):
    root = str(tmp_path)
    results = run_ranks(workers.save_then_die, 2, root, allow_failures=True, timeout_s=90)
    assert getattr(results[1], "exitcode", None) == -9
    assert "step_2" not in os.listdir(tmp_path) and "step_1" in os.listdir(tmp_path)
    for steps, whole, step, again in run_ranks(workers.resume, 2, root):
        assert steps == ["step_1"] and step == 1 and torch.equal(whole, workers.full(1))
        assert torch.equal(again, workers.full(2))


def test_a_flipped_bit_fails_the_load_naming_file_and_bytes(tmp_path):
    path = tmp_path / "step_1"
    run_ranks(workers.save, 1, str(path), 1)
    victim = path / "model_0.pt"
    raw = bytearray(victim.read_bytes())
    at = len(raw) // 2
    raw[at] ^= 0x10
    victim.write_bytes(bytes(raw))
    with pytest.raises(Exception) as info:
        run_ranks(workers.load, 1, str(path))
    text = str(info.value)
    assert "CorruptCheckpointError" in text and "model_0.pt" in text and "fail their CRC-32C" in text
    assert "BufferError" not in text  # torch_checkpointing's mmap closes cleanly around the error
    s = DistckptStorage()
    with pytest.raises(CorruptCheckpointError, match=r"bytes 0-\d+ fail"):
        with s.stream_read(victim) as r:
            r.read()


def test_unverified_files_are_refused_unless_asked(tmp_path):
    (tmp_path / "plain.pt").write_bytes(b"written by another backend")
    with pytest.raises(CorruptCheckpointError, match="no checksums"):
        DistckptStorage().read(tmp_path / "plain.pt")
    assert DistckptStorage(DistckptStorageConfig(verify=False)).read(tmp_path / "plain.pt") == b"written by another backend"
