"""Run a function on N real processes joined by a torch.distributed (gloo) group.

Used by distckpt's own multi-rank tests and usable by anyone who tests code
built on distckpt. The function must be importable (defined at module level).

Ranks are forked from a fork server that has imported torch and distckpt once
(where the platform has one), not started as fresh interpreters: importing
torch is most of what starting a rank costs, a test suite starts hundreds of
groups, and a fork server is still a clean, single-threaded parent (unlike
forking the caller, which may hold threads and locks). Each rank gets the
caller's environment, working directory and ``sys.path`` of the moment it
starts, as a spawned one would.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional

__all__ = ["run_ranks", "RankError", "RankFailure", "free_port", "preload"]


class RankError(AssertionError):
    """Some ranks failed (or hung); ``errors`` maps rank to its traceback text."""

    def __init__(self, errors: dict[int, str]):
        self.errors = errors
        super().__init__("\n".join(f"--- rank {r} ---\n{t}" for r, t in sorted(errors.items())))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What every rank would import before its first save or load (``import distckpt`` alone imports nothing: the
# package is lazy). Imported once in the fork server, so that each rank starts with it, shared copy-on-write.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.device_mesh", "torch.distributed.tensor", "distckpt",
            "distckpt.saving", "distckpt.loading", "distckpt.async_saving", "distckpt.manager"]


def preload(*modules: str) -> None:
    """Import ``modules`` too in the fork server that ranks start from (the modules of the functions they run,
    say). Takes effect when the server starts: call it before the first :func:`run_ranks` of the process. None of
    them may start a thread at import: the server forks."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def _context(start_method: Optional[str]) -> Any:
    """The multiprocessing context ranks start from: ``start_method``, else a fork server where there is one."""
    if start_method is None:
        start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # taken when the server starts: the first group of the process
    return ctx


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any, timeout_s: float, env: dict,
           backend: str, caller_env: dict) -> None:
    # the caller's environment now, not the fork server's when it started (multiprocessing sets cwd and sys.path)
    os.environ.clear()
    os.environ.update(caller_env)
    # what torchrun would set: every rank of the group runs on this host
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size)})
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if "nccl" in backend and torch.cuda.is_available():  # one device per rank, as torchrun users set it
            torch.cuda.set_device(rank % torch.cuda.device_count())
        if port > 0:  # a client of the store the parent holds, as torchrun's workers are clients of their agent's
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout_s))
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout_s))
        else:  # rank 0 hosts the store (init_method="tcp://" without torchrun)
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{-port}", rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout_s))
        # every rank past its connections before any runs: a rank whose function returns at once would otherwise
        # exit, closing its side, while another still finished connecting to it ("connectFullMesh failed")
        dist.barrier()
        result = fn(rank, world_size, *args)
        # tensors cross as bytes: torch's shared-memory handles die with this process
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120.0,
              collective_timeout_s: float = 60.0, env: Optional[dict] = None, allow_failures: bool = False,
              backend: str = "gloo", start_method: Optional[str] = None, store_on_rank_0: bool = False) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes; return each rank's result.

    Raises RankError if any rank raised, exited abnormally, or did not finish
    within ``timeout_s`` (hung ranks are killed). With ``allow_failures``, a
    failed rank's entry is a :class:`RankFailure` instead. ``backend`` is the
    process group's (``"nccl"`` needs one CUDA device per rank; with ``"gloo"``
    the ranks may share a device, each selecting it themselves). ``start_method`` is multiprocessing's
    (default: ``"forkserver"`` where the platform has it, else ``"spawn"``). The group's store is held by this
    process, as torchrun's agent holds it; ``store_on_rank_0``: by rank 0, as ``init_method="tcp://"`` has it
    without torchrun (then a port found free is used, which another process could take first).
    """
    ctx = _context(start_method)
    queue = ctx.Queue()
    # the parent holds the group's store from a port it bound itself: a port found free and then closed could be
    # taken by another test's group in between, whose ranks would then join this one
    store = None if store_on_rank_0 else _parent_store(collective_timeout_s)
    port = -free_port() if store is None else store.port
    caller_env = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, collective_timeout_s, dict(env or {}), backend,
                                              caller_env), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout_s
    while len(results) + len(errors) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            rank, ok, value = queue.get(timeout=min(remaining, 1.0))
        except queue_mod.Empty:
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
            continue
        if ok:
            import torch

            results[rank] = torch.load(io.BytesIO(value), weights_only=True)
        else:
            errors[rank] = value
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    for r in range(world_size):
        if r not in results and r not in errors:
            errors[r] = f"no result: exit code {procs[r].exitcode} (hung past {timeout_s}s or died)"
    if errors and not allow_failures:
        raise RankError(errors)
    return [results[r] if r in results else RankFailure(r, errors[r], procs[r].exitcode) for r in range(world_size)]


def _parent_store(timeout_s: float) -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


class RankFailure:
    """The outcome of a rank that raised, died or hung (``exitcode`` -9 for SIGKILL)."""

    def __init__(self, rank: int, text: str, exitcode: Optional[int]):
        self.rank, self.text, self.exitcode = rank, text, exitcode

    def __repr__(self) -> str:
        return f"RankFailure(rank={self.rank}, exitcode={self.exitcode}, text={self.text[-200:]!r})"
