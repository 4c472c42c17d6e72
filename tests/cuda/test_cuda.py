"""Saves from and loads into CUDA memory; async staging through pinned buffers.

Skipped where no CUDA device is present (CI); run on a GPU machine with
``pytest tests/cuda``.
"""

import pytest
import torch

import distckpt
from distckpt import staging
from distckpt.testing import run_ranks

from . import workers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.float8_e4m3fn]


def _state(device) -> dict:
    g = torch.Generator().manual_seed(0)
    sd = {}
    for dt in DTYPES:
        t = torch.randn(257, 33, generator=g)
        sd[f"t_{str(dt)[6:]}"] = (t > 0 if dt == torch.bool else t.to(dt)).to(device)
    sd["transposed"] = torch.randn(40, 24, generator=g).to(device).t()  # not contiguous
    sd["scalar"] = torch.tensor(3.5, device=device)
    sd["empty"] = torch.empty(0, 5, device=device)
    sd["step"] = 11
    return sd


def _blank(sd: dict, device) -> dict:
    return {k: torch.zeros_like(v, device=device) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)))


@pytest.mark.parametrize("save_on,load_on", [("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")])
def test_bit_exact_between_devices(tmp_path, save_on, load_on):
    sd = _state(save_on)
    distckpt.save(sd, checkpoint_id=tmp_path / "c")
    out = _blank(sd, load_on)
    distckpt.load(out, checkpoint_id=tmp_path / "c")
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert out[k].device.type == load_on, k
            assert _same(out[k], v), k
    assert out["step"] == 11
    assert distckpt.verify(tmp_path / "c").ok


def test_load_into_a_cuda_module_and_optimizer(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(16, 32, device="cuda")).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    distckpt.save({"model": model, "optim": opt}, checkpoint_id=tmp_path / "c")

    model2 = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    distckpt.init_optimizer_state(opt2)
    distckpt.load({"model": model2, "optim": opt2}, checkpoint_id=tmp_path / "c")
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert b.is_cuda and torch.equal(a, b), k
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    for pid in s1:
        for name in ("exp_avg", "exp_avg_sq"):
            assert s2[pid][name].is_cuda and torch.equal(s1[pid][name], s2[pid][name])


def _slow_work() -> None:
    a = torch.randn(2048, 2048, device="cuda")
    for _ in range(30):
        a = a @ a
        a = a / a.norm()


def test_save_and_load_under_a_side_stream_follow_its_order(tmp_path):
    # the I/O threads copy on the caller's stream: work queued there before the call comes first
    n = 1 << 24
    x = torch.zeros(n, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        _slow_work()
        x.fill_(3.0)  # still queued on `side` when save is called
        distckpt.save({"x": x}, checkpoint_id=tmp_path / "c")
        y = torch.zeros(n, device="cuda")
        _slow_work()
        y.fill_(-1.0)  # queued before the load: the load's copies must land after it
        distckpt.load({"x": y}, checkpoint_id=tmp_path / "c")
        got = y.clone()
    torch.cuda.synchronize()
    out = {"x": torch.empty(n)}
    distckpt.load(out, checkpoint_id=tmp_path / "c")
    assert torch.equal(out["x"], torch.full((n,), 3.0))
    assert torch.equal(got.cpu(), torch.full((n,), 3.0))


def test_async_save_stages_in_stream_order_into_pinned_buffers(tmp_path):
    n = 1 << 24  # 64 MiB of float32: the queued kernels below take a while
    x = torch.zeros(n, device="cuda")
    a = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    for _ in range(20):  # queue work ahead of the final write to x
        a = a @ a
        a = a / a.norm()
    x.fill_(2.0)  # still queued when async_save is called
    handle = distckpt.async_save({"x": x}, checkpoint_id=tmp_path / "c")
    assert handle.staged.done()
    x.fill_(-1.0)  # after staging: must not reach the checkpoint
    handle.result(timeout=120)
    out = {"x": torch.empty(n)}
    distckpt.load(out, checkpoint_id=tmp_path / "c")
    assert torch.equal(out["x"], torch.full((n,), 2.0))
    pools = staging._STATE.free_pools
    assert pools and all(buf.is_pinned() for pool in pools for buf, _, _ in pool.buffers.values())


def test_a_writer_process_saves_cuda_state_staged_into_pinned_shared_memory(tmp_path):
    sd = _state("cuda")
    handle = distckpt.async_save(sd, checkpoint_id=tmp_path / "c", async_checkpointer_type="process")
    for v in sd.values():
        if isinstance(v, torch.Tensor) and v.numel():
            v.zero_()  # after staging: must not reach the checkpoint
    handle.result(timeout=120)
    out = _blank(sd, "cuda")
    distckpt.load(out, checkpoint_id=tmp_path / "c")
    for k, v in _state("cuda").items():
        if isinstance(v, torch.Tensor):
            assert _same(out[k], v), k
    shared = [pool for pool in staging._STATE.free_pools if pool.shared]
    assert shared and all(buf.is_pinned() and buf.is_shared() for pool in shared for buf, _, _ in pool.buffers.values())


def test_staging_pins_one_arena_without_rounding_up(tmp_path):
    # odd sizes: torch's caching pinned allocator would round each up to a power of two
    sd = {f"t{i}": torch.randn(1000 + 37 * i, 129, device="cuda") for i in range(20)}
    want = sum(t.numel() * t.element_size() for t in sd.values())
    distckpt.async_save(sd, checkpoint_id=tmp_path / "c").result(timeout=60)
    pool = staging._STATE.free_pools[-1]
    arenas = {id(a): a for key, (_, a, _) in pool.buffers.items() if key[0][0] in sd}
    assert len(arenas) == 1
    arena = next(iter(arenas.values()))
    assert arena.registered and want <= arena.base.numel() <= want + 64 * len(sd)
    out = {k: torch.empty_like(v) for k, v in sd.items()}
    distckpt.load(out, checkpoint_id=tmp_path / "c")
    assert all(torch.equal(out[k], v) for k, v in sd.items())


def test_a_refused_pin_leaves_no_cuda_error_for_the_training_code():
    from distckpt.engine.device_copy import pin_in_place, unpin_in_place

    buf = torch.empty(1 << 20, dtype=torch.uint8)
    assert pin_in_place(buf)
    try:
        assert not pin_in_place(buf)  # registered already: the driver refuses
        assert torch.ones(4, device="cuda").sum().item() == 4  # the next launch finds no stale error
        # why it matters: through torch's binding alone the refusal stays behind for the next launch
        assert int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 1)) != 0
        with pytest.raises(RuntimeError):
            torch.ones(1, device="cuda")
    finally:
        unpin_in_place(buf)


def test_async_save_stages_into_pageable_memory_when_pinning_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(staging, "pin_in_place", lambda buf: False)
    x = torch.randn(1000, 33, device="cuda")
    want = x.cpu()
    with pytest.warns(RuntimeWarning, match="could not page-lock"):
        handle = distckpt.async_save({"pageable_x": x}, checkpoint_id=tmp_path / "c")
    x.fill_(0.0)
    handle.result(timeout=60)
    out = {"pageable_x": torch.empty(1000, 33)}
    distckpt.load(out, checkpoint_id=tmp_path / "c")
    assert torch.equal(out["pageable_x"], want)


def test_async_save_reuses_its_pinned_buffers(tmp_path):
    w = torch.zeros(1000, 10, device="cuda")
    for i in range(3):
        w.fill_(float(i))
        distckpt.async_save({"w": w}, checkpoint_id=tmp_path / f"s{i}").result(timeout=60)
        pointers = {b.data_ptr() for pool in staging._STATE.free_pools for key, (b, _, _) in pool.buffers.items()
                    if key[0] == ("w",)}
        if i == 0:
            first = pointers
        else:
            assert pointers == first
    for i in range(3):
        out = {"w": torch.empty(1000, 10, device="cuda")}
        distckpt.load(out, checkpoint_id=tmp_path / f"s{i}")
        assert torch.equal(out["w"], torch.full((1000, 10), float(i), device="cuda"))


@pytest.mark.parametrize("use_async", [False, True])
def test_cuda_dtensors_saved_at_two_ranks_load_resharded(tmp_path, use_async):
    path = str(tmp_path / "c")
    run_ranks(workers.save_sharded, 2, path, use_async, timeout_s=180)
    for world in (1, 2, 3):
        results = run_ranks(workers.load_resharded, world, path, timeout_s=180)
        for r in results:
            assert r == {"device": "cuda", "equal": True, "b": True, "step": 7}, (world, results)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
@pytest.mark.parametrize("use_async", [False, True])
def test_nccl_group_saves_and_loads_resharded(tmp_path, use_async):
    # the coordinator's collectives then run on CUDA byte tensors; async_save adds a gloo group of its own
    path = str(tmp_path / "c")
    run_ranks(workers.save_sharded, 2, path, use_async, timeout_s=180, backend="nccl")
    for r in run_ranks(workers.load_resharded, 2, path, timeout_s=180, backend="nccl"):
        assert r == {"device": "cuda", "equal": True, "b": True, "step": 7}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_nccl_shared_reads_read_each_byte_once_and_deliver_on_the_device(tmp_path):
    path = str(tmp_path / "c")
    run_ranks(workers.save_replicated, 2, path, timeout_s=180, backend="nccl")
    results = run_ranks(workers.load_replicated_shared, 2, path, timeout_s=180, backend="nccl")
    assert all(r["equal"] and r["device"] == "cuda" for r in results), results
    # every tensor byte read once in the group (what the files hold beyond it is headers, a few kB)
    total = sum(r["read"] for r in results)
    assert results[0]["bytes"] <= total <= 1.02 * results[0]["bytes"], results
