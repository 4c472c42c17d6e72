"""Write the golden checkpoints of the current format versions into tests/golden/v<version>/.

Run once per released format version: python tests/golden/make_golden.py
Existing directories are never overwritten. 3.0 is what a save writes by
default; 2.1 is written when every tensor goes through a chunk codec, so its
golden checkpoints are saved through ZStandard. (2.0, a save with neither a
table of whole tensors nor a codec, was written by earlier releases.) 4.0's
``compressed`` is saved with compression="zstd"; ``run`` is a run of incremental saves (keep_last=1) whose
newest step references files of retired ones.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import distckpt  # noqa: E402
from distckpt.format import CODEC_FORMAT_VERSION_STR, FORMAT_VERSION_STR  # noqa: E402
from distckpt.testing import run_ranks  # noqa: E402
from tests.golden.expected import compressed_state, plain_state, run_state, sharded_full  # noqa: E402


def _writer(path, compressed):
    return distckpt.FileSystemWriter(path, _extensions=[distckpt.ZStandard()] if compressed else None)


def save_sharded(rank, world_size, path, compressed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = sharded_full()
    sd = {
        "row": distribute_tensor(full["row"], mesh, [Shard(0)]),
        "col": distribute_tensor(full["col"], mesh, [Shard(1)]),
        "rep": distribute_tensor(full["rep"], mesh, [Replicate()]),
        "step": 7,
    }
    distckpt.save(sd, storage_writer=_writer(path, compressed))


def main():
    os.environ.setdefault("DISTCKPT_FSYNC", "0")
    for version, compressed in ((FORMAT_VERSION_STR, False), (CODEC_FORMAT_VERSION_STR, True)):
        root = os.path.join(HERE, f"v{version}")
        os.makedirs(root, exist_ok=True)
        plain = os.path.join(root, "plain")
        if not os.path.exists(plain):
            distckpt.save(plain_state(), storage_writer=_writer(plain, compressed))
        sharded = os.path.join(root, "sharded-2ranks")
        if not os.path.exists(sharded):
            run_ranks(save_sharded, 2, sharded, compressed)
        for path in (plain, sharded):
            with open(os.path.join(path, "metadata.json"), "rb") as f:
                assert json.loads(f.read())["format_version"] == version, path
        print(f"golden checkpoints in {root}")
    compressed = os.path.join(HERE, "v4.0", "compressed")  # byte-grouped zstd chunks (docs/format.md, 3.5)
    if not os.path.exists(compressed):
        os.makedirs(os.path.dirname(compressed), exist_ok=True)
        distckpt.save(compressed_state(), storage_writer=distckpt.FileSystemWriter(compressed, compression="zstd"))
    with open(os.path.join(compressed, "metadata.json"), "rb") as f:
        assert json.loads(f.read())["format_version"] == "4.0", compressed
    print(f"golden checkpoint in {compressed}")
    run = os.path.join(HERE, "v4.0", "run")  # incremental saves referencing earlier steps, one of them retired
    if not os.path.exists(run):
        mgr = distckpt.CheckpointManager(run, keep_last=1, incremental=True, no_dist=True)
        for step in (1, 2, 3):
            mgr.save(step, run_state(step))
    print(f"golden run in {run}")


if __name__ == "__main__":
    main()
