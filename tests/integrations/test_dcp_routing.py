"""route_dcp_calls: a routed save replaces a checkpoint torch's DCP wrote before in the same folder (atomically,
deleting only DCP's own files, never following a link); nested routings each hold their own overwrite setting
for their block; and routing tells what it routed (a log line, counts)."""

import logging
import os
import warnings

import pytest
import torch.distributed.checkpoint as dcp

import distckpt
from distckpt import faults
from distckpt.integrations import dcp_routing
from distckpt.integrations.dcp_routing import route_dcp_calls, routed_calls
from distckpt.testing.states import assert_same, blank_like, seeded

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

DCP_SAVE = dcp.save


def _state(seed):
    state = seeded({"layer.w": (8, 5), "layer.b": (5,)}, seed=seed)
    state["step"] = seed
    return state


def _dcp_wrote(path, seed=1):
    """A checkpoint written by torch's own DCP (not routed) at ``path``; its files' bytes."""
    assert dcp.save is DCP_SAVE
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(_state(seed), checkpoint_id=str(path), no_dist=True)
    files = {n: (path / n).read_bytes() for n in os.listdir(path)}
    assert ".metadata" in files and any(n.endswith(".distcp") for n in files) and "metadata.json" not in files
    return files


def _dcp_still_loads(path, seed=1):
    got = blank_like(_state(seed))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(got, checkpoint_id=str(path), no_dist=True)
    assert_same(got, _state(seed))


def _unchanged(path, files):
    assert {n: (path / n).read_bytes() for n in os.listdir(path)} == files


def _hidden_leftovers(parent):
    return [n for n in os.listdir(parent) if n.startswith(".")]


def test_a_routed_save_replaces_a_checkpoint_dcp_wrote_and_loads_bit_exact(tmp_path):
    d = tmp_path / "ckpt"
    _dcp_wrote(d)
    with route_dcp_calls():
        dcp.save(_state(2), checkpoint_id=str(d))
    names = sorted(os.listdir(d))
    assert "metadata.json" in names and not [n for n in names if n == ".metadata" or n.endswith(".distcp")]
    assert _hidden_leftovers(tmp_path) == []  # the replaced DCP checkpoint is gone, not parked
    got = blank_like(_state(2))
    distckpt.load(got, checkpoint_id=d)
    assert_same(got, _state(2))
    assert distckpt.verify(d).ok


def test_overwrite_false_refuses_a_dcp_checkpoint_with_a_typed_error_and_leaves_it(tmp_path):
    d = tmp_path / "ckpt"
    files = _dcp_wrote(d)
    with route_dcp_calls(overwrite=False):
        with pytest.raises(distckpt.CheckpointError, match=r"torch.distributed.checkpoint wrote.*overwrite=True"):
            dcp.save(_state(2), checkpoint_id=str(d))
    with pytest.raises(distckpt.CheckpointError, match="torch.distributed.checkpoint wrote"):
        distckpt.save(_state(2), checkpoint_id=d)  # distckpt's own default, outside any routing
    _unchanged(d, files)
    _dcp_still_loads(d)


def test_the_dcp_checkpoint_survives_a_routed_save_that_fails_before_commit(tmp_path):
    d = tmp_path / "ckpt"
    files = _dcp_wrote(d)
    with route_dcp_calls(), faults.inject(faults.Fault("eio", kinds=("rename",))):
        with pytest.raises(distckpt.CheckpointError):
            dcp.save(_state(2), checkpoint_id=str(d))
    _unchanged(d, files)
    _dcp_still_loads(d)
    assert _hidden_leftovers(tmp_path) == []  # the failed save's staging is removed
    with route_dcp_calls():  # and the next save goes through
        dcp.save(_state(3), checkpoint_id=str(d))
    got = blank_like(_state(3))
    distckpt.load(got, checkpoint_id=d)
    assert_same(got, _state(3))


def test_a_frameworks_files_beside_dcps_are_carried_into_the_replacing_checkpoint(tmp_path):
    d = tmp_path / "last.ckpt"  # Lightning's ModelParallelStrategy writes meta.pt beside DCP's files
    _dcp_wrote(d)
    (d / "meta.pt").write_bytes(b"lightning's")
    with route_dcp_calls():
        dcp.save(_state(2), checkpoint_id=str(d))
    assert (d / "meta.pt").read_bytes() == b"lightning's" and not (d / ".metadata").exists()
    got = blank_like(_state(2))
    distckpt.load(got, checkpoint_id=d)
    assert_same(got, _state(2))


def test_a_folder_with_links_or_subdirectories_beside_dcps_files_is_not_replaced(tmp_path):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not yours")
    cases = {"notes": lambda d: os.symlink(outside, d / "notes.txt"),
             "link": lambda d: os.symlink(outside, d / "__1_0.distcp"),
             "subdir": lambda d: (d / "__2_0.distcp").mkdir()}
    for name, add in cases.items():
        d = tmp_path / name
        _dcp_wrote(d)
        add(d)
        before = sorted(os.listdir(d))
        refused = "not a committed distckpt checkpoint.*nor one torch.distributed.checkpoint wrote"
        with route_dcp_calls(), pytest.raises(distckpt.CheckpointError, match=refused):
            dcp.save(_state(2), checkpoint_id=str(d))
        assert sorted(os.listdir(d)) == before, name
    assert outside.read_bytes() == b"not yours" and os.path.islink(tmp_path / "link" / "__1_0.distcp")
    d = tmp_path / "unfinished"  # a DCP save that never wrote .metadata: not a committed checkpoint
    _dcp_wrote(d)
    os.unlink(d / ".metadata")
    with route_dcp_calls(), pytest.raises(distckpt.CheckpointError):
        dcp.save(_state(2), checkpoint_id=str(d))
    assert [n for n in os.listdir(d) if n.endswith(".distcp")]


def test_a_nested_routing_holds_its_own_overwrite_for_its_block(tmp_path):
    d = tmp_path / "ckpt"
    distckpt.save(_state(1), checkpoint_id=d)
    with route_dcp_calls() as outer:
        dcp.save(_state(2), checkpoint_id=str(d))  # replaces, DCP's way
        with route_dcp_calls(overwrite=False):
            with pytest.raises(distckpt.CheckpointError, match="already exists and is committed"):
                dcp.save(_state(3), checkpoint_id=str(d))
            with route_dcp_calls(overwrite=True):
                dcp.save(_state(4), checkpoint_id=str(d))
            with pytest.raises(distckpt.CheckpointError, match="already exists and is committed"):
                dcp.save(_state(5), checkpoint_id=str(d))
        dcp.save(_state(6), checkpoint_id=str(d))  # the outer setting is back
        assert dcp.save is not DCP_SAVE
    assert dcp.save is DCP_SAVE and not outer.open
    got = blank_like(_state(6))
    distckpt.load(got, checkpoint_id=d)
    assert_same(got, _state(6))


def test_a_routing_closed_out_of_order_hands_over_to_the_one_still_open(tmp_path):
    d = tmp_path / "ckpt"
    distckpt.save(_state(1), checkpoint_id=d)
    outer = route_dcp_calls(overwrite=False)
    inner = route_dcp_calls(overwrite=True)
    outer.close()
    dcp.save(_state(2), checkpoint_id=str(d))  # the inner one, still open, decides
    inner.close()
    assert dcp.save is DCP_SAVE


def test_routing_logs_its_first_call_and_counts_every_call(tmp_path, caplog):
    before = routed_calls()
    caplog.set_level(logging.DEBUG, logger="distckpt")
    with route_dcp_calls() as routing:
        dcp.save(_state(1), checkpoint_id=str(tmp_path / "a"))
        got = blank_like(_state(1))
        dcp.load(got, checkpoint_id=str(tmp_path / "a"))
        with route_dcp_calls() as inner:
            dcp.save(_state(2), checkpoint_id=str(tmp_path / "a"))
    assert_same(got, _state(1))
    routed = [r for r in caplog.records if r.name == "distckpt" and "routed to distckpt" in r.getMessage()]
    assert [r.levelno for r in routed] == [logging.INFO, logging.DEBUG, logging.DEBUG]
    assert "torch.distributed.checkpoint.save" in routed[0].getMessage() and "handled" in routed[0].getMessage()
    assert "torch.distributed.checkpoint.load" in routed[1].getMessage()
    assert routing.calls == 3 and routing.counts == {"save": 2, "load": 1}
    assert inner.calls == 1 and inner.counts == {"save": 1}
    assert routed_calls() == before + 3
    assert "3 calls routed" in repr(routing)
    with route_dcp_calls():  # a new routing tells its first call again
        caplog.clear()
        dcp.load(blank_like(_state(2)), checkpoint_id=str(tmp_path / "a"))
    assert [r.levelno for r in caplog.records if "routed to distckpt" in r.getMessage()] == [logging.INFO]
    assert not dcp_routing._open


def test_the_first_routed_save_says_where_and_in_which_format_even_after_a_load(tmp_path, caplog):
    distckpt.save(_state(1), checkpoint_id=str(tmp_path / "a"), no_dist=True)
    caplog.set_level(logging.DEBUG, logger="distckpt")
    with route_dcp_calls():
        dcp.load(blank_like(_state(1)), checkpoint_id=str(tmp_path / "a"))  # a resume loads before it saves
        dcp.save(_state(2), checkpoint_id=str(tmp_path / "b"))
        dcp.save(_state(3), checkpoint_id=str(tmp_path / "c"))
    routed = [r for r in caplog.records if r.name == "distckpt" and "routed to distckpt" in r.getMessage()]
    assert [r.levelno for r in routed] == [logging.INFO, logging.INFO, logging.DEBUG]
    said = routed[1].getMessage()
    assert "checkpoint.save" in said and str(tmp_path / "b") in said and "metadata.json" in said, said
