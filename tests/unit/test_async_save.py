"""async_save: the bytes on disk are the state at staging time; errors surface on the handle."""

import os
import sys
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import distckpt
from distckpt import faults
from tests.forking import run_in_fork


def test_mutation_after_staging_does_not_reach_the_disk(tmp_path):
    model = torch.nn.Linear(64, 64)
    state = {"model": model, "step": 1, "buf": [torch.arange(10.0)]}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    handle = distckpt.async_save(state, checkpoint_id=tmp_path / "a")
    assert handle.staged.done()
    with torch.no_grad():
        model.weight.add_(1.0)
        state["buf"][0].mul_(0)
    state["step"] = 2
    md = handle.result(timeout=60)
    assert "model.weight" in md.state_dict_metadata
    out = torch.nn.Linear(64, 64)
    loaded = {"model": out, "step": 0, "buf": [torch.zeros(10)]}
    distckpt.load(loaded, checkpoint_id=tmp_path / "a")
    assert all(torch.equal(out.state_dict()[k], v) for k, v in before.items())
    assert loaded["step"] == 1 and torch.equal(loaded["buf"][0], torch.arange(10.0))


def test_background_error_surfaces_on_the_handle(tmp_path):
    with faults.inject(faults.Fault("enospc", kinds=("write",))):
        handle = distckpt.async_save({"w": torch.ones(100)}, checkpoint_id=tmp_path / "a")
        with pytest.raises(distckpt.CheckpointError, match="No space left"):
            handle.result(timeout=60)
    assert not (tmp_path / "a").exists()


def test_two_async_saves_in_a_row_and_buffer_reuse(tmp_path):
    w = torch.zeros(256)
    handles = []
    for i in range(3):
        w.fill_(float(i))
        handles.append(distckpt.async_save({"w": w}, checkpoint_id=tmp_path / f"s{i}"))
    for i, h in enumerate(handles):
        h.result(timeout=60)
        out = {"w": torch.empty(256)}
        distckpt.load(out, checkpoint_id=tmp_path / f"s{i}")
        assert torch.equal(out["w"], torch.full((256,), float(i)))


def test_second_save_can_refuse_instead_of_waiting(tmp_path):
    release = []

    def slow(kind, what):
        import time

        while not release:
            time.sleep(0.01)

    with faults.inject(faults.Fault("call", kinds=("write",), callback=slow)):
        first = distckpt.async_save({"w": torch.ones(4)}, checkpoint_id=tmp_path / "a")
        with pytest.raises(distckpt.CheckpointError, match="still in flight"):
            distckpt.async_save({"w": torch.ones(4)}, checkpoint_id=tmp_path / "b", wait_for_previous=False)
        release.append(True)
        first.result(timeout=60)


def test_manager_async_save_applies_retention_after_commit(tmp_path):
    mgr = distckpt.CheckpointManager(tmp_path, keep_last=2)
    for step in range(1, 5):
        mgr.async_save(step, {"w": torch.full((8,), float(step))}).result(timeout=60)
    assert mgr.all_steps() == [3, 4]


def test_staging_pool_allocates_together_reuses_two_layouts_and_drops_older_ones():
    from distckpt.staging import BufferPool, stage

    pool = BufferPool()
    a = {"w": torch.arange(10.0), "opt": [torch.ones(3, 5, dtype=torch.bfloat16), torch.tensor(True)], "step": 4}
    b = {"other": torch.arange(6, dtype=torch.int64).reshape(2, 3)}
    staged = stage(a, pool)
    assert torch.equal(staged["w"], a["w"]) and torch.equal(staged["opt"][0], a["opt"][0]) and staged["opt"][1].item()
    assert staged["step"] == 4 and staged["w"].data_ptr() != a["w"].data_ptr()
    assert len({id(arena) for _, arena, _ in pool.buffers.values()}) == 1  # one allocation for the whole state
    first = {k: buf.data_ptr() for k, (buf, _, _) in pool.buffers.items()}
    stage(b, pool)
    again = stage(a, pool)  # alternating between two layouts: no new allocation
    assert {k: buf.data_ptr() for k, (buf, _, _) in pool.buffers.items() if k in first} == first
    assert again["w"].data_ptr() == staged["w"].data_ptr()
    c = {"w": torch.arange(12.0)}  # a changed shape is a new buffer; keys unused twice in a row go
    stage(c, pool)
    stage(c, pool)
    assert [k[0] for k in pool.buffers] == [("w",)] and torch.equal(stage(c, pool)["w"], torch.arange(12.0))


def test_staging_stays_pageable_with_a_warning_when_pinning_is_refused(monkeypatch):
    from distckpt import staging

    def refuse(buf):
        return False

    def must_not_unpin(buf):
        raise AssertionError("unpinned memory that was never pinned")

    monkeypatch.setattr(staging, "pin_in_place", refuse)
    monkeypatch.setattr(staging, "unpin_in_place", must_not_unpin)
    with pytest.warns(RuntimeWarning, match="could not page-lock 4096 bytes"):
        arena = staging._Arena(4096, pinned=True)
    assert not arena.registered
    view = arena.view(64, torch.empty(4, 8))
    view.copy_(torch.arange(32.0).reshape(4, 8))
    assert torch.equal(arena.view(64, torch.empty(4, 8)), torch.arange(32.0).reshape(4, 8))
    arena.release()


_SHAPES = [(), (0,), (3,), (2, 5), (7, 1, 3)]
_DTYPES = [torch.float32, torch.bfloat16, torch.bool, torch.int64, torch.uint8]


@settings(deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from(["a", "b", "c", "d"]),
                                st.tuples(st.sampled_from(_SHAPES), st.sampled_from(_DTYPES)), min_size=1),
                min_size=1, max_size=8))
def test_staging_pool_stages_exact_copies_in_disjoint_buffers_and_keeps_two_layouts(layouts):
    from distckpt.staging import BufferPool, stage

    pool = BufferPool()
    seen: list[set] = []
    for n, layout in enumerate(layouts):
        state = {k: (torch.arange(torch.Size(shape).numel()) % 7 + n).to(dtype).reshape(shape)
                 for k, (shape, dtype) in layout.items()}
        staged = stage(state, pool)
        spans = []
        for k, t in state.items():
            s = staged[k]
            assert s.dtype == t.dtype and s.shape == t.shape and torch.equal(s, t)
            if s.numel():
                assert s.data_ptr() != t.data_ptr()
                spans.append((s.data_ptr(), s.data_ptr() + s.numel() * s.element_size()))
        spans.sort()
        assert all(e0 <= b1 for (_, e0), (b1, _) in zip(spans, spans[1:]))  # no two buffers share bytes
        keys = {(("%s" % k,), tuple(shape), dtype) for k, (shape, dtype) in layout.items()}
        seen.append(keys)
        assert set(pool.buffers) == set().union(*seen[-2:])  # exactly the last two stagings' buffers


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux")
def test_the_background_write_runs_at_a_lower_cpu_priority_than_the_caller(tmp_path):
    seen = []
    tid = threading.get_native_id()
    mine = os.getpriority(os.PRIO_PROCESS, tid)
    h = distckpt.async_save({"w": torch.ones(8)}, checkpoint_id=tmp_path / "a",
                            on_commit=lambda md: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    h.result(timeout=60)
    assert os.getpriority(os.PRIO_PROCESS, tid) == mine  # the caller's threads keep theirs
    assert seen == [min(19, mine + distckpt.knobs.async_write_nice())]


def _async_save_in_child(path: str) -> bool:
    state = {"w": torch.arange(1000.0)}
    distckpt.async_save(state, checkpoint_id=path).result(timeout=60)
    dest = {"w": torch.zeros(1000)}
    distckpt.load(dest, checkpoint_id=path)
    return torch.equal(dest["w"], state["w"])


@pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="no fork here")
def test_a_process_forked_after_async_saves_can_save_asynchronously(tmp_path):
    """A child forked after the parent's async saves (a data loader's worker) has no background thread of the
    parent's: its own async_save must not wait on one, nor share a buffer with one."""
    distckpt.save({"w": torch.ones(10)}, checkpoint_id=str(tmp_path / "before"))  # leaves spare buffers to share
    distckpt.async_save({"w": torch.ones(10)}, checkpoint_id=str(tmp_path / "parent"))  # still in flight, maybe
    assert run_in_fork(_async_save_in_child, str(tmp_path / "child"), timeout_s=90,
                       hang="async_save in a forked child hung on the parent's background threads") is True


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc")
def test_release_buffers_gives_the_memory_back_and_saves_go_on(tmp_path):
    state = {"w": torch.randn(16 << 20)}  # 64 MiB: its staging arena is a mapping of its own
    distckpt.async_save(state, checkpoint_id=tmp_path / "a").result(timeout=60)
    before = _rss_bytes()
    assert distckpt.release_buffers() >= 64 << 20
    assert _rss_bytes() <= before - (48 << 20), "the staging copy went back to the system"
    assert distckpt.release_buffers() == 0  # nothing kept any more
    state["w"].add_(1.0)
    distckpt.async_save(state, checkpoint_id=tmp_path / "b").result(timeout=60)  # allocates its buffers again
    out = {"w": torch.zeros(16 << 20)}
    distckpt.load(out, checkpoint_id=tmp_path / "b")
    assert torch.equal(out["w"], state["w"])


def test_release_buffers_waits_for_the_save_in_flight(tmp_path, monkeypatch):
    from distckpt import async_saving

    started, go = threading.Event(), threading.Event()
    real = async_saving.run_save

    def held_back(*args, **kwargs):
        started.set()
        go.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(async_saving, "run_save", held_back)
    handle = distckpt.async_save({"w": torch.ones(1 << 20)}, checkpoint_id=tmp_path / "a")
    assert started.wait(60) and not handle.done()
    threading.Timer(0.2, go.set).start()
    assert distckpt.release_buffers() >= 4 << 20  # returns only after the commit, with that save's buffers
    assert handle.done() and handle.result().state_dict_metadata["w"].size == torch.Size([1 << 20])
