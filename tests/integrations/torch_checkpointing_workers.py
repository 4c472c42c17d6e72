"""Rank bodies of tests/integrations/test_torch_checkpointing.py (importable by the ranks run_ranks starts)."""

from __future__ import annotations

import os
import signal

import torch

GLOBAL = (12, 6)


def full(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(*GLOBAL, generator=g)


def _cpu_gather(self, data, process_group=None):
    """torch_checkpointing 0.1.1 gathers sharding metadata through CUDA tensors (metadata_manager.py,
    ``_all_gather_pickled_data``: ``device="cuda"``), so on a machine without CUDA its multi-rank saves fail
    before any storage call. The same gather through gloo, for these CPU tests; the storage path is untouched."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(out, data, group=process_group)
    return dict(enumerate(out))


def manager(barrier_timeout: int = 60):
    from torch_checkpointing import CheckpointManager, ItemSpec
    from torch_checkpointing.metadata_manager import DefaultMetadataManager

    if not torch.cuda.is_available():
        DefaultMetadataManager._all_gather_pickled_data = _cpu_gather
    from torch_checkpointing.default_resharder import DefaultResharder

    from distckpt.integrations.torch_checkpointing import DistckptStorageConfig

    config = CheckpointManager.Config.with_sync_save()
    config.save.writer_config.checkpoint_write_barrier_timeout_sec = barrier_timeout
    config.storage_config = DistckptStorageConfig()
    config.items = {"model": ItemSpec(resharder=DefaultResharder())}
    return config.build()


def _dtensor(value: torch.Tensor, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    return distribute_tensor(value, mesh, [Shard(0)])


def save(rank: int, world_size: int, path: str, step: int) -> None:
    m = manager()
    try:
        m.save(path, {"model": {"w": _dtensor(full(step), world_size)}, "step": step})
    finally:
        m.close()


def load(rank: int, world_size: int, path: str, saved_world: int = 1) -> tuple[torch.Tensor, int]:
    """The whole tensor as this rank loaded it (its shard gathered), and the step (-1 on a rank that the save
    did not have: torch_checkpointing keeps an item without a resharder in one file per saving rank)."""
    m = manager()
    try:
        into = {"model": {"w": _dtensor(torch.zeros(GLOBAL), world_size)}}
        if rank < saved_world:
            into["step"] = -1
        out = m.load(path, into=into)
        return out["model"]["w"].full_tensor(), out.get("step", -1)
    finally:
        m.close()


def save_then_die(rank: int, world_size: int, root: str) -> None:
    """Commit step 1, then start step 2; rank 1 is killed (SIGKILL) at its third write of step 2."""
    from distckpt import faults

    save(rank, world_size, f"{root}/step_1", 1)
    writes = [0]

    def die(kind: str, what: str) -> None:
        writes[0] += 1
        if writes[0] == 3:
            os.kill(os.getpid(), signal.SIGKILL)

    m = manager(barrier_timeout=5)
    try:
        with faults.inject(faults.Fault("call", kinds=("write",), rank=1, callback=die)):
            m.save(f"{root}/step_2", {"model": {"w": _dtensor(full(2), world_size)}, "step": 2})
    finally:
        m.close()


def resume(rank: int, world_size: int, root: str) -> tuple[list[str], torch.Tensor, int, torch.Tensor]:
    """What a restarted job sees: the committed steps, the newest loaded, then step 2 saved again and loaded."""
    from distckpt.integrations.torch_checkpointing import DistckptStorage

    steps = sorted(n for n in DistckptStorage().ls(root) if n.startswith("step_"))
    whole, step = load(rank, world_size, f"{root}/{steps[-1]}", world_size)
    save(rank, world_size, f"{root}/step_2", 2)
    again, _ = load(rank, world_size, f"{root}/step_2", world_size)
    return steps, whole, step, again
