"""State dicts for the multi-rank tests: every tensor kind, built reproducibly from a name."""

from __future__ import annotations

import zlib

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor


def expected(name: str, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if dtype == torch.bool:
        return torch.randn(shape, generator=g) > 0
    if dtype == torch.int64:
        return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=torch.int64)
    return torch.randn(shape, generator=g).to(dtype)


def meshes(world_size: int):
    mesh1 = init_device_mesh("cpu", (world_size,))
    rows = 2 if world_size % 2 == 0 else 1
    mesh2 = init_device_mesh("cpu", (rows, world_size // rows), mesh_dim_names=("a", "b"))
    return mesh1, mesh2


# name -> (shape, dtype, layout); layout is ("plain",) or (mesh_ndim, placements)
SAVE_LAYOUT = {
    "plain.f32": ((5, 7), torch.float32, ("plain",)),
    "plain.zerod": ((), torch.float32, ("plain",)),
    "plain.empty": ((0, 3), torch.float32, ("plain",)),
    "s0.bf16": ((7, 5), torch.bfloat16, (1, [Shard(0)])),
    "s0.f16": ((7, 5), torch.float16, (1, [Shard(0)])),
    "s0.f32": ((7, 5), torch.float32, (1, [Shard(0)])),
    "s0.i64": ((7, 5), torch.int64, (1, [Shard(0)])),
    "s0.bool": ((7, 5), torch.bool, (1, [Shard(0)])),
    "s1.f32": ((3, 10), torch.float32, (1, [Shard(1)])),
    "rep.f32": ((4, 4), torch.float32, (1, [Replicate()])),
    "m2.ss": ((9, 6), torch.float32, (2, [Shard(0), Shard(1)])),
    "m2.sr": ((5, 11), torch.float32, (2, [Shard(1), Replicate()])),
    "m2.s00": ((13, 3), torch.float32, (2, [Shard(0), Shard(0)])),
    "dt.empty": ((0, 4), torch.float32, (1, [Shard(0)])),
    "dt.uneven1": ((1, 9), torch.float32, (1, [Shard(0)])),
}

# a different layout for every key, to load into
RESHARD_LAYOUT = {
    "plain.f32": (1, [Shard(0)]),
    "plain.zerod": ("plain",),
    "plain.empty": (1, [Shard(1)]),
    "s0.bf16": (1, [Shard(1)]),
    "s0.f16": (2, [Shard(1), Shard(0)]),
    "s0.f32": ("plain",),
    "s0.i64": (1, [Replicate()]),
    "s0.bool": (1, [Shard(1)]),
    "s1.f32": (1, [Shard(0)]),
    "rep.f32": (2, [Shard(0), Shard(1)]),
    "m2.ss": (1, [Replicate()]),
    "m2.sr": (2, [Shard(0), Shard(1)]),
    "m2.s00": (1, [Shard(1)]),
    "dt.empty": ("plain",),
    "dt.uneven1": (2, [Replicate(), Shard(1)]),
}


def build(world_size: int, layouts: dict, *, fill: bool) -> dict:
    """A state dict of the given layouts; with fill=False every tensor holds garbage to be overwritten."""
    mesh1, mesh2 = meshes(world_size)
    sd = {}
    for name, (shape, dtype, _) in SAVE_LAYOUT.items():
        layout = layouts[name]
        full = expected(name, shape, dtype) if fill else _garbage(shape, dtype)
        if layout[0] == "plain":
            sd[name] = full
        else:
            mesh = mesh1 if layout[0] == 1 else mesh2
            sd[name] = distribute_tensor(full, mesh, layout[1])
    sd["values"] = {"step": 17, "name": "run-α", "ratios": [0.5, float("inf"), None], "blob": b"\x00\x01"} if fill else {
        "step": 0, "name": "", "ratios": [], "blob": b""}
    return sd


def _garbage(shape, dtype):
    if dtype == torch.bool:
        return torch.ones(shape, dtype=torch.bool) if 0 not in shape else torch.empty(shape, dtype=dtype)
    return torch.full(shape, 99, dtype=dtype) if 0 not in shape else torch.empty(shape, dtype=dtype)


def check(sd: dict) -> list[str]:
    """Compare every tensor (gathered in full) with its expected value; return the mismatches."""
    bad = []
    for name, (shape, dtype, _) in SAVE_LAYOUT.items():
        t = sd[name]
        # contiguous: some torch releases (2.11) gather some placements into a strided result
        full = (t.full_tensor() if isinstance(t, DTensor) else t).contiguous()
        want = expected(name, shape, dtype)
        if full.dtype != want.dtype or full.shape != want.shape or not _same_bits(full, want):
            bad.append(name)
    v = sd["values"]
    if v != {"step": 17, "name": "run-α", "ratios": [0.5, float("inf"), None], "blob": b"\x00\x01"}:
        bad.append(f"values={v!r}")
    return bad


SAVE = {k: v[2] for k, v in SAVE_LAYOUT.items()}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaNs included), for tensors of one dtype and shape."""
    return torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a, b.view(-1).view(torch.uint8) if b.numel() else b)
