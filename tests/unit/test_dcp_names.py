"""Code written for torch.distributed.checkpoint runs after its imports name distckpt: the module and function
names, DCP's key phrases in errors, and the switch that lets a second save replace a checkpoint."""

import importlib

import pytest
import torch

import distckpt
from distckpt._dedup_save_plans import dedup_save_plans
from distckpt.default_planner import (
    _create_default_local_metadata,
    _validate_global_plan,
    create_default_global_load_plan,
    create_default_global_save_plan,
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from distckpt.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata
from distckpt.planner import SavePlan
from distckpt.planner_helpers import _compare_save_plans, _merge_delta_local_plans, create_read_items_for_chunk_list


@pytest.mark.parametrize("module,names", [
    ("distckpt", ["save", "load", "async_save", "save_state_dict", "load_state_dict", "CheckpointException",
                  "FileSystemReader", "FileSystemWriter", "DefaultSavePlanner", "DefaultLoadPlanner", "Metadata",
                  "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "SavePlan", "LoadPlan",
                  "SavePlanner", "LoadPlanner", "ReadItem", "WriteItem", "StorageReader", "StorageWriter"]),
    ("distckpt.api", ["CheckpointException"]),
    ("distckpt.filesystem", ["FileSystemReader", "FileSystemWriter", "CURRENT_DCP_VERSION"]),
    ("distckpt._extension", ["ZStandard", "StreamTransformExtension", "ExtensionRegistry", "Extension"]),
    ("distckpt._dedup_save_plans", ["dedup_save_plans"]),
    ("distckpt.planner_helpers", ["create_read_items_for_chunk_list", "_compare_save_plans", "_merge_delta_local_plans"]),
    ("distckpt.state_dict_saver", ["save", "save_state_dict", "async_save"]),
    ("distckpt.state_dict_loader", ["load", "load_state_dict"]),
    ("distckpt.default_planner", ["DefaultSavePlanner", "DefaultLoadPlanner", "create_default_local_save_plan"]),
    ("distckpt.metadata", ["Metadata", "MetadataIndex", "StorageMeta", "TensorProperties"]),
    ("distckpt.planner", ["SavePlan", "LoadPlan", "WriteItemType", "LoadItemType"]),
    ("distckpt.storage", ["StorageReader", "StorageWriter", "WriteResult"]),
])
def test_dcp_module_names_resolve(module, names):
    mod = importlib.import_module(module)
    for name in names:
        assert getattr(mod, name) is not None, f"{module}.{name}"
    assert distckpt.CheckpointException is distckpt.RankFailuresError


def test_deprecated_state_dict_calls_take_dcp_argument_order(tmp_path):
    sd = {"w": torch.arange(6.0), "n": 3}
    with pytest.warns(FutureWarning, match="save_state_dict"):
        distckpt.save_state_dict(sd, distckpt.FileSystemWriter(tmp_path / "ck"))
    out = {"w": torch.zeros(6), "n": 0}
    with pytest.warns(FutureWarning, match="load_state_dict"):
        distckpt.load_state_dict(out, distckpt.FileSystemReader(tmp_path / "ck"), no_dist=True)
    assert torch.equal(out["w"], sd["w"]) and out["n"] == 3


def test_plan_helpers_make_the_default_planners_plans():
    sd = {"a": torch.ones(4, 2), "b": [1, 2]}
    plan = create_default_local_save_plan(sd, True)
    assert {i.index.fqn for i in plan.items} == {"a", "b"}
    plans, md = create_default_global_save_plan([plan])
    assert md.state_dict_metadata["a"].size == torch.Size([4, 2])
    assert [i.index.index for i in plans[0].items if i.index.fqn == "a"] == [0]
    assert _create_default_local_metadata(sd).state_dict_metadata.keys() == {"a", "b"}
    load_plan = create_default_local_load_plan({"a": torch.zeros(4, 2)}, md)
    assert [r.dest_index.fqn for r in load_plan.items] == ["a"]
    assert create_default_global_load_plan([load_plan]) == [load_plan]
    with pytest.raises(distckpt.MissingKeyError, match="Missing key in checkpoint"):
        create_default_local_load_plan({"zz": torch.zeros(1)}, md)
    assert create_default_local_load_plan({"zz": torch.zeros(1)}, md, strict=False).items == []


def test_errors_carry_dcps_phrases(tmp_path):
    distckpt.save({"w": torch.ones(4)}, checkpoint_id=tmp_path / "ck")
    with pytest.raises(distckpt.MissingKeyError, match="Missing key in checkpoint state_dict: 'v'.*allow_partial_load"):
        distckpt.load({"v": torch.zeros(4)}, checkpoint_id=tmp_path / "ck")
    with pytest.raises(distckpt.ShapeMismatchError, match=r"Size mismatch between saved \[4\] and current: \[5\] for key 'w'"):
        distckpt.load({"w": torch.zeros(5)}, checkpoint_id=tmp_path / "ck")


def test_a_second_save_to_one_path_replaces_it_only_when_switched_on(tmp_path, monkeypatch):
    path = tmp_path / "ck"
    distckpt.save({"w": torch.ones(3)}, checkpoint_id=path)
    with pytest.raises(distckpt.CheckpointError, match="Checkpoint already exists.*DISTCKPT_OVERWRITE=1"):  # DCP's phrase
        distckpt.save({"w": torch.full((3,), 2.0)}, checkpoint_id=path)
    monkeypatch.setenv("DISTCKPT_OVERWRITE", "1")
    distckpt.save({"w": torch.full((3,), 2.0)}, checkpoint_id=path)
    distckpt.save({"w": torch.full((3,), 3.0)}, storage_writer=distckpt.FileSystemWriter(path))
    out = {"w": torch.zeros(3)}
    distckpt.load(out, checkpoint_id=path)
    assert out["w"].tolist() == [3.0] * 3
    # a writer told not to replace keeps its word, and the manager never replaces a committed step
    with pytest.raises(distckpt.CheckpointError, match="already exists"):
        distckpt.save({"w": torch.zeros(3)}, storage_writer=distckpt.FileSystemWriter(path, overwrite=False))
    manager = distckpt.CheckpointManager(str(tmp_path / "run"))
    manager.save(1, {"w": torch.ones(2)})
    with pytest.raises(distckpt.CheckpointError):
        manager.save(1, {"w": torch.zeros(2)})
    out = {"w": torch.zeros(2)}
    manager.load(out, step=1)
    assert out["w"].tolist() == [1.0, 1.0]


def test_dcp_to_torch_save_nests_keys_again_for_our_checkpoints_and_dcps(tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp

    from distckpt.format_utils import dcp_to_torch_save, torch_save_to_dcp

    sd = {"model": {"w": torch.arange(4.0), "layers": [torch.ones(2), torch.zeros(3)]}, "step": 5}
    distckpt.save(sd, checkpoint_id=tmp_path / "ours")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(tmp_path / "dcps"), no_dist=True)
    for name in ("ours", "dcps"):
        dcp_to_torch_save(tmp_path / name, tmp_path / f"{name}.pt")
        back = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        assert back.keys() == {"model", "step"} and back["step"] == 5, name
        assert torch.equal(back["model"]["w"], sd["model"]["w"]), name
        assert [t.tolist() for t in back["model"]["layers"]] == [[1.0, 1.0], [0.0, 0.0, 0.0]], name
    torch_save_to_dcp(tmp_path / "ours.pt", tmp_path / "again")
    out = {"model": {"w": torch.zeros(4), "layers": [torch.zeros(2), torch.ones(3)]}, "step": 0}
    distckpt.load(out, checkpoint_id=tmp_path / "again")
    assert torch.equal(out["model"]["w"], sd["model"]["w"]) and out["step"] == 5


def test_dcps_file_system_options_are_taken_and_non_transforms_refused_by_name(tmp_path):
    writer = distckpt.FileSystemWriter(tmp_path / "ck", single_file_per_rank=False, per_thread_copy_ahead=1 << 20,
                                       cache_staged_state_dict=True, thread_count=2)
    distckpt.save({"w": torch.ones(3)}, storage_writer=writer)
    out = {"w": torch.zeros(3)}
    distckpt.load(out, storage_reader=distckpt.FileSystemReader(tmp_path / "ck", _extension_registry=None))
    assert out["w"].tolist() == [1.0] * 3

    class Compressor:  # no transform_to / transform_from / get_descriptor
        pass

    with pytest.raises(distckpt.CheckpointError, match="extension Compressor is not a stream transform"):
        distckpt.FileSystemWriter(tmp_path / "z", _extensions=[Compressor()])


def _box(offsets, sizes):
    return ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))


def test_dcps_plan_helpers():
    md = TensorStorageMetadata(TensorProperties(torch.float32), torch.Size([16, 2]), [_box([0, 0], [8, 2]), _box([8, 0], [8, 2])])
    reads = create_read_items_for_chunk_list("foo", md, [_box([4, 1], [7, 1])])
    assert [(r.storage_index, tuple(r.storage_offsets), r.dest_index, tuple(r.dest_offsets), tuple(r.lengths)) for r in reads] == [
        (MetadataIndex("foo", [0, 0]), (4, 1), MetadataIndex("foo", [4, 1]), (0, 0), (4, 1)),
        (MetadataIndex("foo", [8, 0]), (0, 1), MetadataIndex("foo", [4, 1]), (4, 0), (3, 1))]
    assert _validate_global_plan([SavePlan([])], Metadata({"w": md}))
    overlapping = TensorStorageMetadata(TensorProperties(torch.float32), torch.Size([4]), [_box([0], [2]), _box([1], [2])])
    assert not _validate_global_plan([SavePlan([])], Metadata({"w": overlapping}))

    plans = [create_default_local_save_plan({"rep": torch.ones(4), "big": torch.ones(64)}, r == 0) for r in range(3)]
    for lowest in (False, True):
        deduped = dedup_save_plans(plans, save_to_lowest_rank=lowest)
        holders = [r for r, p in enumerate(deduped) if any(i.index.fqn == "rep" for i in p.items)]
        big = [r for r, p in enumerate(deduped) if any(i.index.fqn == "big" for i in p.items)]
        assert len(holders) == 1 and len(big) == 1 and (holders == big == [0] if lowest else holders != big)
    assert _compare_save_plans(plans[0], plans[0]) and not _compare_save_plans(plans[0], deduped[1])
    merged = _merge_delta_local_plans(plans[:2], [SavePlan([], usable=False), deduped[1]])
    assert merged[0] is plans[0] and merged[1] is deduped[1]


def test_dcp_utils_find_the_object_an_index_names():
    from distckpt.errors import StateDictLookupError
    from distckpt.utils import find_state_dict_object

    state = {"a": torch.arange(4.0), "b": 3}
    assert find_state_dict_object(state, MetadataIndex("a")) is state["a"]
    assert find_state_dict_object(state, MetadataIndex("a", [0])) is state["a"]
    assert find_state_dict_object(state, MetadataIndex("a", index=99)) is state["a"]
    assert find_state_dict_object(state, MetadataIndex("b", index=1)) == 3
    with pytest.raises(ValueError, match="FQN: 'c'"):  # DCP's type and phrase, and ours
        find_state_dict_object(state, MetadataIndex("c"))
    with pytest.raises(StateDictLookupError, match="not a ShardedTensor"):
        find_state_dict_object(state, MetadataIndex("b", [1]))
    with pytest.raises(StateDictLookupError, match="not a ShardedTensor"):
        find_state_dict_object(state, MetadataIndex("a", [2]))


def test_a_bytesio_value_saves_as_its_bytes_and_loads_as_a_bytesio(tmp_path):
    import io

    buf = io.BytesIO()
    torch.save([0.5, 0.25], buf)  # what DCP's own tests keep in a train state: opaque bytes, no pickle needed by us
    distckpt.save({"losses": buf, "w": torch.ones(2)}, checkpoint_id=tmp_path / "ck")
    out = {"losses": io.BytesIO(), "w": torch.zeros(2)}
    distckpt.load(out, checkpoint_id=tmp_path / "ck")
    assert isinstance(out["losses"], io.BytesIO) and out["losses"].tell() == 0
    assert out["losses"].getvalue() == buf.getvalue()
