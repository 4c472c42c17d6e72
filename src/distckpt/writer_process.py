"""The writer process of ``async_save(..., async_checkpointer_type=PROCESS)``: one per rank, started once, reused.

The training process stages its state into shared memory (:mod:`distckpt.staging`, a pool of shared arenas) and
hands the writer the staged state dict: its tensors travel as handles to that memory, so the writer writes from
the very bytes the training process copied, with the ordinary save sequence (planning, data files, checksums,
commit). The writer's Python (encoding, hashing, retries, the commit) runs on another interpreter's GIL, out of
the training loop's way.

State on a GPU is staged as for a thread, into the same arenas, here in shared memory that is page-locked
(cudaHostRegister) for the device copies; the writer touches no device and initialises no CUDA context: it reads
host memory only.

The writers of a job form a gloo process group of their own (same ranks as the training group), made through the
job's TCP store under a key prefix of each generation, with the job's collective timeout. A writer that dies
(SIGKILL, the OOM killer) fails its rank's save at once (the pipe to it ends); the other ranks' writers fail theirs
within the collective timeout, so nothing is committed; and the next async_save replaces every rank's writer, on
every rank together (its agreement carries each rank's "my writer is gone or out of step"). A writer whose training
process ended finishes the save it was writing (a whole save commits, as every rank's writer must agree), then
ends with its pipe.
"""

from __future__ import annotations

import io
import itertools
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import uuid
import warnings
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Optional

from . import events, faults, knobs
from ._sequence import tell_rank
from .distributed import JSON, Coordinator, describe, dist, rebuild
from .engine.filling import Filling
from .errors import CheckpointError, StorageIOError
from .planning.tensors import is_dtensor, local_tensor
from .saving import run_save

__all__ = ["WriterProcess", "WriterProcessError", "check_picklable", "packed_job", "rendezvous_of"]


class WriterProcessError(StorageIOError):
    """The writer process of a rank died or could not start; the save it was writing is not committed."""


def _store_address() -> Optional[tuple[str, int]]:
    """Host and port of the job's TCP store (the default group's), which the writers rendezvous through."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        store = None
    while store is not None and not isinstance(store, dist.TCPStore) and hasattr(store, "underlying_store"):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return store.host, store.port
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return (addr, int(port)) if addr and port and port.isdigit() else None


def rendezvous_of(coord: Coordinator) -> dict:
    """Where this generation of writers meets, decided by the coordinator and given to every rank (a phase of
    ``coord``): the job's store and a key prefix of its own."""

    def choose(_: list) -> dict:
        address = _store_address()
        if address is None:
            raise CheckpointError("async_save with PROCESS needs the job's TCP store (torchrun, or init_process_group "
                                  "with env:// or tcp://) for its writer processes to meet; pass "
                                  "async_checkpointer_type=THREAD")
        return {"host": address[0], "port": address[1], "prefix": f"distckpt-writers/{uuid.uuid4().hex}"}

    return coord.all_reduce("async_save writer rendezvous", lambda: None, choose, JSON, JSON)


class WriterProcess:
    """This rank's writer process, and the thread that receives its results."""

    def __init__(self, rank: int, world_size: int, meeting: Optional[dict], timeout_s: float):
        # a fresh interpreter that runs this module, never the training script: multiprocessing's spawn would import
        # the script's __main__ again (a script without a main guard would train again in the writer)
        self._conn, child_conn = mp.Pipe()
        config = {"fd": child_conn.fileno(), "rank": rank, "world_size": world_size, "meeting": meeting,
                  "timeout_s": timeout_s, "nice": knobs.async_write_nice(),
                  # the training process's key: tensors travel as file descriptors, fetched from its resource sharer
                  "authkey": mp.current_process().authkey.hex()}
        # the training process's import path: distckpt, and the modules of a user's planner or storage writer
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.process = subprocess.Popen([sys.executable, "-m", "distckpt.writer_process", json.dumps(config)],
                                        pass_fds=[child_conn.fileno()], close_fds=True, env=env)
        child_conn.close()
        self.rank = rank
        self.lock = threading.Lock()
        self.pending: dict[int, tuple] = {}  # ticket -> (done(metadata, error, transport_failed), event fields)
        self.gone: Optional[str] = None  # why this writer can take no more saves
        self.out_of_step = False  # its group failed a collective: it must be replaced with every rank's
        self.start_error: Optional[BaseException] = None
        self._tickets = itertools.count()  # what tells this writer's saves apart (their numbers: only on a group)
        # sends go through a thread: a job larger than the socket's buffer waits for a busy writer, not the caller
        self._outbox: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send, name=f"distckpt-writer-send-{rank}", daemon=True)
        self._sender.start()
        self._receiver = threading.Thread(target=self._receive, name=f"distckpt-writer-results-{rank}", daemon=True)
        self._receiver.start()

    def submit(self, number: int, coordinator_rank: int, checkpoint_id: Any, job: bytes,
               done: Callable[[Any, Optional[BaseException], bool], None]) -> None:
        """Hand save ``number`` (``job``, from :func:`packed_job`) to the writer; ``done(metadata, error,
        transport_failed)`` runs when it ends."""
        with self.lock:
            if self.gone is not None:
                raise WriterProcessError(self.gone)
            ticket = next(self._tickets)
            self.pending[ticket] = done, events.current()  # the save's events come back with this call's fields
        where = None if checkpoint_id is None else os.fspath(checkpoint_id)
        self._outbox.put((ticket, number, coordinator_rank, where, job))

    def _send(self) -> None:
        while True:
            message = self._outbox.get()
            try:
                self._conn.send(message)
            except (OSError, EOFError, ValueError):
                pass  # the writer is gone: the receiver fails what it was handed
            if message is None:
                return

    def _receive(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "ready":  # it has joined its group; the saves handed to it meanwhile are queued in the pipe
                continue
            if kind == "start-failed":
                self.start_error = _error(message[1], WriterProcessError)
            else:
                _, ticket, metadata, info, transport_failed, phases = message
                if transport_failed:
                    self.out_of_step = True
                with self.lock:
                    done, fields = self.pending.pop(ticket, (None, {}))
                if done is not None:
                    events.relay(phases, **fields)  # the writer's save phases, for this process's observers
                    done(metadata, None if info is None else _error(info, CheckpointError), transport_failed)
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited ({code})"
        if self.start_error is not None:
            how = f"could not join the writers' process group ({self.start_error})"
        reason = (f"the writer process of rank {self.rank} (pid {self.process.pid}) {how}; the save it was writing is "
                  "not committed. The next async_save starts new writer processes on every rank")
        with self.lock:
            self.gone = reason
            pending, self.pending = self.pending, {}
        for done, _ in pending.values():
            done(None, WriterProcessError(reason), True)

    def release(self) -> None:
        """Tell the writer to let go of the last save's staging memory (after the saves handed to it)."""
        self._outbox.put("release")

    def alive(self) -> bool:
        return self.gone is None and self.process.poll() is None

    def close(self, timeout_s: float = 30.0) -> None:
        """Let the writer finish what it was handed, then stop it."""
        self._outbox.put(None)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """Stop the writer now (one replaced because its group fell out of step may be inside a collective)."""
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._conn.close()


def _tensor_of(data: bytes, dtype: str, shape: tuple) -> Any:
    """A tensor rebuilt from its bytes (:class:`_JobPickler`)."""
    import torch

    want = getattr(torch, dtype)
    if not data:
        return torch.empty(shape, dtype=want)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(want).reshape(shape)


def _dtensor_of(local: Any, mesh: Any, placements: tuple, shape: tuple, stride: tuple) -> Any:
    """A DTensor rebuilt around its local shard (:class:`_JobPickler`)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


class _JobPickler(ForkingPickler):
    """The staged state's tensors travel as handles to the shared memory they are in. A DTensor travels as its local
    shard, mesh and placements (torch's own reduction of a second DTensor of one mesh shared the wrapper's storage,
    which has no memory: a segfault). A plain tensor in host memory that is not shared (a DeviceMesh's small mesh
    tensor, a planner's) travels by value: sharing it would move its storage into shared memory in place."""

    def reducer_override(self, obj: Any) -> Any:
        import torch

        if is_dtensor(obj):
            return _dtensor_of, (local_tensor(obj), obj.device_mesh, tuple(obj.placements), tuple(obj.shape),
                                 tuple(obj.stride()))
        if (type(obj) is torch.Tensor and obj.device.type == "cpu" and obj.layout == torch.strided
                and not obj.is_shared() and not obj.requires_grad):
            flat = obj.detach().contiguous().reshape(-1)
            data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
            return _tensor_of, (data, str(obj.dtype).removeprefix("torch."), tuple(obj.shape))
        return NotImplemented


def packed_job(staged: Any, storage_writer: Any, planner: Any, fill: Optional[tuple] = None) -> bytes:
    """A save for the writer process, pickled once the ranks agreed to it (:func:`check_picklable` came before):
    its staged tensors as handles to the shared memory they are staged into (:class:`_JobPickler`). ``fill``: (the
    counter of :mod:`distckpt.engine.filling`, the buffers in the order they are filled) while the training process
    still copies into them; None once they are full."""
    import torch.multiprocessing  # noqa: F401 - registers the reductions that send tensors as shared-memory handles

    try:
        buf = io.BytesIO()
        with warnings.catch_warnings():  # the mesh is rebuilt in the writer, which makes no compiled graphs
            warnings.filterwarnings("ignore", message=".*pickling/unpickling of the DeviceMesh.*")
            _JobPickler(buf, pickle.HIGHEST_PROTOCOL).dump((staged, storage_writer, planner, fill))
        return buf.getvalue()
    except Exception as exc:  # noqa: BLE001 - what does not pickle: a user's writer, planner or value
        raise CheckpointError(f"async_save with PROCESS cannot hand this save to its writer process ({type(exc).__name__}: "
                              f"{exc}): the storage writer, the planner and every value of the state must be picklable. "
                              "Pass async_checkpointer_type=THREAD to write from a thread of this process") from exc


def check_picklable(staged: Any, storage_writer: Any, planner: Any) -> None:
    """Raise CheckpointError unless what :func:`packed_job` will pickle can be: checked without sharing any memory
    (tensors stand in as ids), so that a save the ranks do not all agree to leaves nothing shared behind."""
    import torch

    class _Dry(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Optional[str]:
            return "tensor" if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)) else None

    try:
        _Dry(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL).dump((staged, storage_writer, planner))
    except Exception as exc:  # noqa: BLE001 - what does not pickle: a user's writer, planner or value
        raise CheckpointError(f"async_save with PROCESS cannot hand this save to its writer process ({type(exc).__name__}: "
                              f"{exc}): the storage writer, the planner and every value of the state must be picklable. "
                              "Pass async_checkpointer_type=THREAD to write from a thread of this process") from exc


def _unpack(payload: bytes) -> tuple:
    """A job as the writer rebuilds it: ((state, storage writer, planner) or None, the error of a rebuild that
    failed or None)."""
    try:
        unpacked = ForkingPickler.loads(payload)
    except Exception as exc:  # noqa: BLE001 - told to every rank's writer by the vote that follows
        error = CheckpointError(
            f"the writer process could not rebuild the save it was handed ({type(exc).__name__}: {exc}): a value whose "
            "class is defined in the training script's main block, or that pickles but cannot be rebuilt elsewhere, "
            "cannot travel to a writer process. Define the class in a module, or pass async_checkpointer_type=THREAD")
        return None, error
    return unpacked, None


def _packed(exc: BaseException) -> tuple:
    """An exception of the writer, for its training process: pickled where it can be (the two are one program's
    processes, over a private pipe), else described."""
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
        return ("pickle", data)
    except Exception:  # noqa: BLE001 - an exception whose arguments do not pickle
        return ("described", describe(exc))


def _error(packed: Any, default: type) -> BaseException:
    kind, body = packed
    if kind == "pickle":
        try:
            exc = pickle.loads(body)
            if isinstance(exc, BaseException):
                return exc
        except Exception:  # noqa: BLE001
            pass
    elif kind == "described":
        return rebuild(body).exception
    return default(str(body))


# ---- the writer's side


def _main(conn: Any, rank: int, world_size: int, meeting: Optional[dict], timeout_s: float, nice: int) -> None:
    if nice:
        try:
            os.nice(nice)
        except OSError:
            pass
    spec = os.environ.get("DISTCKPT_WRITER_FAULT")  # crash tests: a fault in the writer, not its training process
    if spec:
        faults.configure(faults.from_spec(spec))
    warnings.filterwarnings("ignore", message=".*pickling/unpickling of the DeviceMesh.*")
    try:
        import torch.multiprocessing  # noqa: F401 - the reductions that receive tensors as shared-memory handles

        if meeting is None:  # a group of one: nothing to join
            conn.send(("ready",))
            return _serve(conn, meeting)
        timeout = timedelta(seconds=timeout_s)
        store = dist.PrefixStore(meeting["prefix"], dist.TCPStore(meeting["host"], meeting["port"], is_master=False,
                                                                   timeout=timeout))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    except BaseException as exc:  # noqa: BLE001 - told to the training process
        conn.send(("start-failed", _packed(exc)))
        return
    conn.send(("ready",))
    _serve(conn, meeting)


def _serve(conn: Any, meeting: Optional[dict]) -> None:
    _kept = None  # the last save's staged state: its shared memory stays mapped, so the next save (the same arenas,
    while True:  # reused) finds it in torch's cache of shared storages instead of mapping and faulting it in again
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        if job == "release":  # release_buffers(): the staging memory goes once no process maps it
            _kept = None
            continue
        ticket, number, coordinator_rank, checkpoint_id, payload = job
        coord = Coordinator(None, 0, no_dist=meeting is None)
        metadata, info, staged, planner, storage_writer, unpacked, fill = None, None, None, None, None, None, None
        phases: list = []
        try:
            unpacked, rebuilt = _unpack(payload)
            coord = Coordinator(None, coordinator_rank, no_dist=meeting is None)
            coord.begin("async save", checkpoint_id, number=number)
            # every rank's writer says whether it could rebuild its save, before any writes: one that could not
            # fails the save on every rank at once, as the ranks' own agreement does for what fails before the call
            coord.vote("async save (rebuilt in the writer process)", rebuilt, False)
            staged, storage_writer, planner, fill = unpacked
            tell_rank(planner, coord.rank)
            if fill is not None:  # the write starts on the buffers already filled while the training process
                storage_writer.staging_fill = Filling(fill[0], fill[1], knobs.collective_timeout_s())  # copies the rest
            with events.observe(phases.append):  # sent back with the outcome, for the training process's observers
                metadata = run_save(staged, storage_writer, planner, coord)
        except BaseException as exc:  # noqa: BLE001 - delivered on the training process's handle
            info = _packed(exc)
        # the planner and the storage writer hold the state too (a planner keeps the state dict it planned)
        _kept, staged, planner, storage_writer, unpacked, fill = staged, None, None, None, None, None
        try:
            conn.send(("done", ticket, metadata, info, coord.transport_failed, phases))
        except (OSError, EOFError):
            return
        except Exception:  # noqa: BLE001 - metadata that does not pickle: the commit is told without it
            conn.send(("done", ticket, None, info, coord.transport_failed, phases))


def _entry(argv: list[str]) -> None:
    config = json.loads(argv[0])
    mp.current_process().authkey = bytes.fromhex(config["authkey"])
    conn = mp.connection.Connection(config["fd"])
    _main(conn, config["rank"], config["world_size"], config["meeting"], config["timeout_s"], config["nice"])


if __name__ == "__main__":
    _entry(sys.argv[1:])
