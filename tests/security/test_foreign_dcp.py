"""DCP directories edited by an attacker: every finding of the review of the DCP reader fails with a typed error
naming the key, in bounded memory, and nothing is half-loaded silently."""

import io
import os
import pickle
import resource
import subprocess
import sys
import warnings
import zipfile

import pytest
import torch

import distckpt
from distckpt.metadata import MetadataIndex

dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint.filesystem import _StorageInfo  # noqa: E402
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata as DcpChunk  # noqa: E402


def _save(path, zstd=False, state=None):
    from torch.distributed.checkpoint._extension import ZStandard

    state = state if state is not None else {"w": torch.arange(16.0), "step": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        writer = dcp.FileSystemWriter(str(path), _extensions=[ZStandard()] if zstd else None)
        dcp.save(state, storage_writer=writer, no_dist=True)
    return str(path)


def _edit(path, fn):
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)
    fn(md)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def _append(path, data: bytes, name="__0_0.distcp"):
    """Append ``data`` to a data file; its place there."""
    file = os.path.join(path, name)
    offset = os.path.getsize(file)
    with open(file, "ab") as f:
        f.write(data)
    return offset, len(data)


def _point(path, fqn, data, descriptors=()):
    """Make the item of ``fqn`` (offset zero) the bytes ``data``, appended to the data file."""
    offset, length = _append(path, data)

    def edit(md):
        for index in list(md.storage_data):
            if index.fqn == fqn:
                md.storage_data[index] = _StorageInfo("__0_0.distcp", offset, length, list(descriptors))
    _edit(path, edit)


def _torch_save(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _load(path, state=None, **planner):
    state = state if state is not None else {"w": torch.zeros(16), "step": 0}
    distckpt.load(state, checkpoint_id=path, no_dist=True, planner=distckpt.DefaultLoadPlanner(**planner) if planner else None)
    return state


def test_an_untouched_checkpoint_loads(tmp_path):
    state = _load(_save(tmp_path / "c"))
    assert torch.equal(state["w"], torch.arange(16.0)) and state["step"] == 3


def test_a_chunk_list_that_leaves_half_the_tensor_unwritten_is_refused(tmp_path):
    path = _save(tmp_path / "c")

    def half(md):
        md.state_dict_metadata["w"].chunks = [DcpChunk(torch.Size([0]), torch.Size([8]))]
    _edit(path, half)
    with pytest.raises(distckpt.CorruptCheckpointError, match="'w'.*hold 8 of the tensor's 16 elements"):
        _load(path)


def test_chunks_outside_the_tensor_or_overlapping_are_refused(tmp_path):
    path = _save(tmp_path / "c")

    def outside(md):
        md.state_dict_metadata["w"].chunks = [DcpChunk(torch.Size([8]), torch.Size([16]))]
    _edit(path, outside)
    with pytest.raises(distckpt.CorruptCheckpointError, match="outside tensor"):
        _load(path)
    path = _save(tmp_path / "d", state={"w": torch.arange(16.0)})

    def overlapping(md):
        md.state_dict_metadata["w"].chunks = [DcpChunk(torch.Size([0]), torch.Size([10])), DcpChunk(torch.Size([6]), torch.Size([6]))]
        info = next(iter(md.storage_data.values()))
        md.storage_data = {dcp.metadata.MetadataIndex("w", torch.Size([0])): info,
                           dcp.metadata.MetadataIndex("w", torch.Size([6])): info}
    _edit(path, overlapping)
    with pytest.raises(distckpt.CorruptCheckpointError, match="overlap"):
        _load(path, {"w": torch.zeros(16)})


def test_a_stored_float64_item_where_the_metadata_says_float32_is_refused_not_cast(tmp_path):
    path = _save(tmp_path / "c")
    _point(path, "w", _torch_save(torch.full((16,), 1e300, dtype=torch.float64)))
    with pytest.raises(distckpt.CorruptCheckpointError, match="'w'.*float64.*float32"):
        _load(path)


@pytest.mark.parametrize("stored", [torch.arange(32.0), torch.arange(16.0).reshape(4, 4), torch.arange(8.0)])
def test_a_stored_item_of_another_shape_is_refused_not_truncated(tmp_path, stored):
    path = _save(tmp_path / "c")
    _point(path, "w", _torch_save(stored))
    with pytest.raises(distckpt.CorruptCheckpointError, match="'w'.*size"):
        _load(path)


def test_a_pickle_claiming_a_storage_larger_than_its_record_is_refused(tmp_path):
    path = _save(tmp_path / "c")
    raw = bytearray(_torch_save(torch.arange(16.0)))
    # the storage's element count is the BININT1 16 right before BINPERSID ('Q') in data.pkl: claim 255
    at = raw.index(b"K\x10tq\x05Q") if b"K\x10tq\x05Q" in raw else raw.index(b"K\x10t")
    raw[at + 1] = 0xFF
    _point(path, "w", bytes(raw))
    with pytest.raises(distckpt.CorruptCheckpointError, match="'w'"):
        _load(path)


def _deflated(archive: bytes) -> bytes:
    """The same archive with every record DEFLATE-compressed (which torch.load would inflate without a bound)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(archive)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    return out.getvalue()


def test_a_deflated_record_is_refused(tmp_path):
    path = _save(tmp_path / "c")
    _point(path, "w", _deflated(_torch_save(torch.arange(16.0))))
    with pytest.raises(distckpt.CorruptCheckpointError, match="'w'.*compressed"):
        _load(path)


_BOMB = """
import resource, sys, torch, distckpt
path, fqn = sys.argv[1], sys.argv[2]
state = {"w": torch.zeros(16), "step": 0}
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    distckpt.load(state, checkpoint_id=path, no_dist=True)
    print("LOADED")
except distckpt.CheckpointError as exc:
    print(type(exc).__name__, str(exc)[:300])
print("GROWTH_MIB", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


@pytest.mark.parametrize("fqn", ["w", pytest.param("step", marks=pytest.mark.slow)])
def test_a_zstd_bomb_item_is_refused_in_bounded_memory(tmp_path, fqn):
    import zstandard

    path = _save(tmp_path / "c", zstd=True)
    bomb = zstandard.ZstdCompressor(level=19).compress(b"\0" * (600 << 20))  # 600 MiB from a few KB
    assert len(bomb) < 64 << 10
    _point(path, fqn, bomb, ["stream.zstd/1"])
    env = dict(os.environ, DISTCKPT_MAX_VALUE_BYTES=str(64 << 20))
    out = subprocess.run([sys.executable, "-c", _BOMB, path, fqn], capture_output=True, text=True, timeout=300, env=env)
    assert "CorruptCheckpointError" in out.stdout, out.stdout + out.stderr
    growth = int(out.stdout.split("GROWTH_MIB")[1])
    assert growth < 200, out.stdout


def test_a_deflated_value_bomb_is_refused_before_inflating(tmp_path):
    path = _save(tmp_path / "c")
    archive = _deflated(_torch_save(b"\0" * (64 << 20)))
    _point(path, "step", archive)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(distckpt.CorruptCheckpointError, match="'step'.*compressed"):
        _load(path)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 48 << 10


def test_planner_data_with_a_huge_list_position_is_refused(tmp_path):
    path = _save(tmp_path / "c", state={"layers": [torch.arange(4.0)]})

    def huge(md):
        md.planner_data = {"layers.0": ("layers", 10**12)}
    _edit(path, huge)
    with pytest.raises(distckpt.CorruptCheckpointError, match="planner_data.*layers"):
        distckpt.read_metadata(path)
    with pytest.raises(distckpt.CorruptCheckpointError, match="planner_data"):
        distckpt.convert.dcp_to_torch_save(path, str(tmp_path / "out.pt"))


@pytest.mark.parametrize("edit", [
    lambda md: setattr(md, "state_dict_metadata", None),
    lambda md: setattr(md.state_dict_metadata["w"], "chunks", None),
    lambda md: setattr(md.state_dict_metadata["w"], "size", "sixteen"),
    lambda md: setattr(md.state_dict_metadata["w"].properties, "dtype", "float32"),
    lambda md: setattr(md.state_dict_metadata["w"].chunks[0], "offsets", [-1]),
    lambda md: md.storage_data.update({k: _StorageInfo("../escape.distcp", 0, 10) for k in md.storage_data}),
    lambda md: md.storage_data.update({k: _StorageInfo("__0_0.distcp", 10**15, 10) for k in md.storage_data}),
    lambda md: md.storage_data.update({k: _StorageInfo("__0_0.distcp", 0, -5) for k in md.storage_data}),
    lambda md: md.storage_data.update({k: None for k in md.storage_data}),
    lambda md: md.storage_data.clear(),
    lambda md: setattr(md, "planner_data", {"nope": ("nope",)}),
])
def test_malformed_fields_raise_typed_errors(tmp_path, edit):
    path = _save(tmp_path / "c")
    _edit(path, edit)
    with pytest.raises(distckpt.CheckpointError):
        _load(path)


def test_items_are_read_through_the_engine_with_the_memory_budget_and_lanes(tmp_path):
    """A DCP checkpoint's items are placed in its files, so a sharded read takes only its rows."""
    path = _save(tmp_path / "c")
    md = distckpt.read_metadata(path)
    info = md.storage_data.items[MetadataIndex("w", [0])]
    assert info.file == "__0_0.distcp" and info.codec == "torch.save" and info.crc32c is None
