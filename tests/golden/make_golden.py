"""Write the golden checkpoints of the current format version into tests/golden/v<version>/.

Run once per released format version: python tests/golden/make_golden.py
Existing directories are never overwritten.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import distckpt  # noqa: E402
from distckpt.format import FORMAT_VERSION_STR  # noqa: E402
from distckpt.testing import run_ranks  # noqa: E402
from tests.golden.expected import plain_state, sharded_full  # noqa: E402


def save_sharded(rank, world_size, path):
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
    distckpt.save(sd, checkpoint_id=path)


def main():
    os.environ.setdefault("DISTCKPT_FSYNC", "0")
    root = os.path.join(HERE, f"v{FORMAT_VERSION_STR}")
    os.makedirs(root, exist_ok=True)
    plain = os.path.join(root, "plain")
    if not os.path.exists(plain):
        distckpt.save(plain_state(), checkpoint_id=plain)
    sharded = os.path.join(root, "sharded-2ranks")
    if not os.path.exists(sharded):
        run_ranks(save_sharded, 2, sharded)
    print(f"golden checkpoints in {root}")


if __name__ == "__main__":
    main()
