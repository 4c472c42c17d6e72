"""The ranks of bench/object_stores.py: each saves and loads its part of the state on gs://, through distckpt, DCP
(fsspec's gcsfs) and the raw client, and reports the slowest rank's seconds of each round."""

from __future__ import annotations

import io
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist


def _state(rank: int, total: int, tensors: int) -> dict:
    n = total // 2 // tensors // 4  # float32 elements per tensor: the ranks hold half of ``total`` each at 2 ranks
    g = torch.Generator().manual_seed(rank)
    return {f"rank{rank}.layer{i}": torch.randn(n, generator=g) for i in range(tensors)}


def _slowest(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def _raw(bucket: str, prefix: str, sd: dict, threads: int, write: bool) -> None:
    """The floor: this rank's tensor bytes as objects, ``threads`` at a time (distckpt's write streams), each uploaded
    or downloaded whole through the client, with no format, checksum or metadata."""
    from google.cloud import storage

    client = storage.Client()
    b = client.bucket(bucket)
    names = sorted(sd)

    def one(name: str) -> None:
        blob = b.blob(f"{prefix}/{name}")
        if write:
            blob.upload_from_file(io.BytesIO(memoryview(sd[name].numpy()).cast("B")), size=sd[name].nbytes)
        else:
            data = blob.download_as_bytes()
            sd[name].view(torch.uint8).view(-1).numpy()[:] = memoryview(data).cast("B")

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, names))


def _drop(bucket: str, prefix: str) -> None:
    """Delete what a round wrote: the emulator keeps every object in its memory."""
    from google.cloud import storage

    client = storage.Client()
    for blob in client.list_blobs(bucket, prefix=prefix + "/"):
        blob.delete()


def rounds(rank: int, world: int, bucket: str, total: int, tensors: int, repeat: int, peers: list) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    import distckpt
    from distckpt import knobs

    sd = _state(rank, total, tensors)
    out = {peer: {"save": [], "load": []} for peer in peers}
    for r in range(-1, repeat):  # round -1 warms each peer (its clients, connections, imports) and is not kept
        order = peers if r % 2 == 0 else list(reversed(peers))
        for peer in order:
            where = f"gs://{bucket}/{peer}-{r + 1}"
            back = {k: torch.empty_like(v) for k, v in sd.items()}
            if peer == "distckpt":
                save = lambda: distckpt.save(sd, checkpoint_id=where)  # noqa: E731
                load = lambda: distckpt.load(back, checkpoint_id=where)  # noqa: E731
            elif peer == "dcp":
                save = lambda: dcp.save(sd, storage_writer=FsspecWriter(where, token="anon"))  # noqa: E731
                load = lambda: dcp.load(back, storage_reader=FsspecReader(where, token="anon"))  # noqa: E731
            else:
                save = lambda: _raw(bucket, f"{peer}-{r + 1}/{rank}", sd, knobs.object_write_streams(), True)  # noqa: E731
                load = lambda: _raw(bucket, f"{peer}-{r + 1}/{rank}", back, knobs.object_write_streams(), False)  # noqa: E731
            took = _slowest(save), _slowest(load)
            if r >= 0:
                out[peer]["save"].append(took[0])
                out[peer]["load"].append(took[1])
            if not all(torch.equal(back[k], sd[k]) for k in sd):
                raise AssertionError(f"{peer}: the load did not give back what was saved")
            dist.barrier()
            if rank == 0:
                _drop(bucket, f"{peer}-{r + 1}")
            dist.barrier()
    return out
