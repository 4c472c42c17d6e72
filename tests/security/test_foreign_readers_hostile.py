"""The findings of the adversarial review of the readers of other programs' checkpoints: each gets a typed error
(or correct bytes), in bounded time and memory, on every rank."""

import io
import json
import os
import struct
import warnings

import pytest
import torch
from safetensors.torch import save_file

import distckpt
from distckpt.format_utils import BroadcastingTorchSaveReader, DynamicMetaLoadPlanner
from distckpt.testing import run_ranks

from .torch_archives import Storage, Tensor, archive, raw


def test_a_pickle_of_shared_containers_is_refused_at_once_not_walked_as_a_tree(tmp_path):
    leaf = {"x": 1}
    for _ in range(40):  # 2**40 paths in under a kilobyte
        leaf = {"l": leaf, "r": leaf}
    file = tmp_path / "m.pt"
    file.write_bytes(archive({"w": None, "cfg": leaf}, {}))
    for call in (lambda: distckpt.read_metadata(str(file)),
                 lambda: distckpt.convert.from_torch_save(str(file), str(tmp_path / "out"))):
        with pytest.raises(distckpt.CorruptCheckpointError, match="more than .* nodes"):
            call()


def test_a_dcp_value_of_shared_containers_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"cfg": 5}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    leaf = {"x": 1}
    for _ in range(40):
        leaf = {"l": leaf, "r": leaf}
    data = archive(leaf, {})
    file = tmp_path / "c" / "__0_0.distcp"
    offset = file.stat().st_size
    with open(file, "ab") as f:
        f.write(data)
    import pickle
    md = pickle.loads((tmp_path / "c" / ".metadata").read_bytes())
    for index in md.storage_data:
        md.storage_data[index] = _StorageInfo("__0_0.distcp", offset, len(data))
    (tmp_path / "c" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(distckpt.CorruptCheckpointError, match="more than .* nodes"):
        distckpt.load({"cfg": None}, checkpoint_id=str(tmp_path / "c"), no_dist=True)


def test_a_stride_zero_view_of_a_tiny_storage_is_refused_before_anything_allocates_it(tmp_path, monkeypatch):
    s = Storage("0", torch.FloatStorage, 12)
    file = tmp_path / "m.pt"
    file.write_bytes(archive({"w": Tensor(s, 0, (3, 4), (4, 1)), "bomb": Tensor(s, 0, (1 << 36,), (0,))},
                             {"0": raw(torch.arange(12.0))}))
    # the broadcasting reader reads only the keys asked for: the bomb beside them is never built
    out = {"w": torch.zeros(3, 4)}
    distckpt.load(out, storage_reader=BroadcastingTorchSaveReader(str(file)), planner=DynamicMetaLoadPlanner(), no_dist=True)
    assert torch.equal(out["w"], torch.arange(12.0).view(3, 4))
    # and refuses one asked for (a smaller bomb over a lower cap, so that its destination fits in memory)
    monkeypatch.setenv("DISTCKPT_MAX_VALUE_BYTES", "1024")
    asked = tmp_path / "asked.pt"
    asked.write_bytes(archive({"bomb": Tensor(s, 0, (4096,), (0,))}, {"0": raw(torch.arange(12.0))}))
    with pytest.raises(distckpt.CorruptCheckpointError, match="views storage"):
        distckpt.load({"bomb": torch.zeros(4096)}, storage_reader=BroadcastingTorchSaveReader(str(asked)),
                      planner=DynamicMetaLoadPlanner(), no_dist=True)
    monkeypatch.delenv("DISTCKPT_MAX_VALUE_BYTES")
    with pytest.raises(distckpt.CorruptCheckpointError, match="views storage"):
        distckpt.convert.from_torch_save(str(file), str(tmp_path / "out"))
    small = tmp_path / "small.pt"  # a stride-0 view within the cap loads, as a view, as torch.load gives it
    small.write_bytes(archive({"e": Tensor(s, 2, (5,), (0,))}, {"0": raw(torch.arange(12.0))}))
    out = {"e": torch.zeros(5)}
    distckpt.load(out, checkpoint_id=str(small), no_dist=True)
    assert torch.equal(out["e"], torch.full((5,), 2.0))


def test_one_storage_named_with_two_dtypes_is_refused(tmp_path):
    file = tmp_path / "m.pt"
    file.write_bytes(archive({"x": Tensor(Storage("0", torch.FloatStorage, 4), 0, (4,), (1,)),
                              "y": Tensor(Storage("0", torch.IntStorage, 4), 0, (4,), (1,))}, {"0": raw(torch.arange(4.0))}))
    with pytest.raises(distckpt.CorruptCheckpointError, match="two sizes or two dtypes"):
        distckpt.load({"x": torch.zeros(4)}, checkpoint_id=str(file), no_dist=True)


def test_a_flipped_byte_in_a_record_read_whole_fails_its_crc(tmp_path):
    buf = io.BytesIO()
    torch.save({"w": torch.arange(1000.0)}, buf)
    data = bytearray(buf.getvalue())
    at = data.find(raw(torch.arange(1000.0))[400:440])
    data[at] ^= 0x10
    file = tmp_path / "m.pt"
    file.write_bytes(bytes(data))
    with pytest.raises(distckpt.CorruptCheckpointError, match="CRC-32"):
        distckpt.convert.from_torch_save(str(file), str(tmp_path / "out"))


def test_a_local_header_that_lies_about_its_length_is_refused(tmp_path):
    buf = io.BytesIO()
    torch.save({"w": torch.arange(16.0)}, buf)
    data = bytearray(buf.getvalue())
    at = 0
    while True:  # the local header of the storage record
        at = data.find(b"PK\x03\x04", at)
        name_len, extra_len = struct.unpack("<HH", data[at + 26:at + 30])
        if data[at + 30:at + 30 + name_len].endswith(b"data/0"):
            break
        at += 4
    data[at + 28:at + 30] = struct.pack("<H", extra_len + 4)
    file = tmp_path / "m.pt"
    file.write_bytes(bytes(data))
    with pytest.raises(distckpt.CorruptCheckpointError, match="alignment|local header"):
        distckpt.load({"w": torch.zeros(16)}, checkpoint_id=str(file), no_dist=True)


def test_a_safetensors_dtype_of_the_wrong_json_type_is_a_typed_error(tmp_path):
    raw_header = json.dumps({"x": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw_header)) + raw_header + bytes(4))
    with pytest.raises(distckpt.CorruptCheckpointError, match="dtype"):
        distckpt.read_metadata(str(tmp_path))


def _shard(path, order):
    """One safetensors file holding a = zeros and b = ones (float32, 4 each), laid out in ``order``."""
    offsets = {name: [16 * i, 16 * (i + 1)] for i, name in enumerate(order)}
    header = json.dumps({n: {"dtype": "F32", "shape": [4], "data_offsets": offsets[n]} for n in "ab"}).encode()
    data = b"".join(raw(torch.zeros(4) if n == "a" else torch.ones(4)) for n in order)
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def test_a_shard_replaced_between_planning_and_reading_is_refused(tmp_path):
    _shard(tmp_path / "model.safetensors", "ab")
    reader = distckpt.HuggingFaceReader(str(tmp_path))
    md = reader.read_metadata()
    os.rename(tmp_path / "model.safetensors", tmp_path / "old")
    _shard(tmp_path / "model.safetensors", "ba")  # the same size, the tensors swapped
    assert (tmp_path / "old").stat().st_size == (tmp_path / "model.safetensors").stat().st_size
    planner = distckpt.DefaultLoadPlanner()
    out = {"a": torch.full((4,), 7.0), "b": torch.full((4,), 7.0)}
    planner.set_up_planner(out, md, True)
    reader.set_up_storage_reader(md, True)
    with pytest.raises(distckpt.CorruptCheckpointError, match="replaced"):
        reader.read_data(planner.create_local_plan(), planner).wait()


def test_a_checkpoint_directory_reached_through_a_link_is_refused_in_any_spelling(tmp_path):
    save_file({"a": torch.zeros(4)}, str(tmp_path / "model.safetensors"))
    os.symlink(tmp_path, tmp_path.parent / f"{tmp_path.name}-link")
    for spelling in ("", "/.", "/./"):
        with pytest.raises(distckpt.CheckpointError, match="symbolic link"):
            distckpt.load({"a": torch.zeros(4)}, storage_reader=distckpt.HuggingFaceReader(
                f"{tmp_path.parent}/{tmp_path.name}-link{spelling}"), no_dist=True)


def test_an_empty_tensor_does_not_pass_for_a_tied_weight(tmp_path):
    save_file({"present": torch.zeros(0, 4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(distckpt.MissingKeyError, match="absent"):
        distckpt.load({"present": torch.zeros(0, 4), "absent": torch.zeros(0, 4)}, checkpoint_id=str(tmp_path),
                      no_dist=True)


def _broadcast_load(rank, world_size, path, keys, dtypes, shapes):
    state = {k: torch.zeros(shapes[rank], dtype=dtypes[rank]) for k in keys[rank]}
    try:
        distckpt.load(state, storage_reader=BroadcastingTorchSaveReader(path), planner=DynamicMetaLoadPlanner())
    except distckpt.CheckpointError as exc:
        return type(exc).__name__, str(exc)
    return "loaded", {k: v.tolist() for k, v in state.items()}


@pytest.mark.parametrize("keys,dtypes,shapes", [
    ([["v"], ["u"]], [torch.float32] * 2, [(3, 4)] * 2),               # each rank another key
    ([["u"], ["u"]], [torch.float32, torch.float64], [(3, 4)] * 2),    # rank 1 another dtype
    ([["u"], ["u"]], [torch.float32] * 2, [(3, 4), (4, 3)]),           # rank 1 another shape
    ([["u", "v"], ["u"]], [torch.float32] * 2, [(3, 4)] * 2),          # rank 1 lacks a key
], ids=["keys", "dtype", "shape", "missing"])
def test_broadcasting_reader_ranks_that_disagree_all_raise(tmp_path, keys, dtypes, shapes):
    path = str(tmp_path / "m.pt")
    torch.save({"u": torch.full((3, 4), 7.0), "v": torch.full((3, 4), 5.0)}, path)
    per_rank = run_ranks(_broadcast_load, 2, path, keys, dtypes, shapes, timeout_s=60)
    assert all(r[0] != "loaded" for r in per_rank), per_rank


def test_broadcasting_reader_casts_only_when_allowed(tmp_path):
    path = str(tmp_path / "m.pt")
    torch.save({"w": torch.full((2,), 1e10)}, path)
    with pytest.raises(distckpt.DTypeMismatchError, match="allow_dtype_conversion"):
        distckpt.load({"w": torch.zeros(2, dtype=torch.int32)}, storage_reader=BroadcastingTorchSaveReader(path),
                      planner=DynamicMetaLoadPlanner(), no_dist=True)


def test_a_pickle_memoizing_at_a_huge_index_is_refused_before_the_unpickler_grows_its_memo(tmp_path):
    import zipfile

    (tmp_path / ".metadata").write_bytes(b"\x80\x04Nr\x00\x00\x00\x10.")  # LONG_BINPUT 2**28: 4 GiB of memo
    with pytest.raises(distckpt.CorruptCheckpointError, match="memoizes"):
        distckpt.read_metadata(str(tmp_path))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x02}r\x00\x00\x00\x10.")
    file = tmp_path / "m.pt"
    file.write_bytes(out.getvalue())
    with pytest.raises(distckpt.CorruptCheckpointError, match="memoizes"):
        distckpt.read_metadata(str(file))


def test_failed_unpickles_of_an_archive_leave_no_unpickler_behind(tmp_path):
    import gc

    from distckpt.layouts import torch_zip

    # a well-formed pickle that fails inside the load, after the rebuild function is in the memo
    blob = archive({"w": Tensor(Storage("0", "not a storage type", 4), 0, (4,), (1,))}, {"0": raw(torch.zeros(4))})

    def pread(n, offset):
        return blob[offset:offset + n]
    arch = torch_zip.open_archive(pread, len(blob), "x.pt")
    gc.collect()
    before = sum(type(o).__name__ == "_Unpickler" for o in gc.get_objects())
    for _ in range(200):
        with pytest.raises(distckpt.CheckpointError, match="of type"):
            torch_zip.unpickle_refs(arch, pread, "x.pt", 1 << 20)
    gc.collect()
    assert sum(type(o).__name__ == "_Unpickler" for o in gc.get_objects()) - before == 0
