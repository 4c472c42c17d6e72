"""Write the fuzz seed corpus (tests/fuzz/corpus/<target>/) from real checkpoints.

Run when a format changes: ``.venv/bin/python tests/fuzz/make_corpus.py [TARGET ...]`` (all targets by default). The seeds are small files
written by distckpt, by torch.distributed.checkpoint and by the safetensors package, plus the golden
checkpoints of every format version; inputs the fuzzer finds interesting are added beside them by hand
(named ``found-*``), and this script leaves those alone.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import struct
import sys
import tempfile

import torch

HERE = pathlib.Path(__file__).resolve().parent
CORPUS = HERE / "corpus"
GOLDEN = HERE.parent / "golden"


def _put(target: str, name: str, data: bytes) -> None:
    folder = CORPUS / target
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"seed-{name}").write_bytes(data)


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 4, generator=g),
        "b": torch.arange(5, dtype=torch.int64),
        "h": torch.ones(2, 2, dtype=torch.bfloat16),
        "flag": torch.tensor([True, False]),
        "c": torch.zeros(2, dtype=torch.complex64),
        "empty": torch.zeros(0, 3),
        "step": 7,
        "extra": {"lr": 0.1, "name": "adam", "betas": (0.9, 0.999), "inf": float("inf"), "raw": b"\x00\x01"},
    }


def distckpt_seeds(tmp: pathlib.Path) -> None:
    import distckpt
    from distckpt.format.codec import encode_metadata
    from distckpt.format.records import FileInfo, FileStorageData, StorageInfo
    from distckpt.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    path = tmp / "ck"
    distckpt.save(_state(), checkpoint_id=str(path), no_dist=True)
    _put("metadata", "save", (path / "metadata.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        _put("datafile", f"save-{f.name}", f.read_bytes())
    # a tensor in several chunks with inline locations (format 2.0), as a sharded save writes it
    props = TensorProperties(torch.float32)
    files = {"data-00000.safetensors": FileInfo(4096 + 48, 0, 1), "data-00001.safetensors": FileInfo(4096 + 48, 1, 2)}
    items = {MetadataIndex("t", torch.Size([0, 0])): StorageInfo("data-00000.safetensors", 4096, 24, 5),
             MetadataIndex("t", torch.Size([2, 0])): StorageInfo("data-00001.safetensors", 4096, 24, 6),
             MetadataIndex("v"): StorageInfo("data-00000.safetensors", 4120, 10, 7)}
    md = Metadata({"t": TensorStorageMetadata(props, torch.Size([4, 3]), [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3])),
                                                                            ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 3]))]),
                   "v": BytesStorageMetadata()},
                  planner_data={"t": ("t",), "v": ("v",)}, storage_data=FileStorageData("s1", files, items))
    _put("metadata", "chunks", encode_metadata(md))
    # storage data that is not distckpt's: a tagged value
    _put("metadata", "opaque", encode_metadata(Metadata({"v": BytesStorageMetadata()}, storage_data={"x": [1, (2, 3)]})))


def golden_seeds() -> None:
    for version in sorted(p for p in GOLDEN.iterdir() if p.is_dir() and p.name.startswith("v")):
        for case in sorted(p for p in version.iterdir() if p.is_dir()):
            tag = f"golden-{version.name}-{case.name}"
            _put("metadata", tag, (case / "metadata.json").read_bytes())
            first = sorted(case.glob("*.safetensors"))[0]
            _put("datafile", f"{tag}-{first.name}", first.read_bytes())


def value_seeds() -> None:
    from distckpt.format.values import encode_value

    for name, value in [("plain", {"a": 1, "b": [1.5, None, True, "s"]}), ("tagged", _state()["extra"]),
                        ("dict", {1: "x", (1, 2): torch.Size([2, 3]), "d": torch.float16}), ("nan", float("nan"))]:
        _put("value", name, encode_value(value))


def dcp_seeds(tmp: pathlib.Path) -> None:
    import torch.distributed.checkpoint as dcp

    for name, state in [("save", _state()), ("tensors", {"a": torch.ones(2, 3), "b": {"c": torch.zeros(4, dtype=torch.int8)}})]:
        path = tmp / f"dcp-{name}"
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
        _put("dcp_metadata", name, (path / ".metadata").read_bytes())


def hf_seeds(tmp: pathlib.Path) -> None:
    from safetensors.torch import save_file

    tensors = {"model.embed.weight": torch.ones(4, 2), "model.norm.bias": torch.zeros(3, dtype=torch.bfloat16),
               "lm_head.weight": torch.arange(6, dtype=torch.int32).reshape(2, 3)}
    save_file(tensors, str(tmp / "model-00001-of-00001.safetensors"), metadata={"format": "pt"})
    shard = (tmp / "model-00001-of-00001.safetensors").read_bytes()
    _put("hf_shard", "safetensors", shard)
    (n,) = struct.unpack("<Q", shard[:8])
    _put("hf_shard", "header-only", shard[:8 + n])  # a header whose data section is missing
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": {k: "model-00001-of-00001.safetensors" for k in tensors}}
    _put("hf_index", "index", json.dumps(index, indent=2).encode())
    two = {"metadata": {"total_size": 40}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    _put("hf_index", "two-shards", json.dumps(two).encode())


def torch_save_seeds(tmp: pathlib.Path) -> None:
    import io
    import zipfile

    for name, obj in [("state", {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.zeros(2, dtype=torch.bfloat16),
                                 "step": 3, "cfg": {"lr": 0.5, "betas": (0.9, 0.99), "name": "adam"}}),
                      ("views", {"row": torch.arange(8).reshape(2, 4)[1], "col": torch.ones(3, 3)[:, 1], "e": torch.empty(0, 2)})]:
        out = io.BytesIO()
        torch.save(obj, out)
        _put("torch_save", name, out.getvalue())
        with zipfile.ZipFile(io.BytesIO(out.getvalue())) as zf:  # the pickle alone (targets.archived puts it in an archive)
            pickled = zf.read(next(n for n in zf.namelist() if n.endswith("/data.pkl")))
        _put("torch_save", f"{name}-pickle", pickled)


SEEDERS = {"metadata": ["distckpt", "golden"], "datafile": ["distckpt", "golden"], "value": ["value"], "dcp_metadata": ["dcp"],
           "hf_index": ["hf"], "hf_shard": ["hf"], "torch_save": ["torch_save"]}


def main(targets: list[str]) -> int:
    targets = targets or list(SEEDERS)
    for target in targets:
        folder = CORPUS / target
        if folder.exists():
            for f in folder.glob("seed-*"):
                f.unlink()
    makers = {m for t in targets for m in SEEDERS[t]}
    with tempfile.TemporaryDirectory() as tmp:
        for maker in sorted(makers):
            fn = {"distckpt": distckpt_seeds, "golden": lambda _: golden_seeds(), "value": lambda _: value_seeds(),
                  "dcp": dcp_seeds, "hf": hf_seeds, "torch_save": torch_save_seeds}[maker]
            fn(pathlib.Path(tmp))
    for f in sorted(CORPUS.rglob("*")):
        if f.is_file():
            print(f"{f.relative_to(CORPUS)}  {f.stat().st_size} bytes  {hashlib.sha1(f.read_bytes()).hexdigest()[:8]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
