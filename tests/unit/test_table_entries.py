"""state_dict_metadata of a format-3.0 checkpoint: entries of the table of whole tensors built when asked for."""

import copy
import pickle
import shutil

import pytest
import torch

import distckpt
from distckpt.errors import DTypeMismatchError, MissingKeyError
from distckpt.format.codec import parse_metadata
from distckpt.format.tensor_table import TableEntries, TensorTable, stored_dtypes, table_of
from tests.security.helpers import read_body, write_body

STATE = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16), "n": 7,
         "s": torch.tensor(3, dtype=torch.int64)}


@pytest.fixture
def saved(tmp_path):
    path = str(tmp_path / "ck")
    distckpt.save(STATE, checkpoint_id=path)
    return path


def test_entries_equal_those_of_the_per_key_form(saved, tmp_path):
    sdm = distckpt.read_metadata(saved).state_dict_metadata
    assert type(sdm) is TableEntries and list(sdm) == ["a", "b", "s", "n"]  # the table's keys first
    per_key = str(tmp_path / "per-key")
    shutil.copytree(saved, per_key)
    body = read_body(per_key)  # the table written out as one entry per key, a form readers also take
    body["format_version"] = "2.0"
    write_body(per_key, body)
    plain = distckpt.read_metadata(per_key).state_dict_metadata
    assert type(plain) is dict
    assert sdm == plain and plain == sdm and dict(sdm) == plain
    assert pickle.loads(pickle.dumps(sdm)) == plain and copy.deepcopy(sdm) == plain
    assert stored_dtypes(sdm, ["b", "a"]) == stored_dtypes(plain, ["b", "a"]) == [torch.bfloat16, torch.float32]


def test_an_entry_handed_out_is_the_key_s_entry_from_then_on(saved):
    md = distckpt.read_metadata(saved)
    sdm = md.state_dict_metadata
    entry = sdm["a"]
    assert sdm["a"] is entry and "a" in sdm.built
    entry.properties.dtype = torch.float64  # a planner may change what it was given, in place
    assert stored_dtypes(sdm, ["a", "b"]) == [torch.float64, torch.bfloat16]


class _Float64Planner(distckpt.DefaultLoadPlanner):
    """A planner that edits the metadata it is given, as the protocol allows."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        metadata.state_dict_metadata["a"].properties.dtype = torch.float64
        super().set_up_planner(state_dict, metadata, is_coordinator)


class _DroppingPlanner(distckpt.DefaultLoadPlanner):
    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        del metadata.state_dict_metadata["a"]
        super().set_up_planner(state_dict, metadata, is_coordinator)


def test_the_default_planner_sees_edits_to_the_metadata(saved):
    dest = {"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16), "n": 0, "s": torch.tensor(0)}
    with pytest.raises(DTypeMismatchError, match="'a'"):
        distckpt.load(dest, checkpoint_id=saved, planner=_Float64Planner())
    with pytest.raises(MissingKeyError, match="'a'"):
        distckpt.load(dest, checkpoint_id=saved, planner=_DroppingPlanner())
    distckpt.load(dest, checkpoint_id=saved)
    assert torch.equal(dest["a"], STATE["a"]) and dest["n"] == 7 and torch.equal(dest["b"], STATE["b"])


def test_mutations_keep_order_and_membership():
    table = TensorTable(["x", "y"], [(torch.float32, torch.strided, False, torch.contiguous_format, False)], [0, 0],
                        [1, 2], [0, 1], [3, 2, 2], 0)
    sdm = TableEntries(table, {"v": "value"})
    assert list(sdm) == ["x", "y", "v"] and len(sdm) == 3 and table_of(sdm) is table
    assert sdm["y"].size == torch.Size([2, 2]) and sdm["x"].chunks[0].sizes == torch.Size([3])
    sdm["z"] = "new"
    del sdm["x"]
    assert list(sdm) == ["y", "v", "z"] and "x" not in sdm and "z" in sdm
    with pytest.raises(KeyError):
        sdm["x"]
    assert stored_dtypes(sdm, ["y"]) == [torch.float32]
    sdm["y"] = "replaced"
    assert sdm["y"] == "replaced" and table_of(sdm) is table


def test_a_document_with_a_table_parses_to_table_entries(saved):
    raw = open(f"{saved}/metadata.json", "rb").read()
    md = parse_metadata(raw, "here")
    assert table_of(md.state_dict_metadata) is not None and md.version == "3.0"
