"""A load whose state dict holds some of the checkpoint's keys reads those keys' chunks and nothing more (issue 48,
item 3): the bytes distckpt's file readers return, counted, are the chunks' bytes plus the small parts every load
reads (the header of each data file it opens, and the metadata), at 1 process and at 2 gloo ranks."""

import os
import struct

import pytest
import torch

import distckpt
from distckpt.metadata import MetadataIndex
from distckpt.testing import run_ranks
from distckpt.testing.read_counts import FileReads

KEYS = 160
WANTED = ["layer3.w", "layer50.w", "layer51.w", "layer120.w", "layer159.w"]


def _state(rows_per_rank: int = 1) -> dict:
    """160 tensors of 8-64 KiB (about 6 MiB): rows of 256 float32, ``rows_per_rank`` times as many rows."""
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.w": torch.randn(int(torch.randint(8, 64, (1,), generator=g)) * rows_per_rank, 256, generator=g)
            for i in range(KEYS)}


def _header_bytes(path: str, name: str) -> int:
    """The part of a data file before its data: the 8-byte length and the header it gives (padding included)."""
    with open(os.path.join(path, name), "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def _allowed(path: str, chunks: list) -> tuple[int, int]:
    """The stored bytes of ``chunks`` (MetadataIndex), and those plus the headers of the files they lie in and the
    metadata file."""
    md = distckpt.read_metadata(path)
    infos = [md.storage_data.items[c] for c in chunks]
    data = sum(i.length for i in infos)
    headers = sum(_header_bytes(path, name) for name in {i.file for i in infos})
    return data, data + headers + os.path.getsize(os.path.join(path, "metadata.json"))


def _saved(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("DISTCKPT_MIN_FILE_BYTES", str(1 << 20))  # several data files, as a larger state has
    path = str(tmp_path / "ck")
    distckpt.save(_state(), checkpoint_id=path)
    assert len([n for n in os.listdir(path) if n.endswith(".safetensors")]) > 1
    return path


def test_a_subset_load_in_one_process_reads_only_its_chunks(tmp_path, monkeypatch):
    path = _saved(tmp_path, monkeypatch)
    full = _state()
    out = {k: torch.zeros_like(full[k]) for k in WANTED}
    counter = FileReads()
    distckpt.load(out, checkpoint_id=path, no_dist=True)
    read = counter.total  # before _allowed reads the metadata again
    assert all(torch.equal(out[k], full[k]) for k in WANTED)
    data, allowed = _allowed(path, [MetadataIndex(k, (0, 0)) for k in WANTED])
    assert data <= read <= allowed, (read, data, allowed)
    assert allowed < sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)) / 20


def _save_sharded(rank, world_size, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    distckpt.save({k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _state(world_size).items()}, checkpoint_id=path)


def _load_subset(rank, world_size, path, sharded):
    """Load the WANTED keys (as DTensors sharded like the save, or as plain replicas); the bytes read, and the chunks
    this rank's part lies in."""
    full = _state(world_size if sharded else 1)
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world_size,))
        out = {k: distribute_tensor(torch.zeros_like(full[k]), mesh, [Shard(0)]) for k in WANTED}
        counter = FileReads()  # what the load reads, after the destinations are made
        distckpt.load(out, checkpoint_id=path)
        ok = all(torch.equal(out[k].full_tensor(), full[k]) for k in WANTED)
        chunks = [(k, [rank * full[k].shape[0] // world_size, 0]) for k in WANTED]
    else:
        out = {k: torch.zeros_like(full[k]) for k in WANTED}
        counter = FileReads()
        distckpt.load(out, checkpoint_id=path)
        ok = all(torch.equal(out[k], full[k]) for k in WANTED)
        chunks = [(k, [0, 0]) for k in WANTED]
    return {"ok": ok, "read": counter.total, "chunks": chunks}


def test_a_subset_load_of_sharded_state_at_2_ranks_reads_only_each_ranks_chunks(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTCKPT_MIN_FILE_BYTES", str(1 << 20))
    path = str(tmp_path / "ck")
    run_ranks(_save_sharded, 2, path)
    for result in run_ranks(_load_subset, 2, path, True):
        assert result["ok"]
        data, allowed = _allowed(path, [MetadataIndex(k, tuple(o)) for k, o in result["chunks"]])
        assert data <= result["read"] <= allowed, (result, data, allowed)


@pytest.mark.parametrize("shared", ["1", "0"])
def test_a_subset_load_of_replicated_state_at_2_ranks_reads_only_its_chunks(tmp_path, monkeypatch, shared):
    """Every rank needs every chunk: with shared reads one rank reads each and sends it (the two together read
    the chunks once); without, each reads them all. Either way nothing of the other keys is read."""
    monkeypatch.setenv("DISTCKPT_SHARED_READS", shared)
    path = _saved(tmp_path, monkeypatch)
    results = run_ranks(_load_subset, 2, path, False)
    assert all(r["ok"] for r in results)
    data, allowed = _allowed(path, [MetadataIndex(k, (0, 0)) for k in WANTED])
    if shared == "1":
        assert data <= sum(r["read"] for r in results) <= allowed + (allowed - data), results  # headers on each rank
    else:
        assert all(data <= r["read"] <= allowed for r in results), (results, data, allowed)
