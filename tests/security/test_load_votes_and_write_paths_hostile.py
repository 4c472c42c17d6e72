"""Hostile review of issue 45's surfaces: the load's votes, DTensor shards loaded as saved (column items), and the
per-device learned write path (DISTCKPT_DIRECT_IO=auto, TimedWriter, DirectWriter at queue depth > 1)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest
import torch

import distckpt
from distckpt import faults
from distckpt.testing import run_ranks

from . import load_votes_and_write_paths_workers as w

# ------------------------------------------------------------------ collectives of a load


def _typed_failure(r: dict) -> bool:
    return not r["ok"] and r["checkpoint_error"]


def test_load_out_of_step_with_a_save_fails_typed_on_every_rank_and_the_group_recovers(tmp_path):
    """A load's vote meets a save's first exchange: every phase begins with rows of one shape, so gloo does not
    end the process on a size mismatch, and every rank raises naming both operations."""
    results = run_ranks(w.load_out_of_step_with_save, 2, str(tmp_path / "ck"), collective_timeout_s=20, timeout_s=150)
    for rank, r in enumerate(results):
        assert _typed_failure(r["first"]), (rank, r)
        assert r["first"]["s"] < 30, (rank, r)
        assert "out of step" in r["first"]["msg"] and "save" in r["first"]["msg"] and "load" in r["first"]["msg"], (rank, r)
    for rank, r in enumerate(results):
        assert r["again"]["ok"], (rank, r)


@pytest.mark.parametrize("how, needle", [("missing", "only_on_rank1"), ("shape", "'b'")])
def test_one_rank_failing_to_plan_a_load_fails_it_on_every_rank(tmp_path, how, needle):
    results = run_ranks(w.load_with_one_rank_failing_to_plan, 2, str(tmp_path / "ck"), how, collective_timeout_s=20,
                        timeout_s=120)
    for rank, r in enumerate(results):
        assert _typed_failure(r["first"]), (rank, r)
        assert "rank 1" in r["first"]["msg"] and needle in r["first"]["msg"], (rank, r)
        assert r["first"]["s"] < 15, (rank, r)
        assert r["again"]["ok"] and r["right"], (rank, r)


def test_a_corrupt_shard_read_by_one_rank_fails_the_load_everywhere_and_is_zeroed(tmp_path):
    results = run_ranks(w.load_with_corrupt_chunk_one_rank_reads, 2, str(tmp_path / "ck"), collective_timeout_s=20,
                        timeout_s=120)
    for rank, r in enumerate(results):
        assert _typed_failure(r["first"]), (rank, r)
        assert r["file"] in r["first"]["msg"] and "rank 1" in r["first"]["msg"], (rank, r)
        assert r["again"]["ok"], (rank, r)
    assert results[1]["zeroed"], results[1]  # damaged bytes never stay in the caller's tensor
    assert results[0]["right"], results[0]


def test_a_data_file_removed_between_planning_and_reading_fails_typed_everywhere(tmp_path):
    results = run_ranks(w.load_with_file_removed_after_planning, 2, str(tmp_path / "ck"), collective_timeout_s=20,
                        timeout_s=120)
    for rank, r in enumerate(results):
        assert _typed_failure(r["first"]), (rank, r)
        assert "rank 1" in r["first"]["msg"] and "data-" in r["first"]["msg"], (rank, r)
        assert r["again"]["ok"], (rank, r)


def test_a_rank_stalling_in_a_load_fails_the_others_within_the_collective_timeout(tmp_path):
    results = run_ranks(w.load_with_a_rank_that_stalls, 2, str(tmp_path / "ck"), 14.0, collective_timeout_s=5,
                        timeout_s=90)
    assert _typed_failure(results[0]) and results[0]["s"] < 12, results[0]
    assert _typed_failure(results[1]), results[1]


def test_a_load_on_a_new_group_with_coordinator_one_names_the_failing_rank(tmp_path):
    results = run_ranks(w.load_on_subgroup_with_coordinator_one, 2, str(tmp_path / "ck"), collective_timeout_s=20,
                        timeout_s=120)
    for rank, r in enumerate(results):
        assert _typed_failure(r["first"]) and "rank 0" in r["first"]["msg"] and "nope" in r["first"]["msg"], (rank, r)
        assert r["again"]["ok"], (rank, r)
    assert results[0]["value"] == results[1]["value"], results  # one stored copy of "x", loaded alike on every rank


def test_ranks_that_disagree_about_partial_reads_load_the_right_bytes(tmp_path):
    results = run_ranks(w.load_where_ranks_disagree_on_partial_reads, 2, str(tmp_path / "ck"), collective_timeout_s=20,
                        timeout_s=120)
    for rank, r in enumerate(results):
        assert r["first"]["ok"] and r["right"], (rank, r)


def test_no_dist_load_in_a_live_group_fails_typed_at_once(tmp_path):
    r = run_ranks(w.load_no_dist_on_one_rank, 2, str(tmp_path / "ck"), collective_timeout_s=20, timeout_s=90)[0]
    assert _typed_failure(r["first"]) and "'y'" in r["first"]["msg"] and r["first"]["s"] < 5, r
    assert r["again"]["ok"] and r["value"] == [0.0, 1.0, 2.0, 3.0], r


# ------------------------------------------------------------------ DTensor shards loaded as saved


def test_dtensor_shards_loaded_as_saved_come_back_exactly(tmp_path):
    results = run_ranks(w.dtensor_round_trips, 2, str(tmp_path), collective_timeout_s=30, timeout_s=200)
    for rank, r in enumerate(results):
        wrong = {k: v for k, v in r.items() if not v["right"]}
        assert not wrong, (rank, wrong)


def test_a_corrupt_dtensor_shard_fails_naming_its_file_and_is_zeroed_with_or_without_conversion(tmp_path):
    results = run_ranks(w.dtensor_corrupt_chunk_with_conversion, 2, str(tmp_path / "ck"), collective_timeout_s=20,
                        timeout_s=120)
    for rank, r in enumerate(results):
        for label in ("same", "convert"):
            assert _typed_failure(r[label]["load"]) and r["file"] in r[label]["load"]["msg"], (rank, label, r)
    for label in ("same", "convert"):
        assert results[0][label]["zeroed"], (label, results[0])
        assert results[1][label]["untouched_or_right"], (label, results[1])


def test_a_sharded_tensor_shard_loaded_as_saved(tmp_path):
    """ShardedTensors (the older sharded type) through the same column path: bytes back exactly."""
    pytest.importorskip("torch.distributed._shard.sharded_tensor")
    results = run_ranks(_sharded_tensor_round_trip, 2, str(tmp_path / "ck"), collective_timeout_s=30, timeout_s=120)
    assert all(results), results


def _sharded_tensor_round_trip(rank, world_size, path):
    import warnings

    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard as STShard
    from torch.distributed._shard.sharded_tensor import init_from_local_shards

    warnings.simplefilter("ignore")

    def make(fill):
        local = (torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8) + 1000 * rank) if fill else torch.zeros(6, 8)
        md = ShardMetadata(shard_offsets=[6 * rank, 0], shard_sizes=[6, 8], placement=f"rank:{rank}/cpu")
        return init_from_local_shards([STShard(local, md)], [12, 8])

    distckpt.save({"s": make(True)}, checkpoint_id=path)
    dest = make(False)
    distckpt.load({"s": dest}, checkpoint_id=path)
    return bool(torch.equal(dest.local_shards()[0].tensor, make(True).local_shards()[0].tensor))


# ------------------------------------------------------------------ the learned write path


_BIG = 20 << 20  # over write_paths._MIN_BYTES: every save is measured


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(_BIG // 4, generator=g), "b": torch.randn(1000, 3, generator=g), "n": seed}


def _files(path) -> dict:
    """Each stored chunk's bytes, by key and offsets (file headers carry the save's id, which differs per save)."""
    md = distckpt.read_metadata(str(path))
    out = {}
    for index, info in md.storage_data.items.items():
        with open(os.path.join(path, info.file), "rb") as f:
            f.seek(info.offset)
            out[(index.fqn, tuple(index.offset or ()))] = f.read(info.length)
    return out


def _fail_at_write(n: int, err: int):
    """A fault that raises ``err`` at the ``n``-th write boundary (0-based) whatever other boundaries come between."""
    import errno as _errno  # noqa: F401
    import threading

    lock, seen = threading.Lock(), [0]

    def call(kind, what):
        if kind != "write":
            return
        with lock:
            i, seen[0] = seen[0], seen[0] + 1
        if i == n:
            raise OSError(err, f"injected at write {i} of {what}")

    return faults.Fault("call", callback=call)


@pytest.fixture
def on_disk(tmp_path, monkeypatch):
    """A directory on this machine's ext4 (tmp_path is there) with auto direct I/O and a fresh learner."""
    from distckpt.backends import write_paths

    monkeypatch.setenv("DISTCKPT_DIRECT_IO", "auto")
    monkeypatch.setenv("DISTCKPT_FSYNC", "1")  # saves without fsync are not measured: the learner would never learn
    monkeypatch.setattr(write_paths.PATHS, "rate", {})
    monkeypatch.setattr(write_paths.PATHS, "saves", {})
    from distckpt.backends.direct_io import direct_io_wanted

    if not direct_io_wanted(str(tmp_path)):
        pytest.skip("tmp_path is not on a local disk file system")
    return tmp_path


@pytest.mark.parametrize("depth", ["1", "4"])
def test_saves_that_alternate_ways_write_identical_bytes_sync_and_async(on_disk, monkeypatch, depth):
    monkeypatch.setenv("DISTCKPT_DIRECT_IO_QUEUE_DEPTH", depth)
    monkeypatch.setenv("DISTCKPT_DIRECT_IO_BUFFER_BYTES", str(1 << 20))
    from distckpt.backends import write_paths

    seen = []
    for i in range(4):
        path = on_disk / f"s{i}"
        if i % 2:
            distckpt.async_save(_state(1), checkpoint_id=str(path)).result()
        else:
            distckpt.save(_state(1), checkpoint_id=str(path))
        seen.append(_files(path))
        sd = {"a": torch.zeros(_BIG // 4), "b": torch.zeros(1000, 3), "n": 0}
        distckpt.load(sd, checkpoint_id=str(path))
        assert torch.equal(sd["a"], _state(1)["a"]) and torch.equal(sd["b"], _state(1)["b"]) and sd["n"] == 1
    assert all(s == seen[0] for s in seen[1:])
    assert len(write_paths.PATHS.rate) == 2, write_paths.PATHS.rate  # both ways were measured


@pytest.mark.parametrize("action", ["enospc", "eio"])
@pytest.mark.parametrize("depth", ["1", "4"])
def test_a_write_failing_part_way_in_either_way_commits_nothing(on_disk, monkeypatch, action, depth):
    from distckpt.backends import write_paths

    monkeypatch.setenv("DISTCKPT_DIRECT_IO_QUEUE_DEPTH", depth)
    monkeypatch.setenv("DISTCKPT_DIRECT_IO_BUFFER_BYTES", str(1 << 20))
    for i in range(2):  # the first save writes directly, the second through the page cache
        path = on_disk / f"f{i}"
        with faults.inject(_fail_at_write(3, {"enospc": errno.ENOSPC, "eio": errno.EIO}[action])):
            with pytest.raises(distckpt.CheckpointError):
                distckpt.save(_state(2), checkpoint_id=str(path))
        assert not os.path.exists(path / "metadata.json")
        with pytest.raises(distckpt.CheckpointError):
            distckpt.load({"a": torch.zeros(_BIG // 4)}, checkpoint_id=str(path))
        if i == 0:  # a save that goes through: the learner has a direct rate, so the next save is buffered
            distckpt.save(_state(2), checkpoint_id=str(on_disk / "between"))
    assert write_paths.PATHS.saves and list(write_paths.PATHS.rate) == [(next(iter(write_paths.PATHS.saves)), True)]
    distckpt.save(_state(3), checkpoint_id=str(on_disk / "ok"))  # and the next save works
    sd = {"a": torch.zeros(_BIG // 4), "b": torch.zeros(1000, 3), "n": 0}
    distckpt.load(sd, checkpoint_id=str(on_disk / "ok"))
    assert torch.equal(sd["a"], _state(3)["a"])


def test_a_real_full_file_system_fails_a_direct_save_and_commits_nothing(tmp_path):
    """A small ext4 image, loop-mounted: ENOSPC from the device itself part-way, with direct writes in flight."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount")
    img, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    try:
        subprocess.run(["truncate", "-s", "12M", str(img)], check=True)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True, capture_output=True)
        subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], check=True, capture_output=True)
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        pytest.skip(f"cannot mount a loop file system here: {exc}")
    try:
        code = (
            "import torch, distckpt, os, sys\n"
            "p = sys.argv[1]\n"
            "try:\n"
            "    distckpt.save({'a': torch.randn(5 << 20)}, checkpoint_id=p + '/ck')\n"
            "    print('SAVED')\n"
            "except distckpt.CheckpointError as e:\n"
            "    print('TYPED', type(e).__name__, str(e)[:300])\n"
            "distckpt.save({'a': torch.arange(10.0)}, checkpoint_id=p + '/small')\n"
            "sd = {'a': torch.zeros(10)}\n"
            "distckpt.load(sd, checkpoint_id=p + '/small')\n"
            "print('SMALL', sd['a'].sum().item())\n"
        )
        for depth in ("1", "4"):
            env = dict(os.environ, DISTCKPT_DIRECT_IO="auto", DISTCKPT_DIRECT_IO_QUEUE_DEPTH=depth,
                       DISTCKPT_DIRECT_IO_BUFFER_BYTES=str(1 << 20))
            out = subprocess.run([sys.executable, "-c", code, str(mnt)], env=env, capture_output=True, text=True,
                                 timeout=120)
            assert "TYPED" in out.stdout and "SMALL 45.0" in out.stdout, (depth, out.stdout, out.stderr[-2000:])
            assert not os.path.exists(mnt / "ck" / "metadata.json")
            for name in ("ck", "small"):
                subprocess.run(["rm", "-rf", str(mnt / name)], check=True)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_the_learner_after_fork_is_fresh_even_with_its_lock_held(on_disk):
    """A fork while another thread holds the learner's lock: the child's first save must not hang."""
    import threading

    from distckpt.backends import write_paths

    held, release = threading.Event(), threading.Event()

    def hold():
        with write_paths.PATHS.lock:
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(5)
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            import signal

            signal.alarm(20)
            distckpt.save({"x": torch.arange(10.0)}, checkpoint_id=str(on_disk / "child"))
            code = 0 if not write_paths.PATHS.rate and write_paths.PATHS.saves else 2
        finally:
            os._exit(code)
    release.set()
    t.join()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("depth", ["1", "4"])
def test_data_file_names_planted_as_symlinks_are_never_written_through(on_disk, monkeypatch, depth):
    """Links named as the save's data files, in the checkpoint directory before the save, pointing at a victim:
    whichever way the learner picks, the victim keeps its bytes."""
    monkeypatch.setenv("DISTCKPT_DIRECT_IO_QUEUE_DEPTH", depth)
    victim = on_disk / "victim"
    victim.write_bytes(b"precious" * 1000)
    for i in range(2):  # direct, then buffered
        ck = on_disk / f"ck{i}"
        ck.mkdir()
        for n in range(4):
            os.symlink(victim, ck / f"data-{n:05d}.safetensors")
            os.symlink(victim, ck / f".data-{n:05d}.safetensors.tmp")
        try:
            distckpt.save(_state(4), checkpoint_id=str(ck))
        except distckpt.CheckpointError:
            pass
        assert victim.read_bytes() == b"precious" * 1000
