"""Format-4.0 references under hostile input and hostile ground: forged file tables, links planted where steps were,
files of other saves, and retired directories holding what distckpt did not write."""

import os

import pytest
import torch

import distckpt
from distckpt import CheckpointManager, CorruptCheckpointError

from .helpers import read_body, write_body


def _state(step):
    return {"frozen": torch.arange(4096, dtype=torch.float32), "head": torch.full((64,), float(step)), "step": step}


def _blank():
    return {"frozen": torch.zeros(4096), "head": torch.zeros(64), "step": -1}


@pytest.fixture
def run(tmp_path):
    root = str(tmp_path / "run")
    mgr = CheckpointManager(root, incremental=True, no_dist=True)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    return root, mgr


def _forge_reference(path, change):
    body = read_body(path, per_key=False)
    rows = body["storage_data"]["$files"]["files"]
    ref = next(row for row in rows if len(row) == 5)
    change(ref, body)
    write_body(path, body)


@pytest.mark.parametrize("name", ["../step-0000000001/data-00000.safetensors", "step-0000000001/../x",
                                  "/etc/data-00000.safetensors", "step-0000000001/sub/data-00000.safetensors",
                                  "step-0000000001/", ".hidden/data-00000.safetensors"])
def test_a_reference_that_would_leave_the_run_is_refused_before_anything_is_read(run, name):
    root, mgr = run
    _forge_reference(mgr.path(2), lambda ref, body: ref.__setitem__(0, name))
    with pytest.raises(CorruptCheckpointError, match="reference|not a plain file name|<checkpoint>/<file name>"):
        distckpt.read_metadata(mgr.path(2))


@pytest.mark.parametrize("save_id", ["../../x", "", "a" * 65, 7, None])
def test_a_malformed_or_self_save_id_is_refused(run, save_id):
    root, mgr = run
    _forge_reference(mgr.path(2), lambda ref, body: ref.__setitem__(4, save_id))
    with pytest.raises(CorruptCheckpointError):
        distckpt.read_metadata(mgr.path(2))
    _forge_reference(mgr.path(2), lambda ref, body: ref.__setitem__(4, body["storage_data"]["$files"]["save_id"]))
    with pytest.raises(CorruptCheckpointError, match="another save"):
        distckpt.read_metadata(mgr.path(2))


def test_a_reference_in_a_document_of_an_older_version_is_refused(run):
    root, mgr = run
    _forge_reference(mgr.path(2), lambda ref, body: body.__setitem__("format_version", "3.0"))
    with pytest.raises(CorruptCheckpointError, match="only format 4.0"):
        distckpt.read_metadata(mgr.path(2))


def test_a_reference_to_a_step_that_does_not_exist_names_it(run):
    root, mgr = run
    _forge_reference(mgr.path(2), lambda ref, body: ref.__setitem__(0, "step-0000000099/data-00000.safetensors"))
    with pytest.raises(distckpt.CheckpointNotFoundError, match="step-0000000099"):
        distckpt.load(_blank(), checkpoint_id=mgr.path(2), no_dist=True)
    assert not distckpt.verify(mgr.path(2), raise_on_error=False).ok


def test_a_link_where_the_referenced_step_was_is_never_followed(run, tmp_path):
    root, mgr = run
    elsewhere = str(tmp_path / "elsewhere")
    os.rename(mgr.path(1), elsewhere)
    os.symlink(elsewhere, mgr.path(1))
    with pytest.raises(distckpt.CheckpointNotFoundError):
        distckpt.load(_blank(), checkpoint_id=mgr.path(2), no_dist=True)


def test_a_file_of_another_save_under_the_referenced_name_is_not_read(run, tmp_path):
    root, mgr = run
    other = CheckpointManager(str(tmp_path / "other"), no_dist=True)
    other.save(1, _state(1))  # the same bytes, another save
    os.replace(os.path.join(other.path(1), "data-00000.safetensors"), os.path.join(mgr.path(1), "data-00000.safetensors"))
    with pytest.raises(distckpt.CheckpointError):
        distckpt.load(_blank(), checkpoint_id=mgr.path(2), no_dist=True)


def test_cleanup_of_a_retired_step_leaves_links_fifos_and_directories_alone(tmp_path):
    root = str(tmp_path / "run")
    mgr = CheckpointManager(root, keep_last=1, incremental=True, no_dist=True)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    retired = os.path.join(root, next(n for n in os.listdir(root) if "retired" in n))
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    os.symlink(str(victim), os.path.join(retired, "data-zz.safetensors"))
    os.mkfifo(os.path.join(retired, "fifo"))
    os.mkdir(os.path.join(retired, "sub"))
    mgr.save(3, {"frozen": torch.ones(4096), "head": torch.zeros(64), "step": 3})  # references nothing of step 1
    assert victim.read_text() == "keep me"
    assert sorted(os.listdir(retired)) == ["data-zz.safetensors", "fifo", "sub"]  # only what distckpt wrote went


def test_a_kept_step_whose_metadata_cannot_be_read_keeps_every_file(tmp_path):
    root = str(tmp_path / "run")
    mgr = CheckpointManager(root, keep_last=2, incremental=True, no_dist=True)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    with open(os.path.join(mgr.path(2), "metadata.json"), "r+b") as f:
        f.seek(5)
        f.write(b"#")  # damaged: its references are unknown
    mgr.save(3, _state(3))  # retention deletes step 1 (keep_last=2), which step 2 references
    assert mgr.all_steps() == [2, 3]
    retired = [n for n in os.listdir(root) if "retired" in n]
    assert retired and os.listdir(os.path.join(root, retired[0])) == ["data-00000.safetensors"]
    out = _blank()
    mgr.load(out, step=3)
    assert torch.equal(out["head"], _state(3)["head"])
