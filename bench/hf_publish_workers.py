"""Rank functions of bench/hf_publish.py: one peer's publish of an FSDP2 model as a Hugging Face directory, timed,
then every byte of the output checked against the model's own shards."""

from __future__ import annotations

import json
import os
import threading
import time
import warnings

import torch

from .hf_workers import _fsdp_model, llama_config
from .measure import measure, warm_memory
from .workers import _raw_io


def _vm_rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class RssPeak:
    """The highest VmRSS seen while the block runs, sampled from a background thread every ``interval_s``,
    above the value read just before it (``delta_mb``)."""

    def __init__(self, interval_s: float = 0.002):
        self.interval_s = interval_s
        self.base = self.peak = 0
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, _vm_rss_kb())

    def __enter__(self) -> RssPeak:
        self.base = self.peak = _vm_rss_kb()
        self._thread = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _vm_rss_kb())

    @property
    def delta_mb(self) -> float:
        return max(0, self.peak - self.base) / 1024


def shard_files(state: dict, max_shard_size: str) -> dict[str, str]:
    """Each key's output shard, as distckpt's HuggingFaceWriter splits the state (DCP is given the same split)."""
    from distckpt.layouts.hf_publish import parse_size, plan_shards

    layout = plan_shards([(k, v.dtype, tuple(v.shape)) for k, v in state.items()], parse_size(max_shard_size))
    return {k: name for k, (name, _) in layout.placement.items()}


def hub_shard_files(state: dict, max_shard_size: str) -> dict[str, str]:
    """Each key's output shard as save_pretrained splits the state (huggingface_hub's split). It differs from
    distckpt's where a tensor over max_shard_size follows others: the hub gives it a shard of its own *before* the
    one being filled, which goes on filling after it."""
    from huggingface_hub import split_torch_state_dict_into_shards

    meta = {k: torch.empty(tuple(v.shape), dtype=v.dtype, device="meta") for k, v in state.items()}
    split = split_torch_state_dict_into_shards(meta, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size)
    return dict(split.tensor_to_filename)


def _rows(dt) -> tuple[int, int]:
    """The first global row of this rank's FSDP2 (Shard(0)) piece of ``dt``, and how many rows it holds."""
    n = dt.shape[0] if dt.dim() else 1
    per = (n + dt.device_mesh.size() - 1) // dt.device_mesh.size()
    return min(n, dt.device_mesh.get_local_rank() * per), dt.to_local().shape[0] if dt.dim() else 1


def _fsync_top(path: str) -> None:
    """fsync the files directly in ``path`` and the directory: what a peer that does not sync its output is given."""
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            fd = os.open(full, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, n)) for root, _, names in os.walk(path) for n in names)


def _check_published(path: str, state: dict, expected: dict[str, str]) -> int:
    """This rank's rows of every tensor, read back with safetensors from the shard the index names, equal the model's
    local shards bit for bit; the shards and the index are the ``expected`` ones. Returns the bytes checked."""
    from safetensors import safe_open

    count = len(set(expected.values()))
    shards = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if shards != sorted(set(expected.values())):
        raise AssertionError(f"{path}: shards {shards}, expected {sorted(set(expected.values()))}")
    if count > 1:
        with open(os.path.join(path, "model.safetensors.index.json")) as f:
            index = json.load(f)
        if index["weight_map"] != expected:
            diff = sorted((k, index["weight_map"].get(k), v) for k, v in expected.items() if index["weight_map"].get(k) != v)
            extra = sorted(set(index["weight_map"]) - set(expected))
            raise AssertionError(f"{path}: the index's weight map is not the expected shard assignment: (key, found, "
                                 f"expected) {diff[:5]} ({len(diff)} in all), keys not in the model {extra[:5]}")
        total = sum(v.numel() * v.element_size() for v in state.values())
        if index["metadata"]["total_size"] != total:
            raise AssertionError(f"{path}: index total_size {index['metadata']['total_size']}, expected {total}")
    checked = 0
    for shard in shards:
        keys = sorted(k for k, v in expected.items() if v == shard)
        with safe_open(os.path.join(path, shard), framework="pt") as f:
            if sorted(f.keys()) != keys:
                raise AssertionError(f"{path}/{shard}: holds other tensors than the index names")
            for key in keys:
                dt = state[key]
                sl = f.get_slice(key)
                if list(sl.get_shape()) != list(dt.shape):
                    raise AssertionError(f"{path}: {key} has shape {sl.get_shape()}, expected {list(dt.shape)}")
                first, n = _rows(dt)
                local = dt.to_local()
                got = sl[first:first + n] if dt.dim() else f.get_tensor(key)
                if got.dtype != local.dtype or not torch.equal(got, local):
                    raise AssertionError(f"{path}: {key} rows {first}..{first + n} differ from the model's")
                checked += local.nbytes
    return checked


def _check_from_pretrained(path: str, state: dict) -> None:
    """``from_pretrained`` takes the directory, and this rank's rows of its weights are the model's."""
    import transformers

    loaded = transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).state_dict()
    if set(loaded) != set(state):
        raise AssertionError(f"{path}: from_pretrained's keys differ from the model's")
    for key, dt in state.items():
        first, n = _rows(dt)
        if not torch.equal(loaded[key][first:first + n], dt.to_local()):
            raise AssertionError(f"{path}: from_pretrained's {key} differs from the model's")


def _check_raw(path: str, local: dict, rank: int) -> int:
    back = {k: torch.empty_like(v) for k, v in local.items()}
    _raw_io(back, path, rank, write=False)
    for k, v in local.items():
        if not torch.equal(back[k], v):
            raise AssertionError(f"{path}: the floor's bytes of {k} read back differ")
    return sum(v.nbytes for v in local.values())


def publish_round(rank: int, world_size: int, peer: str, path: str, gib: float, max_shard_size: str,
                  from_pretrained: bool) -> dict:
    """One publish of a fresh FSDP2 Llama-style model by ``peer`` into the new directory ``path``: wall time of the
    slowest rank from barrier to barrier, this rank's own wall and CPU time, peak RSS above the start (sampled VmRSS,
    and VmHWM), then the output checked: the bytes of the model this rank's check covered."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    import distckpt
    import distckpt.knobs as knobs

    mesh = init_device_mesh("cpu", (world_size,))
    model = _fsdp_model(llama_config(gib), mesh)
    state = get_model_state_dict(model)
    gen = torch.Generator().manual_seed(1000 + rank)
    with torch.no_grad():
        for v in state.values():
            v.to_local().normal_(generator=gen)
    local = {k: v.to_local() for k, v in state.items()}
    local_bytes = sum(v.nbytes for v in local.values())
    total_bytes = sum(v.numel() * v.element_size() for v in state.values())
    files = shard_files(state, max_shard_size)
    names = sorted(set(files.values()))
    mapping = {k: names.index(f) + 1 for k, f in files.items()}  # DCP's fqn_to_index_mapping: the same shards
    expected = hub_shard_files(state, max_shard_size) if peer == "save_pretrained" else files
    fsync = knobs.fsync_enabled()
    warm_memory((1.25 * local_bytes + total_bytes) / (1 << 30))
    # every peer's modules imported before the clock starts: the publish is measured, not the first import
    import safetensors.torch  # noqa: F401
    import torch.distributed.checkpoint as dcp
    import transformers

    import distckpt.backends.hf_writer  # noqa: F401

    transformers.utils.logging.disable_progress_bar()

    def run() -> None:
        if peer == "distckpt":  # DISTCKPT_FSYNC decides its syncs: shards, index, config.json, the directory
            distckpt.save(state, storage_writer=distckpt.HuggingFaceWriter(path, max_shard_size=max_shard_size,
                                                                           config=model.config))
        elif peer == "dcp-hf":
            writer = dcp.HuggingFaceStorageWriter(path, fqn_to_index_mapping=mapping, save_distributed=True,
                                                  enable_consolidation=True)
            writer.sync_files = fsync  # its per-rank files under sharded/ (DCP's default: synced)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save(state, storage_writer=writer)
            if fsync and rank == 0:  # the consolidated shards and the index are written without a sync
                _fsync_top(path)
        elif peer == "save_pretrained":
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if rank == 0:
                model.save_pretrained(path, state_dict=full, max_shard_size=max_shard_size)
                if fsync:  # save_pretrained syncs nothing
                    _fsync_top(path)
            del full
        elif peer == "raw":  # DISTCKPT_FSYNC decides its fsync of each file, as distckpt's
            _raw_io(local, path, rank, write=True)
        else:
            raise ValueError(peer)

    dist.barrier()
    t0 = time.perf_counter()
    with RssPeak() as rss:
        sample = measure(run, local_bytes)
    dist.barrier()
    span = time.perf_counter() - t0

    if peer == "raw":
        checked = _check_raw(path, local, rank)
    else:
        checked = _check_published(path, state, expected)
        if from_pretrained and rank == 0:
            _check_from_pretrained(path, state)
    dist.barrier()
    return {"span_s": span, "wall_s": sample.wall_s, "cpu_s": sample.cpu_s, "peak_rss_delta_mb": rss.delta_mb,
            "hwm_delta_mb": sample.peak_rss_delta_mb, "local_bytes": local_bytes, "total_bytes": total_bytes,
            "checked_bytes": checked, "from_pretrained": bool(from_pretrained and rank == 0 and peer != "raw"),
            "shards": len(names), "same_split_as_save_pretrained": files == hub_shard_files(state, max_shard_size),
            "out_bytes": _tree_bytes(path) if rank == 0 else None, "fsync": fsync}
