"""Rank functions for test_load_votes_and_write_paths_hostile.py: loads whose ranks disagree, and DTensor shards loaded as saved."""

from __future__ import annotations

import os
import time

import torch

import distckpt


def _attempt(fn) -> dict:
    """Run ``fn``; what it raised (type, text, seconds taken), or ok."""
    start = time.monotonic()
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        return {"ok": False, "type": type(exc).__name__, "checkpoint_error": isinstance(exc, distckpt.CheckpointError),
                "msg": str(exc), "s": time.monotonic() - start}
    return {"ok": True, "s": time.monotonic() - start}


def _mesh(shape=None):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape or (dist.get_world_size(),))


def _full(rows=12, cols=256, dtype=torch.float32):
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols).to(dtype)


def _rows(fill=True, rows=12, cols=256, dtype=torch.float32, placements=None, mesh=None):
    from torch.distributed.tensor import Shard, distribute_tensor

    full = _full(rows, cols, dtype) if fill else torch.zeros(rows, cols, dtype=dtype)
    return distribute_tensor(full, mesh or _mesh(), placements or [Shard(0)])


def flip_chunk_byte(path: str, fqn: str, offsets: tuple) -> str:
    """Flip one byte inside the stored chunk of ``fqn`` at ``offsets``; its file name."""
    md = distckpt.read_metadata(path)
    for index, info in md.storage_data.items.items():
        if index.fqn == fqn and tuple(index.offset) == tuple(offsets):
            with open(os.path.join(path, info.file), "r+b") as f:
                f.seek(info.offset + info.length // 2)
                b = f.read(1)
                f.seek(info.offset + info.length // 2)
                f.write(bytes([b[0] ^ 0xFF]))
            return info.file
    raise AssertionError(f"no chunk {fqn} {offsets}")


def _in_step_again(path: str) -> bool:
    """A save and a load on the same group, in step, after a failed operation: do they work?"""
    distckpt.save({"w": _rows(True)}, checkpoint_id=path)
    sd = {"w": _rows(False)}
    distckpt.load(sd, checkpoint_id=path)
    return bool(torch.equal(sd["w"].full_tensor(), _full()))


# ------------------------------------------------------------------ collectives of a load


def load_out_of_step_with_save(rank: int, world_size: int, path: str):
    """Rank 0 loads while rank 1 saves (it skipped the load): each must raise a typed error within the
    collective timeout, and a following save and load in step must work."""
    distckpt.save({"w": _rows(True)}, checkpoint_id=path)
    if rank == 0:
        got = _attempt(lambda: distckpt.load({"w": _rows(False)}, checkpoint_id=path))
    else:
        got = _attempt(lambda: distckpt.save({"w": _rows(True)}, checkpoint_id=path + "-other"))
    again = _attempt(lambda: _in_step_again(path + "-again"))
    return {"first": got, "again": again}


def load_with_one_rank_failing_to_plan(rank: int, world_size: int, path: str, how: str):
    """One rank's local plan fails (a key missing only there, or a shape only it has wrong): every rank raises
    naming that rank and key; the next load on the group works."""
    distckpt.save({"w": _rows(True), "b": torch.ones(4)}, checkpoint_id=path)
    sd = {"w": _rows(False), "b": torch.zeros(4)}
    if rank == 1 and how == "missing":
        sd["only_on_rank1"] = torch.zeros(3)
    if rank == 1 and how == "shape":
        sd["b"] = torch.zeros(5)
    got = _attempt(lambda: distckpt.load(sd, checkpoint_id=path))
    sd2 = {"w": _rows(False), "b": torch.zeros(4)}
    again = _attempt(lambda: distckpt.load(sd2, checkpoint_id=path))
    return {"first": got, "again": again, "right": bool(torch.equal(sd2["w"].full_tensor(), _full()))}


def load_with_corrupt_chunk_one_rank_reads(rank: int, world_size: int, path: str):
    """Rank 1's shard (a column item: loaded as saved) has a flipped byte: every rank raises naming the file; rank 1's
    shard is zeroed (never left holding damaged bytes), rank 0's holds the checkpoint's."""
    distckpt.save({"w": _rows(True)}, checkpoint_id=path)
    import torch.distributed as dist

    name = None
    if rank == 0:
        name = flip_chunk_byte(path, "w", (6, 0))
    names = [name]
    dist.broadcast_object_list(names, src=0)
    sd = {"w": _rows(False)}
    sd["w"].to_local().fill_(7.0)
    got = _attempt(lambda: distckpt.load(sd, checkpoint_id=path))
    local = sd["w"].to_local()
    again = _attempt(lambda: _in_step_again(path + "-again"))
    return {"first": got, "file": names[0], "zeroed": bool((local == 0).all()),
            "right": bool(torch.equal(local, _full()[rank * 6:(rank + 1) * 6])), "again": again}


class _RemovesAFile(distckpt.DefaultLoadPlanner):
    """On rank 1, between planning and reading, moves the data file this rank reads away."""

    def __init__(self, path: str, rank: int):
        super().__init__()
        self.path, self.rank = path, rank

    def finish_plan(self, central_plan):
        if self.rank == 1:
            md = distckpt.read_metadata(self.path)
            for index, info in md.storage_data.items.items():
                if index.fqn == "w" and tuple(index.offset) == (6, 0):
                    os.rename(os.path.join(self.path, info.file), os.path.join(self.path, info.file + ".gone"))
        return super().finish_plan(central_plan)


def load_with_file_removed_after_planning(rank: int, world_size: int, path: str):
    distckpt.save({"w": _rows(True)}, checkpoint_id=path)
    got = _attempt(lambda: distckpt.load({"w": _rows(False)}, checkpoint_id=path, planner=_RemovesAFile(path, rank)))
    again = _attempt(lambda: _in_step_again(path + "-again"))
    return {"first": got, "again": again}


class _Stalls(distckpt.DefaultLoadPlanner):
    def __init__(self, rank: int, seconds: float):
        super().__init__()
        self.rank, self.seconds = rank, seconds

    def finish_plan(self, central_plan):
        if self.rank == 1:
            time.sleep(self.seconds)
        return super().finish_plan(central_plan)


def load_with_a_rank_that_stalls(rank: int, world_size: int, path: str, seconds: float):
    """Rank 1 stalls between planning and reading past the collective timeout: rank 0 raises within about it."""
    distckpt.save({"w": _rows(True)}, checkpoint_id=path)
    return _attempt(lambda: distckpt.load({"w": _rows(False)}, checkpoint_id=path, planner=_Stalls(rank, seconds)))


def load_on_subgroup_with_coordinator_one(rank: int, world_size: int, path: str):
    """A group made with new_gloo_group, coordinator_rank=1, rank 0 failing to plan: every rank raises naming it;
    then a load on the group works."""
    from distckpt.distributed import new_gloo_group

    group = new_gloo_group([0, 1])
    sd = {"x": torch.arange(10.0) + rank}
    distckpt.save(sd, checkpoint_id=path, process_group=group, coordinator_rank=1)
    bad = {"x": torch.zeros(10)} if rank == 1 else {"x": torch.zeros(10), "nope": torch.zeros(2)}
    got = _attempt(lambda: distckpt.load(bad, checkpoint_id=path, process_group=group, coordinator_rank=1))
    good = {"x": torch.zeros(10)}
    again = _attempt(lambda: distckpt.load(good, checkpoint_id=path, process_group=group, coordinator_rank=1))
    return {"first": got, "again": again, "value": good["x"].tolist()}


def load_where_ranks_disagree_on_partial_reads(rank: int, world_size: int, path: str):
    """Rank 0 loads its rows as saved (one whole chunk, no partial read), rank 1 columns (both chunks read partly):
    only rank 1 flags partial reads in the vote. Bytes must be right on every rank."""
    from torch.distributed.tensor import DTensor, Shard

    distckpt.save({"w": _rows(True)}, checkpoint_id=path)
    if rank == 0:
        dest = DTensor.from_local(torch.zeros(6, 256), _mesh(), [Shard(0)], run_check=False, shape=torch.Size([12, 256]),
                                  stride=(256, 1))
        want = _full()[:6]
    else:
        dest = DTensor.from_local(torch.zeros(12, 128), _mesh(), [Shard(1)], run_check=False, shape=torch.Size([12, 256]),
                                  stride=(256, 1))
        want = _full()[:, 128:]
    got = _attempt(lambda: distckpt.load({"w": dest}, checkpoint_id=path))
    return {"first": got, "right": bool(torch.equal(dest.to_local(), want))}


def load_no_dist_on_one_rank(rank: int, world_size: int, path: str):
    """no_dist=True in a live group, a key missing: a typed error, at once, on this rank alone."""
    if rank == 0:
        distckpt.save({"x": torch.arange(4.0)}, checkpoint_id=path, no_dist=True)
        got = _attempt(lambda: distckpt.load({"x": torch.zeros(4), "y": torch.zeros(1)}, checkpoint_id=path, no_dist=True))
        sd = {"x": torch.zeros(4)}
        again = _attempt(lambda: distckpt.load(sd, checkpoint_id=path, no_dist=True))
        return {"first": got, "again": again, "value": sd["x"].tolist()}
    return None


# ------------------------------------------------------------------ DTensor shards loaded as saved


def dtensor_round_trips(rank: int, world_size: int, path: str):
    """Save and load at the same sharding, for shardings that make column items: what came back right."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    out = {}
    mesh2 = _mesh((1, 2))

    def case(name, make_saved, make_dest, want, planner=None):
        p = os.path.join(path, name)
        distckpt.save({"t": make_saved()}, checkpoint_id=p)
        dest = make_dest()
        got = _attempt(lambda: distckpt.load({"t": dest}, checkpoint_id=p, planner=planner))
        value = dest.full_tensor() if isinstance(dest, DTensor) else dest
        out[name] = {"load": got, "right": bool(got["ok"] and torch.equal(value, want))}

    case("uneven", lambda: _rows(True, rows=5, cols=3), lambda: _rows(False, rows=5, cols=3), _full(5, 3))
    case("uneven_cols", lambda: _rows(True, rows=3, cols=5, placements=[Shard(1)]),
         lambda: _rows(False, rows=3, cols=5, placements=[Shard(1)]), _full(3, 5))
    case("one_row_two_ranks", lambda: _rows(True, rows=1, cols=4), lambda: _rows(False, rows=1, cols=4), _full(1, 4))
    case("dtype", lambda: _rows(True), lambda: _rows(False, dtype=torch.bfloat16), _full().to(torch.bfloat16),
         planner=distckpt.DefaultLoadPlanner(allow_dtype_conversion=True))
    case("dtype_f64", lambda: _rows(True), lambda: _rows(False, dtype=torch.float64), _full().to(torch.float64),
         planner=distckpt.DefaultLoadPlanner(allow_dtype_conversion=True))
    case("replicate", lambda: _rows(True, placements=[Replicate()]), lambda: _rows(False, placements=[Replicate()]), _full())
    case("mesh2d", lambda: _rows(True, mesh=mesh2, placements=[Shard(0), Shard(1)]),
         lambda: _rows(False, mesh=mesh2, placements=[Shard(0), Shard(1)]), _full())
    case("mesh2d_rep", lambda: _rows(True, mesh=mesh2, placements=[Replicate(), Shard(0)]),
         lambda: _rows(False, mesh=mesh2, placements=[Replicate(), Shard(0)]), _full())

    def noncontig():  # the local shard is a transposed view: not contiguous
        local = torch.zeros(256, 6).t()
        return DTensor.from_local(local, _mesh(), [Shard(0)], run_check=False, shape=torch.Size([12, 256]),
                                  stride=(256, 1))

    case("noncontig", lambda: _rows(True), noncontig, _full())

    def offset_view():  # the local shard is a view into a larger buffer, at a storage offset
        buf = torch.zeros(7 * 256)
        local = buf[256:].view(6, 256)
        return DTensor.from_local(local, _mesh(), [Shard(0)], run_check=False, shape=torch.Size([12, 256]),
                                  stride=(256, 1))

    case("offset_view", lambda: _rows(True), offset_view, _full())
    # saved whole (one chunk at offsets 0 of another size), loaded as row shards: rank 0's piece starts where the chunk
    # does but is smaller
    p = os.path.join(path, "whole_then_rows")
    distckpt.save({"t": _full()}, checkpoint_id=p)
    dest = _rows(False)
    got = _attempt(lambda: distckpt.load({"t": dest}, checkpoint_id=p))
    out["whole_then_rows"] = {"load": got, "right": bool(got["ok"] and torch.equal(dest.full_tensor(), _full()))}
    return out


def dtensor_corrupt_chunk_with_conversion(rank: int, world_size: int, path: str):
    """A flipped byte in rank 0's shard, loaded as saved into bfloat16 (conversion: the general path) and float32
    (the column path): typed errors naming the file on every rank, and rank 0's shard zeroed each time."""
    import torch.distributed as dist

    distckpt.save({"w": _rows(True)}, checkpoint_id=path)
    name = [flip_chunk_byte(path, "w", (0, 0)) if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    out = {"file": name[0]}
    for label, dtype in (("same", torch.float32), ("convert", torch.bfloat16)):
        dest = _rows(False, dtype=dtype)
        dest.to_local().fill_(3)
        got = _attempt(lambda: distckpt.load({"w": dest}, checkpoint_id=path,
                                             planner=distckpt.DefaultLoadPlanner(allow_dtype_conversion=True)))
        local = dest.to_local()
        out[label] = {"load": got, "zeroed": bool((local == 0).all()), "untouched_or_right": bool(
            (local == 3).all() or torch.equal(local, _full(dtype=dtype)[rank * 6:(rank + 1) * 6]))}
    return out
