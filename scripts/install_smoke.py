"""What a user gets from ``pip install distckpt`` with no extras, checked in the virtualenv it was installed into.

Run by scripts/wheel_check.sh with that virtualenv's Python, from outside the checkout (so the installed package,
not ``src/``, is what imports). Exits non-zero, naming the check, on the first thing that does not work:

- no optional dependency is installed (the run proves nothing otherwise);
- save and load at 1 rank, bit-exact, plain and compressed (``compression="zstd"``);
- a 2-rank sharded save (DTensor, ``Shard(0)``) loaded at 2 ranks as ``Shard(1)`` and at 1 rank whole;
- a Hugging Face directory written and read back;
- the console script: ``distckpt --help``, ``inspect``, ``verify``;
- each optional feature, without its extra, raises MissingDependencyError naming the extra to install.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

import torch

EXTRAS = {  # the module an extra installs -> the extra's name (pyproject.toml)
    "boto3": "s3",
    "google.cloud.storage": "gcs",
    "azure.storage.blob": "azure",
    "lightning": "lightning",
    "torchtitan": "torchtitan",
    "torch_checkpointing": "torch-checkpointing",
    "accelerate": "accelerate",
    "prometheus_client": "metrics",
    "opentelemetry": "tracing",
}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is not there either
        return False


def check(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"install smoke: FAILED: {what}")
    print(f"install smoke: ok: {what}", flush=True)


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.arange(10, dtype=torch.bfloat16), "step": 7, "name": "run"}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def single_rank(root: str) -> None:
    import distckpt

    for compression in (None, "zstd"):
        path = os.path.join(root, f"one-{compression}")
        writer = distckpt.FileSystemWriter(path, compression=compression) if compression else None
        distckpt.save(state(), checkpoint_id=path, storage_writer=writer, no_dist=True)
        back = {"w": torch.zeros(64, 32), "b": torch.zeros(10, dtype=torch.bfloat16), "step": 0, "name": ""}
        distckpt.load(back, checkpoint_id=path, no_dist=True)
        check(same(back, state()), f"save and load at 1 rank, bit-exact (compression={compression})")


def save_sharded(rank: int, world_size: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import distckpt

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(48 * 6, dtype=torch.float32).reshape(48, 6)
    distckpt.save({"t": distribute_tensor(full, mesh, [Shard(0)])}, checkpoint_id=path)


def load_resharded(rank: int, world_size: int, path: str) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import distckpt

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(48 * 6, dtype=torch.float32).reshape(48, 6)
    target = {"t": distribute_tensor(torch.zeros(48, 6), mesh, [Shard(1)])}
    distckpt.load(target, checkpoint_id=path)
    return bool(torch.equal(target["t"].to_local(), distribute_tensor(full, mesh, [Shard(1)]).to_local()))


def two_ranks(root: str) -> None:
    import distckpt
    from distckpt.testing.multiprocess import run_ranks

    path = os.path.join(root, "sharded")
    run_ranks(save_sharded, 2, path, timeout_s=300)
    check(all(run_ranks(load_resharded, 2, path, timeout_s=300)), "2-rank Shard(0) save loaded at 2 ranks as Shard(1)")
    whole = {"t": torch.zeros(48, 6)}
    distckpt.load(whole, checkpoint_id=path, no_dist=True)
    check(torch.equal(whole["t"], torch.arange(48 * 6, dtype=torch.float32).reshape(48, 6)), "2-rank save loaded whole at 1 rank")


def hugging_face(root: str) -> None:
    import distckpt
    from distckpt.backends import HuggingFaceWriter

    path = os.path.join(root, "hf")
    tensors = {k: v for k, v in state().items() if isinstance(v, torch.Tensor)}
    distckpt.save(tensors, storage_writer=HuggingFaceWriter(path), no_dist=True)
    check(os.path.exists(os.path.join(path, "model.safetensors")) or
          os.path.exists(os.path.join(path, "model.safetensors.index.json")), "a Hugging Face directory written")
    back = {k: torch.zeros_like(v) for k, v in tensors.items()}
    distckpt.load(back, checkpoint_id=path, no_dist=True)
    check(same(back, tensors), "the Hugging Face directory read back, bit-exact")


def console_script(root: str) -> None:
    exe = shutil.which("distckpt", path=os.path.dirname(sys.executable))
    check(exe is not None, f"the console script is installed beside {sys.executable}")
    for argv, needle in ([["--help"], "inspect"], [["inspect", os.path.join(root, "one-None")], "format"],
                         [["verify", os.path.join(root, "sharded")], ""]):
        out = subprocess.run([exe, *argv], capture_output=True, text=True, timeout=300)
        check(out.returncode == 0 and needle in out.stdout, f"distckpt {argv[0]} (exit {out.returncode}: {out.stderr[-500:]})")


def missing_extras(root: str) -> None:
    import distckpt
    from distckpt.errors import MissingDependencyError

    try:
        distckpt.save({"w": torch.ones(3)}, checkpoint_id="s3://bucket/run/step-1", no_dist=True)
    except MissingDependencyError as exc:
        check(exc.extra == "s3" and "pip install 'distckpt[s3]'" in str(exc), f"s3:// without boto3: {exc}")
    else:
        check(False, "s3:// without boto3 raises MissingDependencyError")
    def gs() -> None:
        distckpt.save({"w": torch.ones(3)}, checkpoint_id="gs://bucket/run/step-1", no_dist=True)

    def az() -> None:
        distckpt.save({"w": torch.ones(3)}, checkpoint_id="az://container/run/step-1", no_dist=True)

    def prometheus() -> None:
        from distckpt.metrics import PrometheusMetrics

        PrometheusMetrics()

    def tracing() -> None:
        from distckpt.metrics import OpenTelemetrySpans

        OpenTelemetrySpans()

    for what, call, extra in (("gs:// without google-cloud-storage", gs, "gcs"),
                              ("az:// without azure-storage-blob", az, "azure"),
                              ("PrometheusMetrics without prometheus_client", prometheus, "metrics"),
                              ("OpenTelemetrySpans without opentelemetry-api", tracing, "tracing")):
        try:
            call()
        except MissingDependencyError as exc:
            check(exc.extra == extra and f"pip install 'distckpt[{extra}]'" in str(exc), f"{what}: {exc}")
        else:
            check(False, f"{what} raises MissingDependencyError")
    for module, extra in (("distckpt.integrations.lightning", "lightning"), ("distckpt.integrations.torchtitan", "torchtitan"),
                          ("distckpt.integrations.torch_checkpointing", "torch-checkpointing")):
        try:
            importlib.import_module(module)
        except MissingDependencyError as exc:
            check(exc.extra == extra and f"pip install 'distckpt[{extra}]'" in str(exc), f"import {module}: {exc}")
        else:
            check(False, f"import {module} without its framework raises MissingDependencyError")


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    import distckpt

    check(not os.path.abspath(distckpt.__file__).startswith(os.path.dirname(here) + os.sep),
          f"distckpt imports from the installed package ({distckpt.__file__})")
    present = [m for m in EXTRAS if _installed(m)]
    check(not present, f"no optional dependency installed (found {present})")
    root = tempfile.mkdtemp(prefix="distckpt-install-smoke-")
    try:
        single_rank(root)
        two_ranks(root)
        hugging_face(root)
        console_script(root)
        missing_extras(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("install smoke: passed", flush=True)


if __name__ == "__main__":
    main()
