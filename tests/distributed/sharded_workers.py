"""Rank functions for the ShardedTensor (FSDP1) and sub-mesh DTensor tests."""

from __future__ import annotations

import warnings

import torch

import distckpt

warnings.filterwarnings("ignore", message=".*ShardedTensor.*")
warnings.filterwarnings("ignore", category=FutureWarning)

FULL = torch.arange(24 * 10, dtype=torch.float32).reshape(24, 10)


def _fill_shards(st, full=FULL):
    for shard in st.local_shards():
        o, z = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        shard.tensor.copy_(full[o[0]:o[0] + z[0], o[1]:o[1] + z[1]])
    return st


def _shards_match(st, full=FULL):
    return all(torch.equal(s.tensor, full[s.metadata.shard_offsets[0]:s.metadata.shard_offsets[0] + s.metadata.shard_sizes[0],
                                          s.metadata.shard_offsets[1]:s.metadata.shard_offsets[1] + s.metadata.shard_sizes[1]])
               for s in st.local_shards())


def chunk_spec(world_size, dim):
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    return ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in range(world_size)])


def uneven_spec(world_size):
    """Blocks of rows and columns of uneven sizes, several per rank, placed round-robin."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec

    blocks = [((0, 0), (5, 10)), ((5, 0), (11, 4)), ((5, 4), (11, 6)), ((16, 0), (8, 10))]
    return EnumerableShardingSpec([ShardMetadata(list(o), list(z), f"rank:{i % world_size}/cpu")
                                   for i, (o, z) in enumerate(blocks)])


def save_sharded_tensor(rank, world_size, path, how):
    """Save FULL as a ShardedTensor (``how``: "rows" or "uneven") or as a DTensor sharded by rows ("dtensor")."""
    from torch.distributed._shard import sharded_tensor

    if how == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        value = distribute_tensor(FULL.clone(), init_device_mesh("cpu", (world_size,)), [Shard(0)])
    else:
        spec = chunk_spec(world_size, 0) if how == "rows" else uneven_spec(world_size)
        value = _fill_shards(sharded_tensor.zeros(spec, 24, 10))
    distckpt.save({"st": value, "step": 7}, checkpoint_id=path)
    return True


def load_sharded_tensor(rank, world_size, path, how):
    """Load into a ShardedTensor ("cols", "uneven") or a DTensor sharded by columns ("dtensor"); whether it matches."""
    from torch.distributed._shard import sharded_tensor

    if how == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        value = distribute_tensor(torch.zeros(24, 10), init_device_mesh("cpu", (world_size,)), [Shard(1)])
        sd = {"st": value, "step": 0}
        distckpt.load(sd, checkpoint_id=path)
        return torch.equal(value.full_tensor(), FULL) and sd["step"] == 7
    spec = chunk_spec(world_size, 1) if how == "cols" else uneven_spec(world_size)
    value = sharded_tensor.zeros(spec, 24, 10)
    sd = {"st": value, "step": 0}
    distckpt.load(sd, checkpoint_id=path)
    return _shards_match(value) and sd["step"] == 7 and len(value.local_shards()) > 0


def async_save_sharded_tensor(rank, world_size, path):
    from torch.distributed._shard import sharded_tensor

    value = _fill_shards(sharded_tensor.zeros(uneven_spec(world_size), 24, 10))
    handle = distckpt.async_save({"st": value}, checkpoint_id=path)
    for shard in value.local_shards():  # training goes on: the save holds its own copy
        shard.tensor.zero_()
    handle.result()
    return True


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 5))


def fsdp1_save(rank, world_size, path):
    """An FSDP1 model's SHARDED_STATE_DICT (ShardedTensors) and its optimizer's; returns the full weights."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    model = FSDP(_model(0), device_id=torch.device("cpu"), use_orig_params=True)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sd = model.state_dict()
    assert any(distckpt.planning.tensors.is_sharded_tensor(v) for v in sd.values()), "FSDP1 gave no ShardedTensor"
    distckpt.save({"model": sd}, checkpoint_id=path)
    return {k: v.clone() for k, v in _model(0).state_dict().items()}


def fsdp1_load(rank, world_size, path):
    """Load the checkpoint into a differently initialised FSDP1 model at this world size; its full weights."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    model = FSDP(_model(1), device_id=torch.device("cpu"), use_orig_params=True)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sd = model.state_dict()
        distckpt.load({"model": sd}, checkpoint_id=path)
        model.load_state_dict(sd)
    with FSDP.summon_full_params(model):
        return {k.replace("_fsdp_wrapped_module.", ""): v.detach().clone() for k, v in model.named_parameters()}


def submesh_save(rank, world_size, path):
    """Two pipeline stages: "a" on a mesh of ranks 0-1, "b" on ranks 2-3; the other stage's ranks hold no shard."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    first, second = DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [2, 3])
    sd = {"a": distribute_tensor(FULL.clone(), first, [Shard(0)]),
          "b": distribute_tensor(FULL.t().contiguous(), second, [Shard(1)]),
          "r": distribute_tensor(torch.ones(3), second, [Replicate()]),
          "step": 3}
    distckpt.save(sd, checkpoint_id=path)
    return True


def submesh_load(rank, world_size, path):
    """Load into the other arrangement: "a" on ranks 1-3, "b" on ranks 0-1; whether each member's shard matches."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    first, second = DeviceMesh("cpu", [1, 2, 3]), DeviceMesh("cpu", [0, 1])
    a = distribute_tensor(torch.zeros(24, 10), first, [Shard(1)])
    b = distribute_tensor(torch.zeros(10, 24), second, [Shard(0)])
    sd = {"a": a, "b": b, "step": 0}
    distckpt.load(sd, checkpoint_id=path, planner=distckpt.DefaultLoadPlanner(allow_partial_load=True))
    ok = sd["step"] == 3
    if rank in (1, 2, 3):
        ok = ok and torch.equal(a.full_tensor(), FULL)
    if rank in (0, 1):
        ok = ok and torch.equal(b.full_tensor(), FULL.t())
    return ok
