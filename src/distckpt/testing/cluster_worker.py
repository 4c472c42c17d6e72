"""A rank of a :class:`distckpt.testing.cluster.Cluster` job: ``python -m distckpt.testing.cluster_worker
module:function '<json kwargs>' <results dir>``, started by torchrun on each node."""

from __future__ import annotations

import importlib
import json
import os
import sys
from datetime import timedelta


def main(argv: list[str]) -> None:
    target, kwargs, results = argv[0], json.loads(argv[1]), argv[2]
    os.environ["DISTCKPT_CLUSTER_RESULTS"] = results
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    module, name = target.split(":")
    fn = getattr(importlib.import_module(module), name)
    dist.init_process_group("gloo", timeout=timedelta(seconds=float(os.environ.get("DISTCKPT_CLUSTER_TIMEOUT_S", "60"))))
    rank, world = dist.get_rank(), dist.get_world_size()
    value = fn(rank, world, **kwargs)
    tmp = os.path.join(results, f".rank-{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, os.path.join(results, f"rank-{rank}.json"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
