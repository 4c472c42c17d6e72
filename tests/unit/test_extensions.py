"""The extension patterns of the protocol's docstrings, written against distckpt."""

from dataclasses import replace
from typing import Optional

import torch

import distckpt
from distckpt import DefaultLoadPlanner, DefaultSavePlanner
from distckpt.format.values import decode_value
from distckpt.metadata import STATE_DICT_TYPE, StorageMeta
from distckpt.planner import SavePlan, WriteItemType
from distckpt.planning import flatten_state_dict


class RenameSavePlanner(DefaultSavePlanner):
    def set_up_planner(self, state_dict: STATE_DICT_TYPE, storage_meta: Optional[StorageMeta] = None, is_coordinator: bool = False) -> None:
        super().set_up_planner({"foo_" + k: v for k, v in state_dict.items()}, storage_meta, is_coordinator)


class RenameLoadPlanner(DefaultLoadPlanner):
    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        self.original_state_dict = state_dict
        state_dict = {"foo_" + k: v for k, v in state_dict.items()}
        if self.flatten_state_dict:
            state_dict, self.mappings = flatten_state_dict(state_dict)
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def load_bytes(self, read_item, value):
        self.original_state_dict[read_item.dest_index.fqn[4:]] = decode_value(value.getvalue())


def test_rename_planners(tmp_path):
    distckpt.save({"w": torch.arange(4.0), "step": 3}, checkpoint_id=tmp_path / "ck", planner=RenameSavePlanner())
    assert set(distckpt.read_metadata(tmp_path / "ck").state_dict_metadata) == {"foo_w", "foo_step"}
    out = {"w": torch.zeros(4), "step": 0}
    distckpt.load(out, checkpoint_id=tmp_path / "ck", planner=RenameLoadPlanner())
    assert torch.equal(out["w"], torch.arange(4.0)) and out["step"] == 3


class FP16Planner(DefaultSavePlanner):
    def create_local_plan(self):
        plan = super().create_local_plan()
        for p in plan.items:
            if p.tensor_data is not None:
                p.tensor_data.properties.dtype = torch.float16
        return plan

    def resolve_data(self, write_item):
        item = super().resolve_data(write_item)
        return item if write_item.type == WriteItemType.BYTE_IO else item.to(torch.float16)


def test_fp16_planner(tmp_path):
    w = torch.randn(8, 8)
    distckpt.save({"w": w, "note": "half"}, checkpoint_id=tmp_path / "ck", planner=FP16Planner())
    md = distckpt.read_metadata(tmp_path / "ck")
    assert md.state_dict_metadata["w"].properties.dtype == torch.float16
    half = {"w": torch.zeros(8, 8, dtype=torch.float16)}
    distckpt.load(half, checkpoint_id=tmp_path / "ck", planner=DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(half["w"], w.half())
    full = {"w": torch.zeros(8, 8)}
    distckpt.load(full, checkpoint_id=tmp_path / "ck", planner=DefaultLoadPlanner(allow_dtype_conversion=True))
    assert torch.equal(full["w"], w.half().float())


class SaveExtraDataPlanner(DefaultSavePlanner):
    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        return replace(plan, planner_data="per-rank-data")

    def create_global_plan(self, all_plans):
        global_plan, metadata = super().create_global_plan(all_plans)
        merged_data = [p.planner_data for p in global_plan]
        metadata = replace(metadata, planner_data=merged_data)
        return global_plan, metadata


def test_extra_planner_data_is_merged_into_metadata(tmp_path):
    distckpt.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "ck", planner=SaveExtraDataPlanner())
    assert distckpt.read_metadata(tmp_path / "ck").planner_data == ["per-rank-data"]


class MetaModelMaterialize(DefaultLoadPlanner):
    def resolve_tensor(self, read_item):
        tensor = super().resolve_tensor(read_item)
        return torch.empty_like(tensor, device="cpu")

    def commit_tensor(self, read_item, tensor):
        self.state_dict[read_item.dest_index.fqn] = tensor


def test_meta_model_materialisation(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    distckpt.save({"model": model}, checkpoint_id=tmp_path / "ck")
    with torch.device("meta"):
        meta_model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    sd = meta_model.state_dict()
    planner = MetaModelMaterialize()
    distckpt.load({"model": sd}, checkpoint_id=tmp_path / "ck", planner=planner)
    materialised = {k[len("model."):]: v for k, v in planner.state_dict.items()}
    meta_model.load_state_dict(materialised, assign=True)
    for (n, a), (_, b) in zip(model.state_dict().items(), meta_model.state_dict().items()):
        assert b.device.type == "cpu" and torch.equal(a, b), n


def test_read_items_without_or_with_stale_chunk_hints_load_the_right_chunks():
    # a planner may name stored chunks by key and offsets alone, or carry a stale ``index`` hint:
    # the read engine then finds each chunk by its offsets (2 ranks' chunks, loaded at 1 rank)
    import os

    from distckpt.metadata import MetadataIndex

    from ..golden.expected import sharded_full

    class HintlessLoadPlanner(DefaultLoadPlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            items = []
            for n, item in enumerate(plan.items):
                ix = item.storage_index
                if ix.offset is not None:
                    hint = None if n % 2 else (ix.index + 1) % 2  # none, or the other chunk's position
                    item = replace(item, storage_index=MetadataIndex(ix.fqn, ix.offset, hint))
                items.append(item)
            self.plan = replace(plan, items=items)
            return self.plan

    path = os.path.join(os.path.dirname(__file__), "..", "golden", "v2.0", "sharded-2ranks")
    want = sharded_full()
    for planner in (DefaultLoadPlanner(), HintlessLoadPlanner()):
        out = {k: torch.zeros_like(v) for k, v in want.items()}
        out["step"] = 0
        distckpt.load(out, checkpoint_id=path, planner=planner)
        assert out.pop("step") == 7
        assert all(torch.equal(out[k], want[k]) for k in want)
