"""Rank bodies of test_broken_groups.py: calls out of step around async saves and the tiered manager, and a group
whose transport failed."""

import os
import time

import torch

import distckpt


def async_save_beside_save(rank, world_size, root):
    """Rank 0's first async_save meets rank 1's save: what each raised, and how long it took."""
    begun = time.monotonic()
    try:
        if rank == 0:
            distckpt.async_save({"w": torch.ones(4)}, checkpoint_id=os.path.join(root, "a")).result()
        else:
            distckpt.save({"w": torch.ones(4)}, checkpoint_id=os.path.join(root, "b"))
    except Exception as exc:  # noqa: BLE001 - the test checks the type
        return {"type": type(exc).__name__, "checkpoint_error": isinstance(exc, distckpt.CheckpointError),
                "message": str(exc), "seconds": time.monotonic() - begun}
    return {"type": None, "seconds": time.monotonic() - begun}


def tiered_manager_on_one_rank(rank, world_size, root):
    from distckpt.tiers import TieredCheckpointManager

    if rank != 0:
        time.sleep(5)  # training: never makes the manager (past the arrival bound of 3 s)
        return None
    begun = time.monotonic()
    try:
        TieredCheckpointManager(os.path.join(root, "durable"), local=os.path.join(root, "local"))
    except Exception as exc:  # noqa: BLE001
        return {"type": type(exc).__name__, "checkpoint_error": isinstance(exc, distckpt.CheckpointError),
                "message": str(exc), "seconds": time.monotonic() - begun}
    return {"type": None}


def a_peer_dies_then_later_calls(rank, world_size, root):
    """Rank 1 dies inside a save; rank 0 reports what that save and its next two calls raised, and how fast."""
    from distckpt import faults

    if rank == 1:
        def die(kind, what):
            os._exit(3)

        with faults.inject(faults.Fault("call", kinds=("collective",), index=None, callback=die)):
            distckpt.save({"w": torch.ones(4)}, checkpoint_id=os.path.join(root, "s0"))
        return None
    out = []
    for i in range(3):
        begun = time.monotonic()
        try:
            distckpt.save({"w": torch.ones(4)}, checkpoint_id=os.path.join(root, f"s{i}"))
            out.append({"type": None})
        except Exception as exc:  # noqa: BLE001
            out.append({"type": type(exc).__name__, "broken": isinstance(exc, distckpt.ProcessGroupBrokenError),
                        "message": str(exc), "seconds": time.monotonic() - begun})
    return out
