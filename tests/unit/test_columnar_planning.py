"""The column path of global save planning gives exactly what the object path gives."""

import copy
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import distckpt
from distckpt.engine.commit import columns_document
from distckpt.format.codec import encode_metadata, parse_metadata
from distckpt.format.records import FileInfo, FileResult, FileStorageData, StorageInfo
from distckpt.metadata import ChunkStorageMetadata, MetadataIndex, StorageMeta, TensorProperties
from distckpt.planner import BytesIOWriteData, SavePlan, TensorWriteData, WriteItem, WriteItemType
from distckpt.planning.columnar import Declined, plan_columns, to_metadata
from distckpt.storage import WriteResult
from distckpt.wire.columns import (
    decode_keep,
    decode_plan_columns,
    decode_result_columns,
    encode_keep,
    encode_plan_columns,
    encode_result_columns,
)

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64]


def _tensor(fqn, offsets, sizes, glob, dtype, kind=WriteItemType.SHARD, requires_grad=False):
    chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
    props = TensorProperties(dtype, requires_grad=requires_grad)
    return WriteItem(MetadataIndex(fqn, offsets), kind, tensor_data=TensorWriteData(chunk, props, torch.Size(glob)))


def _value(fqn, nbytes):
    return WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO, BytesIOWriteData(nbytes))


def random_plans(seed: int, world: int) -> list[SavePlan]:
    """Local plans of a job: replicated tensors and values, 1-D/2-D/3-D shards split over all
    ranks or over groups of ranks (replicated shards), rank-local keys, 0-d and empty tensors."""
    rng = random.Random(seed)
    items = [[] for _ in range(world)]
    for k in range(rng.randint(1, 12)):
        dtype = rng.choice(DTYPES)
        kind = rng.randrange(6)
        if kind == 0:  # a plain tensor held by every rank
            shape = [rng.randint(0, 5) for _ in range(rng.randint(0, 3))]
            for r in range(world):
                items[r].append(_tensor(f"rep{k}", [0] * len(shape), shape, shape, dtype, WriteItemType.TENSOR))
        elif kind == 1:  # a value on every rank, the encoded length may differ
            for r in range(world):
                items[r].append(_value(f"val{k}", rng.randint(1, 40)))
        elif kind == 2:  # a rank-local key
            r = rng.randrange(world)
            items[r].append(_tensor(f"local{k}@rank{r}", [0], [3], [3], dtype, WriteItemType.TENSOR))
        else:  # sharded over `parts` groups of ranks along dim `dim` of an `nd`-D tensor
            nd = rng.randint(1, 3)
            dim = rng.randrange(nd)
            parts = rng.choice([p for p in range(1, world + 1) if world % p == 0])
            shape = [rng.randint(1, 4) for _ in range(nd)]
            shape[dim] = parts * rng.randint(1, 3)
            step = shape[dim] // parts
            for r in range(world):
                p = r % parts
                off = [0] * nd
                off[dim] = p * step
                size = list(shape)
                size[dim] = step
                items[r].append(_tensor(f"layers.{k}.w", off, size, shape, dtype))
    plans = []
    for r in range(world):
        rng.shuffle(items[r])
        plans.append(SavePlan(items[r], planner_data={it.index.fqn: ("m", it.index.fqn) for it in items[r]}))
    return plans


def _results(plans: list[SavePlan], save_id: str, coded: bool = False) -> list[list[WriteResult]]:
    """Results as a writer would report them; with ``coded``, every third item stored through a codec (in
    fewer bytes than planned, as a compressing codec stores them)."""
    out = []
    for r, plan in enumerate(plans):
        files = [f"data-{r:05d}.safetensors", f"data-{r:05d}-1.safetensors"]
        res, pos = [], [64, 64]
        for i, it in enumerate(plan.items):
            n = it.bytes_io_data.nbytes if it.bytes_io_data else (
                torch.Size(it.tensor_data.chunk.sizes).numel() * it.tensor_data.properties.dtype.itemsize)
            f = i % 2
            codec = "zstd" if coded and i % 3 == 0 else "identity"
            n = n // 2 + 1 if codec != "identity" else n
            res.append(WriteResult(it.index, n, StorageInfo(files[f], pos[f], n, (r * 7919 + i * 104729) & 0xFFFFFFFF, codec)))
            pos[f] += n
        res += [FileResult.of(name, FileInfo(size, r, 1234 + r)) for name, size in zip(files, pos)]
        out.append(res)
    return out


def _object_document(plans, save_id, coded=False):
    planner = distckpt.DefaultSavePlanner()
    final, md = planner.create_global_plan(copy.deepcopy(plans))
    fsd = FileStorageData(save_id)
    for rank_results in _results(final, save_id, coded):
        for res in rank_results:
            if isinstance(res, FileResult):
                fsd.files[res.file] = res.storage_data
            else:
                fsd.items[res.index] = res.storage_data
    md.storage_data = fsd
    md.storage_meta = StorageMeta(checkpoint_id="/ck", save_id=save_id)
    return final, md, encode_metadata(md)


def _columnar(plans, save_id, coded=False):
    cols = [decode_plan_columns(encode_plan_columns(p)) for p in plans]
    cp = plan_columns(cols)
    central = [decode_keep(encode_keep(keep, {"file": r}), p) for r, (keep, p) in enumerate(zip(cp.keep, plans))]
    results = [decode_result_columns(encode_result_columns(res, plan))
               for res, plan in zip(_results(central, save_id, coded), central)]
    return cp, central, columns_document(cp, results, save_id, "/ck")


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), world=st.integers(1, 6), coded=st.booleans())
def test_column_planning_equals_object_planning(seed, world, coded):
    plans = random_plans(seed, world)
    for p in plans:
        assert decode_plan_columns(encode_plan_columns(p)).to_plan() == p
    final, md, doc = _object_document(plans, "s" * 32, coded)
    cp, central, fast_doc = _columnar(plans, "s" * 32, coded)
    assert [c.items for c in central] == [f.items for f in final]
    assert fast_doc == doc
    want = to_metadata(cp)
    assert want.state_dict_metadata == md.state_dict_metadata and want.planner_data == md.planner_data
    assert parse_metadata(fast_doc, "test").state_dict_metadata == md.state_dict_metadata


def _declines(plans):
    with pytest.raises(Declined):
        plan_columns([decode_plan_columns(encode_plan_columns(p)) for p in plans])
    with pytest.raises(distckpt.CheckpointError):
        distckpt.DefaultSavePlanner().create_global_plan(plans)


def test_disagreements_are_left_to_the_object_path_which_names_them():
    f32 = torch.float32
    _declines([SavePlan([_tensor("w", [0], [4], [4], f32, WriteItemType.TENSOR)]),
               SavePlan([_tensor("w", [0], [5], [5], f32, WriteItemType.TENSOR)])])  # replicas of other sizes
    _declines([SavePlan([_tensor("w", [0], [4], [4], f32)]), SavePlan([_tensor("w", [0], [4], [4], torch.int64)])])
    _declines([SavePlan([_tensor("w", [0], [2], [4], f32)]), SavePlan([_tensor("w", [0], [2], [4], f32)])])  # a shard missing
    _declines([SavePlan([_tensor("w", [0], [4], [4], f32)]), SavePlan([_value("w", 3)])])


def test_irregular_plans_are_sent_as_objects():
    item = _tensor("w", [0], [4], [4], torch.float32)
    assert encode_plan_columns(SavePlan([item], planner_data={1: "not str keys"})) is None
    hinted = WriteItem(MetadataIndex("w", [0], index=3), item.type, tensor_data=item.tensor_data)
    assert encode_plan_columns(SavePlan([hinted])) is None
    other = WriteItem(MetadataIndex("w", [1]), item.type, tensor_data=item.tensor_data)  # index and chunk disagree
    assert encode_plan_columns(SavePlan([other])) is None
