"""Ranks of tests/security/test_shared_reads_hostile.py: loads over a process group with shared reads, attacked."""

from __future__ import annotations

import os
import time

import torch

import distckpt


def _state(scale: int = 1) -> dict:
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(64 * scale, 33, generator=g), "b": torch.randn(40, 7, generator=g).to(torch.bfloat16),
            "ids": torch.randint(0, 1000, (300,), generator=g), "s": torch.tensor(2.5), "e": torch.zeros(0, 3),
            "step": 7, "cfg": {"lr": 0.5}}


def _blank(sd: dict) -> dict:
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    out["step"], out["cfg"] = 0, {"lr": 0.0}
    return out


def _result(fn) -> dict:
    started = time.monotonic()
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - the test looks at what each rank raised
        return {"error": type(exc).__name__, "text": str(exc)[:3000], "s": time.monotonic() - started}
    return {"error": None, "s": time.monotonic() - started, **(out or {})}


def save_plain(rank, world_size, path, scale=1):
    distckpt.save(_state(scale), checkpoint_id=path, no_dist=world_size == 1)
    return True


def torch_save_tied(rank, world_size, path):
    """A torch.save file whose two keys view one storage (tied weights), as GPT-2's wte and lm_head."""
    if rank == 0:
        g = torch.Generator().manual_seed(5)
        w = torch.randn(50, 16, generator=g)
        torch.save({"wte.weight": w, "lm_head.weight": w, "head": w[:20], "other": torch.randn(9, generator=g)}, path)
    return True


def load_torch_save_tied(rank, world_size, path, shared=None, keys_by_rank=None):
    """Load the tied file (``keys_by_rank``: the keys each rank's state dict holds; default all)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(50, 16, generator=g)
    want = {"wte.weight": w, "lm_head.weight": w, "head": w[:20], "other": torch.randn(9, generator=g)}
    if keys_by_rank is not None:
        want = {k: v for k, v in want.items() if k in keys_by_rank[rank]}
    sd = {k: torch.zeros_like(v) for k, v in want.items()}

    def run():
        reader = distckpt.TorchSaveReader(path, shared_reads=shared)
        distckpt.load(sd, storage_reader=reader)
        return {"bad": sorted(k for k, v in want.items() if not torch.equal(sd[k], v)),
                "messages": len(reader.shares.messages) if reader.shares else 0}
    return _result(run)


def _roles(reader) -> dict:
    """key -> 'send' or 'receive' for the chunks this rank took part in sharing."""
    if reader.shares is None:
        return {}
    md = reader.metadata
    out = {}
    for index, info in md.storage_data.items.items():
        role = reader.shares.roles.get((info.file, info.offset))
        if role is not None and info.length:
            out[index.fqn] = "send" if role == 1 else "receive"
    return out


def save_one(rank, world_size, path, n=64):
    """One tensor of n rows: one chunk, read by rank 0 in a load at any world size (the readers are balanced from
    rank 0)."""
    if rank == 0:
        distckpt.save({"a": torch.arange(n * 33, dtype=torch.float32).reshape(n, 33)}, checkpoint_id=path, no_dist=True)
    return True


def load_one(rank, world_size, path, verify_by_rank=None, env_by_rank=None, bucket=None):
    """Load the one-tensor state; ``verify_by_rank``: each rank's verify_checksums."""
    for k, v in ((env_by_rank or {}).get(rank) or {}).items():
        os.environ[k] = v
    want = torch.arange(64 * 33, dtype=torch.float32).reshape(64, 33)
    sd = {"a": torch.zeros(64, 33)}

    def run():
        verify = True if verify_by_rank is None else verify_by_rank[rank]
        reader = distckpt.FileSystemReader(path, verify_checksums=verify)
        distckpt.load(sd, storage_reader=reader)
        return {"exact": torch.equal(sd["a"], want), "roles": _roles(reader)}
    out = _result(run)
    out["zero"] = bool(torch.count_nonzero(sd["a"]) == 0)
    out["mixed"] = not out["zero"] and not torch.equal(sd["a"], want)
    return out


def load_plain(rank, world_size, path, mode=None, opts=None):
    """Load _state() with an attack ``mode`` on some rank (see the branches)."""
    opts = opts or {}
    for k, v in (opts.get("env", {}).get(rank) or {}).items():
        os.environ[k] = v
    want = _state(opts.get("scale", 1))
    sd = _blank(want)
    planner = None
    reader_kw = {}
    if mode == "shared_off_on" and rank == opts.get("rank", 1):
        reader_kw["shared_reads"] = False
    if mode == "finish_plan_raises" and rank == opts.get("rank", 1):
        from distckpt.planning import DefaultLoadPlanner

        class Raising(DefaultLoadPlanner):
            def finish_plan(self, plan):
                raise ValueError("finish_plan of this rank fails")
        planner = Raising()
    if mode == "finish_plan_drops" and rank == opts.get("rank", 1):
        from distckpt.planner import LoadPlan
        from distckpt.planning import DefaultLoadPlanner

        class Dropping(DefaultLoadPlanner):
            def finish_plan(self, plan):
                return LoadPlan([])
        planner = Dropping()
    if mode == "extra_key" and rank == opts.get("rank", 1):
        sd["nope"] = torch.zeros(3)
    if mode == "missing_key" and rank == opts.get("rank", 1):
        del sd["a"]
    if mode == "partial_one" and rank == opts.get("rank", 1):
        from distckpt.planning import DefaultLoadPlanner
        sd["nope"] = torch.zeros(3)
        planner = DefaultLoadPlanner(allow_partial_load=True)
    if mode == "expanded" and rank == opts.get("rank", 1):  # a destination no copy can write (one row, expanded)
        sd["a"] = torch.zeros(1, want["a"].shape[1]).expand(want["a"].shape)
    if mode == "requires_grad":  # parameters, and an inference tensor, as direct reads fill them
        sd["a"] = torch.nn.Parameter(sd["a"])
        with torch.inference_mode():
            sd["b"] = torch.zeros_like(want["b"])
    if mode == "meta_dest" and rank == opts.get("rank", 1):
        sd["a"] = torch.empty(want["a"].shape, device="meta")
    if mode == "convert":  # destinations of another dtype, non-contiguous
        sd["a"] = torch.zeros(33, 64 * opts.get("scale", 1), dtype=torch.float64).t()
        sd["b"] = torch.zeros(40, 7, dtype=torch.float32)
        from distckpt.planning import DefaultLoadPlanner
        planner = DefaultLoadPlanner(allow_dtype_conversion=True)
    if mode == "die_before" and rank == opts.get("rank", 1):
        from distckpt.engine import shared_reads

        def die(*a, **k):
            os._exit(17)
        shared_reads.exchange = die
        import distckpt.engine.read as read_mod
        read_mod.exchange = die

    def run():
        reader = distckpt.FileSystemReader(path, **reader_kw)
        result = distckpt.load(sd, storage_reader=reader, planner=planner)
        bad = []
        for k, v in want.items():
            got = sd.get(k)
            if isinstance(v, torch.Tensor):
                if got is None or got.device.type == "meta" or not torch.equal(got.to(v.dtype), v):
                    bad.append(k)
            elif got != v:
                bad.append(k)
        return {"bad": bad, "roles": _roles(reader), "result": list(result) if result else None}
    return _result(run)


_FIRST_RECEIVE: list = []


def _die_after_sends(n: int, how: str = "kill") -> None:
    """This rank dies (SIGKILL) right after its ``n``-th shared-read send; ``how='hang'``: it stops answering for
    twice DISTCKPT_TIMEOUT_S first. Every rank notes when it began to receive."""
    from distckpt.engine import shared_reads
    real, real_receive = shared_reads.Peers.send, shared_reads.Peers.receive
    sent = {"n": 0}

    def send_then_die(self, buf, receivers):
        if sent["n"] >= n:
            if how == "hang":
                time.sleep(float(os.environ["DISTCKPT_TIMEOUT_S"]) * 2)
            os.kill(os.getpid(), 9)
        real(self, buf, receivers)
        sent["n"] += 1

    def receive(self, buf, src, everyone):
        if not _FIRST_RECEIVE:
            _FIRST_RECEIVE.append(time.monotonic())
        real_receive(self, buf, src, everyone)
    shared_reads.Peers.send = send_then_die
    shared_reads.Peers.receive = receive


def load_one_dying(rank, world_size, path, n, sends=1, how="kill"):
    """As :func:`load_one` (rows ``n``), its sender dying after ``sends`` sends; the others report whether any
    unchecked byte stayed in their destination."""
    _die_after_sends(sends, how)
    want = torch.arange(n * 33, dtype=torch.float32).reshape(n, 33)
    sd = {"a": torch.zeros(n, 33)}
    out = _result(lambda: distckpt.load(sd, checkpoint_id=path) and None)
    out["since_first_receive"] = time.monotonic() - _FIRST_RECEIVE[0] if _FIRST_RECEIVE else None
    out["zero"] = bool(torch.count_nonzero(sd["a"]) == 0)
    out["exact"] = torch.equal(sd["a"], want)
    return out


def _full(kind: str) -> dict:
    g = torch.Generator().manual_seed(11)
    out = {"rows": torch.randn(90, 17, generator=g), "cols": torch.randn(12, 50, generator=g).to(torch.float64),
           "half": torch.randn(33, 5, generator=g).to(torch.bfloat16), "scalar": torch.tensor(-4.25),
           "empty": torch.zeros(0, 7), "v": {"k": [1, 2, 3]}}
    return out


def _dist_state(kind: str, world_size: int, fill: bool) -> dict:
    """``kind``: 'plain' (replicated plain tensors), 'dtensor' (rows Shard(0), cols Shard(1), half Replicate),
    'sharded' (ShardedTensor rows)."""
    full = _full(kind)
    if not fill:
        full = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"k": [0, 0, 0]} for k, v in full.items()}
    if kind == "plain":
        return full
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world_size,))
    if kind == "dtensor":
        full["rows"] = distribute_tensor(full["rows"], mesh, [Shard(0)])
        full["cols"] = distribute_tensor(full["cols"], mesh, [Shard(1)])
        full["half"] = distribute_tensor(full["half"], mesh, [Replicate()])
        return full
    if kind == "sharded":
        import torch.distributed as dist
        from torch.distributed._shard.sharded_tensor import Shard as STShard
        from torch.distributed._shard.sharded_tensor import ShardMetadata
        rank = dist.get_rank()
        rows = full["rows"]
        per = -(-rows.shape[0] // world_size)
        a, b = min(rank * per, rows.shape[0]), min((rank + 1) * per, rows.shape[0])
        metas = [ShardMetadata([min(r * per, rows.shape[0]), 0], [min((r + 1) * per, rows.shape[0]) - min(r * per, rows.shape[0]), 17],
                               f"rank:{r}/cpu") for r in range(world_size)]
        local = [STShard(rows[a:b].clone(), metas[rank])] if b > a else []
        from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
        st_md = ShardedTensorMetadata([m for m in metas if m.shard_sizes[0] > 0], rows.shape,
                                      TensorProperties(dtype=rows.dtype))
        from torch.distributed._shard.sharded_tensor import ShardedTensor
        full["rows"] = ShardedTensor._init_from_local_shards_and_global_metadata(local, st_md)
        return full
    raise ValueError(kind)


def save_kind(rank, world_size, path, kind, writer_opts=None):
    sd = _dist_state(kind, world_size, True)
    if writer_opts == "zstd":
        writer = distckpt.FileSystemWriter(path, _extensions=[distckpt.ZStandard()])
        distckpt.save(sd, storage_writer=writer)
    else:
        distckpt.save(sd, checkpoint_id=path)
    return True


def _full_of(t):
    if hasattr(t, "full_tensor"):
        return t.full_tensor()
    if type(t).__name__ == "ShardedTensor":
        return None
    return t


def load_kind(rank, world_size, path, kind, reader="fs", repeat=1, env_by_rank=None):
    """Load ``kind`` at this world size, ``repeat`` times with one reader; which keys came out wrong."""
    for k, v in ((env_by_rank or {}).get(rank) or {}).items():
        os.environ[k] = v
    want = _full(kind)

    def run():
        r = (distckpt.FileSystemReader(path, verify_checksums=reader != "fs-noverify") if reader.startswith("fs")
             else distckpt.DCPReader(path))
        bad, messages = [], []
        for _ in range(repeat):
            sd = _dist_state(kind, world_size, False)
            distckpt.load(sd, storage_reader=r)
            messages.append(len(r.shares.messages) if r.shares else 0)
            for k, v in want.items():
                got = sd[k]
                if type(got).__name__ == "ShardedTensor":
                    for shard in got.local_shards():
                        o = shard.metadata.shard_offsets[0]
                        if not torch.equal(shard.tensor, v[o:o + shard.tensor.shape[0]]):
                            bad.append(k)
                elif isinstance(v, torch.Tensor):
                    if not torch.equal(_full_of(got), v):
                        bad.append(k)
                elif got != v:
                    bad.append(k)
        return {"bad": bad, "messages": messages}
    return _result(run)


def save_dcp(rank, world_size, path, kind):
    """The state saved by torch.distributed.checkpoint itself (a foreign layout)."""
    import torch.distributed.checkpoint as dcp
    sd = _dist_state(kind, world_size, True)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path))
    return True


def load_group(rank, world_size, path, kind, members, coordinator):
    """Load over a subgroup ``members`` with ``coordinator`` (a global rank) as the coordinator; the ranks outside
    the group wait at a barrier."""
    from datetime import timedelta

    import torch.distributed as dist
    group = dist.new_group(members, timeout=timedelta(seconds=30))
    out = {"error": None}
    if rank in members:
        want = _full(kind)
        sd = _dist_state(kind, world_size, False)

        def run():
            reader = distckpt.FileSystemReader(path)
            distckpt.load(sd, storage_reader=reader, process_group=group, coordinator_rank=coordinator)
            return {"bad": [k for k, v in want.items() if (not torch.equal(sd[k], v) if isinstance(v, torch.Tensor)
                                                           else sd[k] != v)],
                    "messages": len(reader.shares.messages) if reader.shares else 0}
        out = _result(run)
    dist.barrier()
    return out


def _local(t):
    """(local tensor, global offsets) of a plain tensor or DTensor."""
    if hasattr(t, "to_local"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return t.to_local().clone(), list(offset)
    return t.clone(), [0] * t.dim()


def load_kind_failing(rank, world_size, path, kind):
    """Load ``kind`` expecting a failure; return the error and each tensor's local part (to check what stayed)."""
    sd = _dist_state(kind, world_size, False)
    out = _result(lambda: distckpt.load(sd, checkpoint_id=path) and None)
    out["local"] = {k: _local(v) for k, v in sd.items() if isinstance(v, torch.Tensor)}
    out["v"] = sd["v"]
    return out


def save_seeded(rank, world_size, path, seed):
    if rank == 0:
        g = torch.Generator().manual_seed(seed)
        distckpt.save({"w": torch.randn(200, 9, generator=g), "u": torch.randn(50, generator=g)}, checkpoint_id=path,
                      no_dist=True)
    return True


def load_own_path(rank, world_size, paths, seeds):
    """Each rank loads its own path (``paths[rank]``, the save of ``seeds[rank]``): a node-local copy."""
    g = torch.Generator().manual_seed(seeds[rank])
    want = {"w": torch.randn(200, 9, generator=g), "u": torch.randn(50, generator=g)}
    sd = {k: torch.zeros_like(v) for k, v in want.items()}

    def run():
        reader = distckpt.FileSystemReader(paths[rank])
        distckpt.load(sd, storage_reader=reader)
        return {"bad": [k for k, v in want.items() if not torch.equal(sd[k], v)],
                "messages": len(reader.shares.messages) if reader.shares else 0}
    return _result(run)


def load_url(rank, world_size, url, kind="plain"):
    """Load ``kind`` from ``url`` (s3://...); which keys came out wrong, or the error."""
    want = _full(kind)
    sd = _dist_state(kind, world_size, False)

    def run():
        from distckpt.backends.s3 import S3Reader
        reader = S3Reader(url)
        distckpt.load(sd, storage_reader=reader)
        return {"bad": [k for k, v in want.items() if (not torch.equal(_full_of(sd[k]), v) if isinstance(v, torch.Tensor)
                                                       else sd[k] != v)],
                "messages": len(reader.shares.messages) if reader.shares else 0}
    out = _result(run)
    out["rows_zero"] = bool(torch.count_nonzero(_local(sd["rows"])[0]) == 0)
    return out


def load_one_receiver_dies(rank, world_size, path, n, victim, how="kill"):
    """As :func:`load_one` (rows ``n``); rank ``victim`` dies (or hangs) at its first shared-read receive."""
    from distckpt.engine import shared_reads
    if rank == victim:
        def receive(self, buf, src, everyone):
            if how == "hang":
                time.sleep(float(os.environ["DISTCKPT_TIMEOUT_S"]) * 2)
            os.kill(os.getpid(), 9)
        shared_reads.Peers.receive = receive
    sd = {"a": torch.zeros(n, 33)}
    return _result(lambda: distckpt.load(sd, checkpoint_id=path) and None)


def save_wide(rank, world_size, path, rows=8, cols=10_000):
    """Rows of ``cols`` float32s: one row larger than a small bucket."""
    if rank == 0:
        distckpt.save({"w": torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols),
                       "v": torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) * 2},
                      checkpoint_id=path, no_dist=True)
    return True


def load_wide_counting(rank, world_size, path, rows=8, cols=10_000):
    """Load the wide state; report the most bytes the load's budget let one rank hold at once, against its limit."""
    from distckpt.engine import budget as budget_mod
    most = {"held": 0, "one": 0}
    real = budget_mod.ByteBudget.acquire

    def acquire(self, n):
        real(self, n)
        most["held"] = max(most["held"], self.held)
        most["one"] = max(most["one"], n)
    budget_mod.ByteBudget.acquire = acquire
    sd = {"w": torch.zeros(rows, cols), "v": torch.zeros(rows, cols)}
    out = _result(lambda: distckpt.load(sd, checkpoint_id=path) and None)
    out.update(most)
    out["exact"] = torch.equal(sd["w"], torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols))
    return out


def torch_save_reshaped(rank, world_size, path):
    """A torch.save file whose two keys view one storage with two shapes: one offset, one length, two row sizes."""
    if rank == 0:
        w = torch.arange(50 * 16, dtype=torch.float32).reshape(50, 16)
        torch.save({"x": w, "y": w.view(25, 32)}, path)
    return True


def load_torch_save_reshaped(rank, world_size, path, keys_by_rank):
    w = torch.arange(50 * 16, dtype=torch.float32).reshape(50, 16)
    want = {k: v for k, v in {"x": w, "y": w.view(25, 32)}.items() if k in keys_by_rank[rank]}
    sd = {k: torch.zeros_like(v) for k, v in want.items()}

    def run():
        reader = distckpt.TorchSaveReader(path)
        distckpt.load(sd, storage_reader=reader)
        return {"bad": sorted(k for k, v in want.items() if not torch.equal(sd[k], v)),
                "messages": len(reader.shares.messages) if reader.shares else 0}
    return _result(run)
