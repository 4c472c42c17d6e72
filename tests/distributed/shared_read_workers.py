"""Ranks of the shared-read tests: save states of each kind, load them counting the bytes each rank reads."""

from __future__ import annotations

import os

import torch

import distckpt
from distckpt.engine import shared_reads
from distckpt.testing.read_counts import FileReads


def _replicated(scale: int = 8) -> dict:
    """The same on every rank: plain tensors of several dtypes and sizes, a value, a 2-D tensor of many rows."""
    g = torch.Generator().manual_seed(7)
    sd = {f"layer{i}.w": torch.randn(64 * (i + 1) * scale, 33, generator=g) for i in range(6)}
    sd["emb"] = torch.randint(0, 1000, (1000 * scale, 16), generator=g, dtype=torch.int64)
    sd["half"] = torch.randn(257, 3, generator=g).to(torch.bfloat16)
    sd["scalar"] = torch.tensor(3.5)
    sd["step"] = 11
    sd["meta"] = {"name": "run", "lr": [0.1, 0.01]}
    return sd


def _own_node(rank: int) -> None:
    """Each rank a node of its own (DISTCKPT_NODE_ID): ranks of one node reading one file on disk leave it to the
    page cache (shared reads "auto"); as nodes apart, they share their reads, as they would on a cluster."""
    os.environ["DISTCKPT_NODE_ID"] = f"node{rank}"


def _zeros_like(sd: dict) -> dict:
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    out["step"], out["meta"] = 0, {"name": "", "lr": [0.0, 0.0]}
    return out


def _mesh(world_size):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (world_size,))


def _sharded(world_size, fill: bool) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = _mesh(world_size)
    full = torch.arange(240 * 2000, dtype=torch.float32).reshape(240, 2000)
    other = torch.arange(10 * 300, dtype=torch.float64).reshape(10, 300) * 0.5
    return {"fsdp.w": distribute_tensor(full if fill else torch.zeros_like(full), mesh, [Shard(0)]),
            "fsdp.cols": distribute_tensor(other if fill else torch.zeros_like(other), mesh, [Shard(1)])}


def _hsdp(world_size, fill: bool) -> dict:
    """HSDP: replicated across the first mesh dimension, sharded along the second (2 x 2 at 4 ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (2, world_size // 2))
    full = torch.arange(64 * 3000, dtype=torch.float32).reshape(64, 3000) * 0.25
    return {"hsdp.w": distribute_tensor(full if fill else torch.zeros_like(full), mesh, [Replicate(), Shard(0)])}


def _data_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.startswith("data-"))


def save_state(rank, world_size, path, kind):
    sd = {}
    if kind in ("replicated", "mixed"):
        sd.update(_replicated())
    if kind in ("sharded", "mixed"):
        sd.update(_sharded(world_size, True))
    if kind == "hsdp":
        sd.update(_hsdp(world_size, True))
    distckpt.save(sd, checkpoint_id=path)
    return True


def load_state(rank, world_size, path, kind, shared=None, one_node=False):
    """Load ``kind`` (saved at any world size); return whether it is bit-exact and the bytes this rank read
    (``one_node``: every rank on this machine's node, else each a node of its own)."""
    if not one_node:
        _own_node(rank)
    want = {}
    if kind in ("replicated", "mixed"):
        want.update(_replicated())
    if kind in ("sharded", "mixed"):
        want.update(_sharded(world_size, True))
    sd = {k: v for k, v in _zeros_like(_replicated()).items()} if kind in ("replicated", "mixed") else {}
    if kind in ("sharded", "mixed"):
        sd.update(_sharded(world_size, False))
    if kind == "hsdp":
        want.update(_hsdp(world_size, True))
        sd.update(_hsdp(world_size, False))
    reads = FileReads()
    reader = distckpt.FileSystemReader(path, shared_reads=shared)
    distckpt.load(sd, storage_reader=reader)
    exact = all(_equal(sd[k], v) for k, v in want.items())
    return {"exact": exact, "read": reads.total, "data": _data_bytes(path),
            "messages": len(reader.shares.messages) if reader.shares else 0,
            "peers": sorted({r for m in reader.shares.messages for r in (m.src,) + m.receivers}) if reader.shares else []}


def _equal(a, b) -> bool:
    if isinstance(b, torch.Tensor):
        if hasattr(b, "full_tensor"):
            return torch.equal(a.full_tensor(), b.full_tensor())
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def load_corrupted(rank, world_size, path):
    _own_node(rank)
    sd = _zeros_like(_replicated())
    try:
        distckpt.load(sd, checkpoint_id=path)
    except distckpt.CheckpointError as exc:
        return {"error": type(exc).__name__, "text": str(exc),
                "zeroed": bool(torch.count_nonzero(sd["layer5.w"]) == 0)}
    return {"error": None}


def load_with_dying_reader(rank, world_size, path, victim):
    """Rank ``victim`` dies (SIGKILL) after its first shared-read message; the others must raise, not hang."""
    _own_node(rank)
    if rank == victim:
        real = shared_reads.Peers.send
        sent = {"n": 0}

        def send_then_die(self, buf, receivers):
            real(self, buf, receivers)
            sent["n"] += 1
            if sent["n"] == 1:
                os.kill(os.getpid(), 9)
        shared_reads.Peers.send = send_then_die
    sd = _zeros_like(_replicated(scale=16))
    try:
        distckpt.load(sd, checkpoint_id=path)
    except distckpt.CheckpointError as exc:
        return {"error": type(exc).__name__, "text": str(exc)[:2000]}
    return {"error": None}


def save_big_replicated(rank, world_size, path):
    distckpt.save(_replicated(scale=16), checkpoint_id=path)
    return True


def load_expecting_failure(rank, world_size, path):
    _own_node(rank)
    sd = _zeros_like(_replicated())
    try:
        distckpt.load(sd, checkpoint_id=path)
    except distckpt.CheckpointError as exc:
        return {"error": type(exc).__name__, "text": str(exc)[:3000]}
    return {"error": None}


def load_listing_chunks(rank, world_size, path):
    """Load the mixed state; return whether it is bit-exact and the keys of the chunks this rank listed for the
    coordinator."""
    _own_node(rank)
    want = {**_replicated(), **_sharded(world_size, True)}
    sd = {**_zeros_like(_replicated()), **_sharded(world_size, False)}
    reader = distckpt.FileSystemReader(path, shared_reads=True)
    listed = []
    table_of = reader.read_chunks

    def read_chunks(plan, held_alone=None):
        chunks, raw = table_of(plan, held_alone)
        listed.extend(chunks)
        return chunks, raw

    reader.read_chunks = read_chunks
    distckpt.load(sd, storage_reader=reader)
    where = {(info.file, info.offset): index.fqn for index, info in reader.metadata.storage_data.items.items()}
    return {"exact": all(_equal(sd[k], v) for k, v in want.items()), "listed": sorted({where[c[:2]] for c in listed})}


def load_many_replicated(rank, world_size, path, collide=False):
    """Load ``many_replicated``'s state; whether exact, and the bytes this rank moved in the planning phase.
    ``collide``: every rank's table claims one digest (as two tables whose digests collided would)."""
    import distckpt.loading as loading
    from distckpt.distributed import phase_bytes

    if collide:
        marks = loading.table_marks
        loading.table_marks = lambda raw: (1, marks(raw)[1])
    want = many_replicated()
    sd = {k: torch.zeros_like(v) for k, v in want.items() if not (collide and rank == 1 and k == "t0")}
    try:
        distckpt.load(sd, storage_reader=distckpt.FileSystemReader(path, shared_reads=True))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None, "exact": all(_equal(sd[k], want[k]) for k in sd), "planning": phase_bytes.get("load planning")}


def many_replicated() -> dict:
    return {f"t{i}": torch.full((8, 8), float(i)) for i in range(300)}


def save_many_replicated(rank, world_size, path):
    distckpt.save(many_replicated(), checkpoint_id=path)
    return True


def load_where_one_rank_may_share(rank, world_size, path):
    """Rank 0 loads a replicated key beside its shards (it may share), rank 1 only its shards (it may not): rank 1
    votes no table, then builds and sends its own once rank 0's vote asks for the exchange."""
    _own_node(rank)
    want = {**_sharded(world_size, True), **({"layer0.w": _replicated()["layer0.w"]} if rank == 0 else {})}
    sd = {**_sharded(world_size, False), **({"layer0.w": torch.zeros_like(want["layer0.w"])} if rank == 0 else {})}
    reader = distckpt.FileSystemReader(path, shared_reads=True)
    distckpt.load(sd, storage_reader=reader)
    return {"exact": all(_equal(sd[k], v) for k, v in want.items()), "shares": reader.shares is not None}
