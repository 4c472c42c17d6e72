"""End-to-end save/load through the public API, in one process."""

import os
import uuid

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import distckpt
from distckpt import DefaultLoadPlanner, DefaultSavePlanner


def test_public_names_import():
    for name in distckpt.__all__:
        assert getattr(distckpt, name) is not None
    from distckpt.metadata import (  # noqa: F401
        STATE_DICT_TYPE,
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )
    from distckpt.planner import (  # noqa: F401
        BytesIOWriteData,
        LoadItemType,
        LoadPlan,
        LoadPlanner,
        ReadItem,
        SavePlan,
        SavePlanner,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )
    from distckpt.storage import StorageReader, StorageWriter, WriteResult  # noqa: F401
    assert issubclass(distckpt.CheckpointError, Exception)
    assert issubclass(distckpt.CheckpointNotFoundError, FileNotFoundError)


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.complex64]


def _random(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        if dtype.is_complex:
            return torch.randn(shape, generator=g, dtype=dtype)
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


@settings(deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 6), max_size=3), st.sampled_from(DTYPES)), min_size=1, max_size=6),
       st.booleans())
def test_save_then_load_returns_the_same_bytes(specs, noncontiguous):
    sd = {}
    for i, (shape, dtype) in enumerate(specs):
        t = _random(shape, dtype, i)
        if noncontiguous and t.dim() >= 2:
            t = t.transpose(0, 1)
        sd[f"t{i}"] = t
    cid = f"memory://{uuid.uuid4().hex}"
    distckpt.save(sd, checkpoint_id=cid)
    out = {k: torch.empty_like(v) for k, v in sd.items()}
    distckpt.load(out, checkpoint_id=cid)
    for k in sd:
        a, b = sd[k].contiguous(), out[k].contiguous()
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.numel() == 0 or torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def test_nested_state_restores_into_callers_nesting(tmp_path):
    sd = {"model": {"enc": {"w": torch.randn(3, 3)}}, "cfg": {"name": "x", "sizes": (1, 2)}, "hist": [torch.ones(2), 5]}
    distckpt.save(sd, checkpoint_id=tmp_path / "ck")
    out = {"model": {"enc": {"w": torch.zeros(3, 3)}}, "cfg": {"name": "", "sizes": ()}, "hist": [torch.zeros(2), 0]}
    distckpt.load(out, checkpoint_id=tmp_path / "ck")
    assert torch.equal(out["model"]["enc"]["w"], sd["model"]["enc"]["w"])
    assert out["cfg"] == {"name": "x", "sizes": (1, 2)}
    assert torch.equal(out["hist"][0], torch.ones(2)) and out["hist"][1] == 5


def test_load_reads_straight_into_destination_memory(tmp_path):
    w = torch.randn(256, 256)
    distckpt.save({"w": w}, checkpoint_id=tmp_path / "ck")
    dest = torch.zeros(256, 256)
    ptr = dest.data_ptr()
    distckpt.load({"w": dest}, checkpoint_id=tmp_path / "ck")
    assert dest.data_ptr() == ptr and torch.equal(dest, w)


def test_errors_name_checkpoint_key_and_fix(tmp_path):
    path = tmp_path / "ck"
    with pytest.raises(distckpt.CheckpointNotFoundError, match="does not exist"):
        distckpt.load({"w": torch.zeros(2)}, checkpoint_id=path)
    distckpt.save({"w": torch.ones(2, 3), "n": 1}, checkpoint_id=path)
    with pytest.raises(distckpt.MissingKeyError, match=r"'v'.*ck.*allow_partial_load"):
        distckpt.load({"v": torch.zeros(2)}, checkpoint_id=path)
    with pytest.raises(distckpt.ShapeMismatchError, match=r"saved \[2, 3\] and current: \[3, 2\] for key 'w'"):
        distckpt.load({"w": torch.zeros(3, 2)}, checkpoint_id=path)
    with pytest.raises(distckpt.DTypeMismatchError, match=r"'w'.*allow_dtype_conversion"):
        distckpt.load({"w": torch.zeros(2, 3, dtype=torch.float64)}, checkpoint_id=path)
    out = {"w": torch.zeros(2, 3, dtype=torch.float64), "extra": torch.zeros(1)}
    distckpt.load(out, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True, allow_dtype_conversion=True))
    assert torch.equal(out["w"], torch.ones(2, 3, dtype=torch.float64))
    with pytest.raises(distckpt.CheckpointError, match="already exists"):
        distckpt.save({"w": torch.ones(1)}, checkpoint_id=path)


class Opaque:
    def __init__(self, v):
        self.v = v


def test_unsafe_values_raise_at_save_unless_pickle_opted_in(tmp_path):
    with pytest.raises(distckpt.UnsafeValueError, match=r"'obj'.*allow_pickle=True"):
        distckpt.save({"obj": Opaque(1)}, checkpoint_id=tmp_path / "a")
    assert not (tmp_path / "a" / "metadata.json").exists()
    distckpt.save({"obj": Opaque(2)}, checkpoint_id=tmp_path / "b", planner=DefaultSavePlanner(allow_pickle=True))
    out = {"obj": None}
    with pytest.raises(distckpt.UnsafeValueError, match="allow_pickle=True"):
        distckpt.load(out, checkpoint_id=tmp_path / "b")
    distckpt.load(out, checkpoint_id=tmp_path / "b", planner=DefaultLoadPlanner(allow_pickle=True))
    assert out["obj"].v == 2


class Counter:
    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n, "t": torch.tensor([float(self.n)])}

    def load_state_dict(self, sd):
        self.n = sd["n"]
        self.t = sd["t"]


def test_stateful_objects_round_trip(tmp_path):
    c = Counter()
    c.n = 41
    distckpt.save({"counter": c}, checkpoint_id=tmp_path / "ck")
    c2 = Counter()
    distckpt.load({"counter": c2}, checkpoint_id=tmp_path / "ck")
    assert c2.n == 41 and float(c2.t) == 41.0


def test_read_metadata_describes_without_loading(tmp_path):
    distckpt.save({"w": torch.ones(4, 5, dtype=torch.bfloat16), "s": "x"}, checkpoint_id=tmp_path / "ck")
    md = distckpt.read_metadata(tmp_path / "ck")
    assert md.state_dict_metadata["w"].size == torch.Size([4, 5])
    assert md.state_dict_metadata["w"].properties.dtype == torch.bfloat16
    assert md.version == "3.0"


def test_rank_local_values_keep_every_copy(tmp_path):
    distckpt.save({"rng": distckpt.RankLocal(torch.arange(3))}, checkpoint_id=tmp_path / "ck")
    md = distckpt.read_metadata(tmp_path / "ck")
    assert "rng@rank0" in md.state_dict_metadata
    out = {"rng": distckpt.RankLocal(torch.zeros(3, dtype=torch.int64))}
    distckpt.load(out, checkpoint_id=tmp_path / "ck")
    assert torch.equal(out["rng"].value, torch.arange(3))


def test_storage_chosen_from_checkpoint_id(tmp_path):
    distckpt.save({"w": torch.ones(2)}, checkpoint_id="memory://picked")
    out = {"w": torch.zeros(2)}
    distckpt.load(out, checkpoint_id="memory://picked")
    assert torch.equal(out["w"], torch.ones(2))
    distckpt.save({"w": torch.ones(2)}, checkpoint_id=f"file://{tmp_path}/f")
    assert os.path.exists(tmp_path / "f" / "metadata.json")


def test_large_rank_state_is_split_over_files_written_in_parallel(tmp_path, monkeypatch):
    from safetensors import safe_open

    monkeypatch.setenv("DISTCKPT_IO_THREADS", "3")
    sd = {f"w{i}": torch.randn(8, 1 << 20) for i in range(6)}  # 6 x 32 MiB
    distckpt.save(sd, checkpoint_id=tmp_path / "ck")
    files = sorted(f for f in os.listdir(tmp_path / "ck") if f.endswith(".safetensors"))
    assert files == ["data-00000-1.safetensors", "data-00000-2.safetensors", "data-00000.safetensors"]
    for name in files:
        with safe_open(str(tmp_path / "ck" / name), framework="pt") as f:
            assert len(list(f.keys())) == 2
        with open(tmp_path / "ck" / name, "rb") as f:  # the data section starts on a page boundary
            assert (8 + int.from_bytes(f.read(8), "little")) % 4096 == 0
    assert distckpt.verify(tmp_path / "ck").items == 6
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    distckpt.load(out, checkpoint_id=tmp_path / "ck")
    assert all(torch.equal(out[k], sd[k]) for k in sd)


@pytest.mark.parametrize("name, make, says", [
    ("sparse", lambda: torch.eye(3).to_sparse(), "to_dense"),
    ("nested", lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "unbind"),
    ("quantized", lambda: torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8), "int_repr"),
    ("meta", lambda: torch.empty(3, device="meta"), "to_empty"),
    ("complex32", lambda: torch.zeros(3, dtype=torch.complex32), "convert the tensor"),
])
def test_a_tensor_with_no_stored_form_is_refused_by_key_and_nothing_is_written(tmp_path, name, make, says):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors warn that they are a prototype
        bad = make()
    with pytest.raises(distckpt.UnsupportedTensorError, match=rf"'weights\.{name}'.*{says}"):
        distckpt.save({"ok": torch.ones(2), f"weights.{name}": bad}, checkpoint_id=tmp_path / "ck")
    assert not (tmp_path / "ck" / "metadata.json").exists()


def test_loading_into_a_meta_tensor_is_refused_by_key(tmp_path):
    distckpt.save({"w": torch.ones(3)}, checkpoint_id=tmp_path / "ck")
    with pytest.raises(distckpt.UnsupportedTensorError, match=r"'w'.*meta device.*to_empty"):
        distckpt.load({"w": torch.empty(3, device="meta")}, checkpoint_id=tmp_path / "ck")


def test_conjugate_and_negative_views_save_and_load_their_values(tmp_path):
    # their memory holds the un-conjugated (un-negated) values: raw bytes would be the wrong numbers
    a = torch.randn(4, 3, dtype=torch.complex64)
    b = torch.randn(5)
    sd = {"conj": a.conj(), "neg": torch._neg_view(b), "plain": torch.arange(3.0)}
    assert sd["conj"].is_conj() and sd["conj"].is_contiguous() and sd["neg"].is_neg()
    distckpt.save(sd, checkpoint_id=tmp_path / "ck")
    out = {"conj": torch.zeros(4, 3, dtype=torch.complex64), "neg": torch.zeros(5), "plain": torch.zeros(3)}
    distckpt.load(out, checkpoint_id=tmp_path / "ck")
    assert torch.equal(out["conj"], a.conj().resolve_conj()) and torch.equal(out["neg"], -b)
    # and loading into such views sets the values they show
    base_c, base_n = torch.zeros(4, 3, dtype=torch.complex64), torch.zeros(5)
    into = {"conj": base_c.conj(), "neg": torch._neg_view(base_n), "plain": torch.zeros(3)}
    distckpt.load(into, checkpoint_id=tmp_path / "ck")
    assert torch.equal(into["conj"].resolve_conj(), a.conj().resolve_conj()) and torch.equal(base_c, a)
    assert torch.equal(into["neg"].resolve_neg(), -b) and torch.equal(base_n, b)


def test_odd_sized_items_do_not_misalign_the_items_after_them(tmp_path):
    # optimizer state interleaves 4-byte step counters with large tensors
    sd = {}
    for i in range(4):
        sd[f"state.{i}.step"] = torch.tensor(float(i))
        sd[f"state.{i}.exp_avg"] = torch.randn(64, 33)
        sd[f"state.{i}.note"] = torch.arange(3, dtype=torch.int16)  # 6 bytes
    md = distckpt.save(sd, checkpoint_id=tmp_path / "ck")
    offsets = {index.fqn: info.offset for index, info in md.storage_data.items.items()}
    assert all(offsets[f"state.{i}.exp_avg"] % 64 == 0 for i in range(4)), offsets
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    distckpt.load(out, checkpoint_id=tmp_path / "ck")
    assert all(torch.equal(out[k], sd[k]) for k in sd)


def test_metadata_returned_by_save_decodes_on_first_use_and_behaves_as_metadata(tmp_path):
    import copy
    import dataclasses

    from distckpt.format.codec import lazy_metadata

    distckpt.save({"w": torch.ones(4, 5), "step": 3}, checkpoint_id=tmp_path / "ck")
    raw = (tmp_path / "ck" / "metadata.json").read_bytes()
    read = distckpt.read_metadata(tmp_path / "ck")
    md = lazy_metadata(raw, "test")
    assert "_pending" in vars(md)  # nothing decoded yet
    assert md.state_dict_metadata == read.state_dict_metadata and "_pending" not in vars(md)
    assert isinstance(md, distckpt.metadata.Metadata)
    assert dataclasses.replace(lazy_metadata(raw, "test"), version="x").version == "x"
    assert copy.deepcopy(lazy_metadata(raw, "test")).storage_data.save_id == read.storage_data.save_id
    changed = lazy_metadata(raw, "test")
    changed.version = "9"  # a write decodes first, so it is not lost
    assert changed.version == "9" and changed.planner_data == read.planner_data
    with pytest.raises(distckpt.CorruptCheckpointError, match="checksum"):
        lazy_metadata(raw[:-12] + b'00000000"}\n', "test")


def test_dcp_older_call_form_takes_the_storage_by_position(tmp_path):
    path = str(tmp_path / "ck")
    with pytest.warns(FutureWarning, match="storage_writer"):
        distckpt.save({"w": torch.arange(4.0)}, distckpt.FileSystemWriter(path))
    out = {"w": torch.zeros(4)}
    with pytest.warns(FutureWarning, match="storage_reader"):
        distckpt.load(out, distckpt.FileSystemReader(path))
    assert torch.equal(out["w"], torch.arange(4.0))
    with pytest.raises(TypeError, match="at most one positional"):
        distckpt.load(out, distckpt.FileSystemReader(path), storage_reader=distckpt.FileSystemReader(path))


def test_each_load_has_a_load_id_that_planners_see(tmp_path):
    path = str(tmp_path / "ck")
    distckpt.save({"w": torch.ones(2)}, checkpoint_id=path)
    seen = []

    class Planner(distckpt.DefaultLoadPlanner):
        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            seen.append(metadata.storage_meta.load_id)
            super().set_up_planner(state_dict, metadata, is_coordinator)

    reader = distckpt.FileSystemReader(path)
    first = reader.load_id
    distckpt.load({"w": torch.zeros(2)}, checkpoint_id=path, storage_reader=reader, planner=Planner())
    distckpt.load({"w": torch.zeros(2)}, checkpoint_id=path, storage_reader=reader, planner=Planner())
    assert first and len(set(seen)) == 2 and seen[-1] == reader.load_id
