"""One node's agent of a :class:`distckpt.testing.cluster.Cluster` job: torchrun's own launcher (its options, its
static rendezvous across the nodes), with the ranks forked from this process once it has imported torch, DTensor,
distckpt's save and load paths and the job's module, rather than started as fresh interpreters that each import
them again (the larger part of a job's CPU time on a small machine)::

    python -m distckpt.testing.cluster_launch <torchrun options> -- module:function '<json kwargs>' <results dir>

Each rank then runs :func:`distckpt.testing.cluster_worker.main`, as under ``torchrun -m``.
"""

from __future__ import annotations

import importlib
import sys

import torch  # noqa: F401 - imported once here, by the ranks' parent
import torch.distributed.tensor  # noqa: F401
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, get_args_parser

import distckpt.loading  # noqa: F401
import distckpt.saving  # noqa: F401

from . import cluster_worker


def main(argv: list[str]) -> None:
    split = argv.index("--")
    options, job = argv[:split], argv[split + 1:]
    importlib.import_module(job[0].split(":")[0])
    args = get_args_parser().parse_args([*options, "--start-method=fork", "cluster-job"])
    config, _, _ = config_from_args(args)
    elastic_launch(config, cluster_worker.main)(job)


if __name__ == "__main__":
    main(sys.argv[1:])
