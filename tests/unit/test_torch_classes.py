"""torch.distributed.checkpoint's own classes passed to distckpt (as accelerate does): its default storage layers
and planners become distckpt's with their options; any other concrete class of DCP's is one clear TypeError."""

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

import distckpt


def _state(step):
    return {"model": {"w": torch.arange(12.0).reshape(3, 4) + step}, "step": step}


def test_dcps_default_classes_are_replaced_with_their_options(tmp_path):
    path = str(tmp_path / "ck")
    for step in (1, 2):  # DCP's writer overwrites by default, and keeps doing so here
        distckpt.save(_state(step), storage_writer=dcp.FileSystemWriter(path, thread_count=2),
                      planner=dcp.DefaultSavePlanner())
    assert json.load(open(os.path.join(path, "metadata.json")))["format"] == "distckpt"
    out = {"model": {"w": torch.zeros(3, 4)}, "step": 0}
    distckpt.load(out, storage_reader=dcp.FileSystemReader(path), planner=dcp.DefaultLoadPlanner())
    assert out["step"] == 2 and torch.equal(out["model"]["w"], _state(2)["model"]["w"])
    handle = distckpt.async_save(_state(3), storage_writer=dcp.FileSystemWriter(path), planner=dcp.DefaultSavePlanner())
    handle.result()
    with pytest.raises(distckpt.CheckpointError, match="already exists"):  # overwrite=False is kept too
        distckpt.save(_state(4), storage_writer=dcp.FileSystemWriter(path, overwrite=False))
    partial = {"model": {"w": torch.zeros(3, 4)}, "extra": torch.zeros(1)}
    distckpt.load(partial, storage_reader=dcp.FileSystemReader(path), planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(partial["model"]["w"], _state(3)["model"]["w"])


def test_dcps_reader_on_a_directory_dcp_wrote_reads_it(tmp_path):
    path = str(tmp_path / "dcp")
    dcp.save(_state(5), checkpoint_id=path, no_dist=True)
    out = {"model": {"w": torch.zeros(3, 4)}, "step": 0}
    distckpt.load(out, storage_reader=dcp.FileSystemReader(path))
    assert out["step"] == 5 and torch.equal(out["model"]["w"], _state(5)["model"]["w"])


def test_other_dcp_classes_are_one_type_error_naming_the_replacement(tmp_path):
    class MyPlanner(dcp.DefaultSavePlanner):
        pass

    with pytest.raises(TypeError, match="subclass distckpt.DefaultSavePlanner instead"):
        distckpt.save(_state(1), checkpoint_id=str(tmp_path / "a"), planner=MyPlanner())
    with pytest.raises(TypeError, match="_EmptyStateDictLoadPlanner from torch.distributed.checkpoint"):
        distckpt.load({}, checkpoint_id=str(tmp_path / "a"), planner=_EmptyStateDictLoadPlanner())
    assert not os.path.exists(tmp_path / "a")  # refused before anything was written


class _MyWriter(dcp.StorageWriter):
    """A storage layer written against DCP's abstract base: the protocol, used as it is."""

    def reset(self, checkpoint_id=None):
        self.results = None

    def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
        pass

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def write_data(self, plan, planner):
        fut = torch.futures.Future()
        fut.set_result([])
        return fut

    def finish(self, metadata, results):
        self.results = results

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return True


def test_a_class_written_against_dcps_abstract_bases_is_used_as_is():
    writer = _MyWriter()
    distckpt.save({"w": torch.ones(2)}, storage_writer=writer)
    assert writer.results == [[]]
