"""Checkpoints that torch.distributed.checkpoint wrote load with distckpt.load as they are, at another world
size, through a restricted unpickler: DCP's metadata classes and torch's plain types only."""

import os
import pickle

import pytest
import torch

import distckpt
from distckpt.testing import run_ranks

from . import dcp_written as d


def test_a_dcp_checkpoint_of_two_ranks_loads_at_three_and_at_one(tmp_path):
    path = str(tmp_path / "dcp")
    run_ranks(d.dcp_save, 2, path)
    assert os.path.isfile(os.path.join(path, ".metadata"))
    assert run_ranks(d.distckpt_load, 3, path) == [True] * 3
    out = {"model": {"w": torch.zeros(12, 6)}, "step": 0}
    distckpt.load(out, checkpoint_id=path, planner=distckpt.DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(out["model"]["w"], d.FULL) and out["step"] == 11
    md = distckpt.read_metadata(path)
    assert len(md.state_dict_metadata["model.w"].chunks) == 2
    assert md.state_dict_metadata["model.w"].properties.dtype == torch.float32
    with pytest.raises(distckpt.CheckpointError, match="DCPReader"):  # the reader of distckpt's format says which to use
        distckpt.load(out, storage_reader=distckpt.FileSystemReader(path))
    out = {"model": {"b": torch.zeros(5)}}
    distckpt.load(out, storage_reader=distckpt.DCPReader(path), planner=distckpt.DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(out["model"]["b"], torch.arange(5.0))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_dcp_checkpoint_compressed_with_zstd_loads_bit_exact(tmp_path, world):
    path = str(tmp_path / "dcp")
    run_ranks(d.dcp_save, 2, path, False, True)
    md = distckpt.read_metadata(path)
    assert md.storage_data.items[distckpt.metadata.MetadataIndex("model.b", [0])].codec == "torch.save|stream.zstd/1"
    assert run_ranks(d.distckpt_load, world, path) == [True] * world


def test_an_object_value_needs_allow_pickle(tmp_path):
    path = str(tmp_path / "dcp")
    run_ranks(d.dcp_save, 1, path, True)
    with pytest.raises(distckpt.UnsafeValueError, match="allow_pickle=True"):
        distckpt.load({"obj": None}, checkpoint_id=path, planner=distckpt.DefaultLoadPlanner(allow_partial_load=True))
    out = {"obj": None}
    distckpt.load(out, checkpoint_id=path, planner=distckpt.DefaultLoadPlanner(allow_partial_load=True, allow_pickle=True))
    assert isinstance(out["obj"], d.Opaque) and out["obj"].n == 4


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_metadata_naming_any_other_global_is_refused_without_running_it(tmp_path):
    path = tmp_path / "dcp"
    path.mkdir()
    (path / ".metadata").write_bytes(pickle.dumps(_Payload()))
    with pytest.raises(distckpt.CorruptCheckpointError, match="posix.system|os.system|not part of DCP's metadata"):
        distckpt.load({"w": torch.zeros(1)}, checkpoint_id=str(path))


def test_a_metadata_file_that_is_a_symlink_is_not_followed(tmp_path):
    run_ranks(d.dcp_save, 1, str(tmp_path / "real"))
    path = tmp_path / "linked"
    path.mkdir()
    os.symlink(tmp_path / "real" / ".metadata", path / ".metadata")
    with pytest.raises(distckpt.CheckpointError):
        distckpt.load({"step": 0}, checkpoint_id=str(path))
