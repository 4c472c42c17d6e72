"""CheckpointManager.prefetch: a restore's bytes read ahead in the background; the load copies them from memory and
reads only the rest, checked like any other read; a step replaced since is read from storage again."""

from __future__ import annotations

import os

import pytest
import torch

import distckpt
from distckpt import CheckpointManager
from distckpt.errors import CheckpointError, CorruptCheckpointError
from distckpt.testing.read_counts import FileReads


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 1024, generator=g), "b": torch.randn(4096, generator=g).to(torch.bfloat16),
            "step": 7, "ids": torch.arange(1000)}


def _empty() -> dict:
    return {"w": torch.zeros(256, 1024), "b": torch.zeros(4096, dtype=torch.bfloat16), "step": 0,
            "ids": torch.zeros(1000, dtype=torch.int64)}


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def _data_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.startswith("data-"))


def test_a_load_after_a_prefetch_reads_nothing_from_storage_and_is_exact(tmp_path):
    mgr = CheckpointManager(str(tmp_path), no_dist=True)
    mgr.save(3, _state())
    ahead = mgr.prefetch()
    held = ahead.wait(60)
    assert ahead.done and ahead.error is None and held >= _data_bytes(mgr.path(3)) > 1 << 20
    reads = FileReads()
    sd = _empty()
    assert mgr.load(sd) == 3
    # only the metadata document is read: every data byte, headers included, comes from memory
    assert _equal(sd, _state()) and reads.total == os.path.getsize(os.path.join(mgr.path(3), "metadata.json")), reads.total
    ahead.release()  # the load gave it back from a thread; this waits for it
    assert ahead.nbytes == 0


def test_a_prefetch_within_its_budget_leaves_the_rest_to_the_load(tmp_path):
    mgr = CheckpointManager(str(tmp_path), no_dist=True)
    mgr.save(1, _state())
    data = _data_bytes(mgr.path(1))
    ahead = mgr.prefetch(max_bytes=data // 2)
    assert ahead.wait(60) == data // 2
    reads = FileReads()
    sd = _empty()
    mgr.load(sd)
    assert _equal(sd, _state()) and 0 < reads.total <= data, (reads.total, data)


def test_a_prefetch_given_the_state_dict_reads_only_what_it_loads(tmp_path):
    mgr = CheckpointManager(str(tmp_path), no_dist=True)
    mgr.save(1, _state())
    part = {"b": torch.zeros(4096, dtype=torch.bfloat16)}
    ahead = mgr.prefetch(state_dict=part)
    assert ahead.wait(60) == 4096 * 2  # b's bytes alone
    reads = FileReads()
    mgr.load(part)
    # the metadata and the data file's header (checked before any chunk is read) come from storage, b from memory
    assert torch.equal(part["b"], _state()["b"]) and reads.total < 4096 * 2, reads.total


def test_a_step_replaced_after_its_prefetch_is_read_from_storage(tmp_path):
    """The prefetch holds the bytes of a save that is no longer the step: the load reads the new one."""
    path = str(tmp_path / "ck")
    distckpt.save(_state(0), checkpoint_id=path)
    ahead = distckpt.prefetching.Prefetch(path, distckpt.FileSystemReader(), rank=0, world_size=1)
    ahead.wait(60)
    distckpt.save(_state(1), storage_writer=distckpt.FileSystemWriter(path, overwrite=True))
    reader = distckpt.FileSystemReader(path)
    ahead.attach(reader)
    sd = _empty()
    distckpt.load(sd, storage_reader=reader, no_dist=True)
    assert _equal(sd, _state(1))


def test_prefetched_bytes_are_checked_like_any_read(tmp_path):
    """The prefetch checks each chunk it holds whole as it reads it (the load then copies it unchecked); a chunk
    damaged on storage fails that check, and the load, reading it from memory, fails naming it."""
    mgr = CheckpointManager(str(tmp_path), no_dist=True)
    mgr.save(2, _state())
    md = distckpt.read_metadata(mgr.path(2))
    index = next(i for i in md.storage_data.items if i.fqn == "w")
    info = md.storage_data.items[index]
    with open(os.path.join(mgr.path(2), info.file), "r+b") as f:  # a bit flipped in w's bytes on storage
        f.seek(info.offset + info.length // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    ahead = mgr.prefetch()
    ahead.wait(60)
    checked = set().union(*(r.checked for r in ahead.cache.files.values()))
    assert index not in checked and {i.fqn for i in checked} >= {"b", "ids"}, checked
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as err:
        mgr.load(_empty())
    assert "'w'" in str(err.value)


def test_a_cancelled_prefetch_and_one_of_another_step_leave_the_load_to_storage(tmp_path):
    mgr = CheckpointManager(str(tmp_path), no_dist=True)
    mgr.save(1, _state(0))
    mgr.save(2, _state(1))
    ahead = mgr.prefetch(1)
    ahead.cancel()
    sd = _empty()
    assert mgr.load(sd) == 2 and _equal(sd, _state(1))  # the prefetch was of step 1: released, not used
    ahead.release()
    assert ahead.nbytes == 0
    with pytest.raises(CheckpointError, match="max_bytes"):
        mgr.prefetch(max_bytes=-1)


@pytest.mark.parametrize("how", ["in place", "renamed over"])
def test_a_file_changed_between_two_stretches_of_a_prefetch_loses_what_was_checked_with_it(tmp_path, monkeypatch, how):
    """Found by a hostile review: a prefetch reads a and c (b between them) of one file in two stretches; another
    writer changes a's bytes between the two. The first stretch and its checked chunks go with the old version:
    the load checks a, and fails naming it, as a load without the prefetch does."""
    mgr = CheckpointManager(str(tmp_path), no_dist=True)
    g = torch.Generator().manual_seed(0)
    full = {k: torch.randn(65536, generator=g) for k in "abc"}
    mgr.save(1, full)
    md = distckpt.read_metadata(mgr.path(1))
    info = next(v for i, v in md.storage_data.items.items() if i.fqn == "a")
    path = os.path.join(mgr.path(1), info.file)
    checked = distckpt.prefetching.Prefetch._checked
    stretches = []

    def checked_then_another_writer(self, chunks, start, data):
        out = checked(self, chunks, start, data)
        stretches.append(start)
        if len(stretches) == 1:
            bad = torch.full((16,), 1234.5).numpy().tobytes()
            if how == "in place":
                with open(path, "r+b") as f:
                    f.seek(info.offset)
                    f.write(bad)
            else:
                raw = bytearray(open(path, "rb").read())
                raw[info.offset:info.offset + len(bad)] = bad
                with open(path + ".new", "wb") as f:
                    f.write(raw)
                os.rename(path + ".new", path)
        return out

    monkeypatch.setattr(distckpt.prefetching.Prefetch, "_checked", checked_then_another_writer)
    want = {"a": torch.zeros(65536), "c": torch.zeros(65536)}
    mgr.prefetch(1, state_dict=want).wait(30)
    assert len(stretches) == 2, stretches
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as err:
        mgr.load(want, 1)
    assert "'a'" in str(err.value)


def test_a_prefetch_holds_no_more_than_its_budget_of_files_shorter_than_their_table(tmp_path, monkeypatch):
    """Found by a hostile review: buffers were sized by the table's lengths and only the bytes read were counted."""
    mgr = CheckpointManager(str(tmp_path), no_dist=True)
    mgr.save(1, _state())
    md = distckpt.read_metadata(mgr.path(1))
    sizes = {name: info.size for name, info in md.storage_data.files.items()}
    allocated = []
    host_buffer = distckpt.prefetching.host_buffer
    monkeypatch.setattr(distckpt.prefetching, "host_buffer", lambda n, pinned: allocated.append(n) or host_buffer(n, pinned))
    monkeypatch.setattr(distckpt.prefetching.Prefetch, "_wanted",
                        lambda self, md: [(name, 0, 4 * size) for name, size in sizes.items()])  # a table that lies
    ahead = mgr.prefetch(1, max_bytes=1 << 30)
    ahead.wait(30)
    assert sum(allocated) <= sum(sizes.values()), (allocated, sizes)


def test_a_prefetch_of_a_step_that_goes_gives_its_memory_back_and_stateful_objects_are_left_out(tmp_path):
    mgr = CheckpointManager(str(tmp_path), no_dist=True, keep_last=1)
    mgr.save(1, _state())
    ahead = mgr.prefetch(1)
    ahead.wait(30)
    mgr.save(2, _state(1))  # retention deletes step 1
    ahead.release()
    assert ahead.nbytes == 0 and mgr.all_steps() == [2]
    with pytest.raises(distckpt.errors.CheckpointNotFoundError):
        mgr.load(_empty(), 1)

    class App:  # a Stateful: its state_dict() may run collectives, which a prefetch must not
        def state_dict(self):
            raise AssertionError("a prefetch called state_dict()")

        def load_state_dict(self, sd):
            pass

    part = {"app": App(), "b": torch.zeros(4096, dtype=torch.bfloat16)}
    ahead = mgr.prefetch(state_dict=part)
    assert ahead.wait(30) == 4096 * 2 and ahead.error is None, ahead.error
    with pytest.raises(CheckpointError, match="a dict"):
        mgr.prefetch(state_dict=[1, 2])
