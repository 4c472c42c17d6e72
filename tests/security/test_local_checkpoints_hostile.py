"""What an adversarial review broke, one test per finding (the multi-process ones live in
tests/crash/test_shared_root.py and tests/storage/test_s3.py)."""

from __future__ import annotations

import enum
import json
import os
import stat
import subprocess
import threading
from collections import namedtuple

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import distckpt
from distckpt import CheckpointError, CorruptCheckpointError, NotRegularFileError, UnsafeValueError
from distckpt.cli import main as cli
from distckpt.format.checksum import crc32c
from distckpt.planning import DefaultLoadPlanner, DefaultSavePlanner

from ..leftovers import leave_crashed_save
from .helpers import per_key_entries


def _state(step: int = 1) -> dict:
    return {"w": torch.arange(64, dtype=torch.float32) + step, "step": step}


def _metadata(path: str) -> dict:
    with open(os.path.join(path, "metadata.json"), "rb") as f:
        raw = f.read()
    body = json.loads(raw)
    body.pop("crc32c")
    return per_key_entries(body)


def _write_metadata(path: str, body: dict) -> None:
    prefix = json.dumps(body, separators=(",", ":")).encode()[:-1]
    with open(os.path.join(path, "metadata.json"), "wb") as f:
        f.write(prefix + b',"crc32c":"' + f"{crc32c(prefix):08x}".encode() + b'"}\n')


def _data_file(path: str) -> str:
    return os.path.join(path, next(n for n in os.listdir(path) if n.startswith("data-")))


def _in_time(fn, seconds: float = 20):
    """Run ``fn`` in a thread; fail (instead of hanging the suite) if it does not return in time."""
    box: list = []

    def run():
        try:
            box.append(("ok", fn()))
        except BaseException as exc:  # noqa: BLE001
            box.append(("raised", exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert box, f"{fn} hung"
    return box[0]


# ---- 2: retention and links


def test_retention_never_follows_a_symlinked_step_out_of_the_root(tmp_path):
    root = tmp_path / "run"
    outside = tmp_path / "pretrained"
    distckpt.save(_state(0), checkpoint_id=str(outside))
    before = sorted(os.listdir(outside))
    mgr = distckpt.CheckpointManager(str(root), keep_last=1)
    os.symlink(outside, root / "step-0000000000", target_is_directory=True)
    for step in (1, 2, 3):
        mgr.save(step, _state(step))
    assert mgr.all_steps() == [3]  # a link is not a step of this run
    assert sorted(os.listdir(outside)) == before and distckpt.verify(str(outside)).ok
    assert os.path.islink(root / "step-0000000000")
    assert distckpt.CheckpointManager(str(root), keep_last=1).all_steps() == [3]


def test_deletion_never_follows_links_inside_a_checkpoint(tmp_path):
    root = tmp_path / "run"
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("x")
    mgr = distckpt.CheckpointManager(str(root), keep_last=1)
    mgr.save(1, _state(1))
    os.symlink(victim, root / "step-0000000001" / "link", target_is_directory=True)
    os.mkfifo(root / "step-0000000001" / "fifo")
    mgr.save(2, _state(2))
    assert mgr.all_steps() == [2] and (victim / "keep.txt").read_text() == "x"


# ---- 3: overwrite replaces only a committed checkpoint


def test_overwrite_refuses_a_run_root_or_any_directory_that_is_not_a_checkpoint(tmp_path):
    root = str(tmp_path / "run")
    mgr = distckpt.CheckpointManager(root)
    mgr.save(1, _state(1))
    for target in (os.path.join(root, ""), root):
        with pytest.raises(CheckpointError, match="not a committed distckpt checkpoint"):
            distckpt.save(_state(9), storage_writer=distckpt.FileSystemWriter(target, overwrite=True))
    assert mgr.all_steps() == [1] and distckpt.verify(mgr.path(1)).ok
    other = tmp_path / "notes"
    other.mkdir()
    (other / "a.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=str(other)):
        distckpt.save(_state(9), storage_writer=distckpt.FileSystemWriter(str(other), overwrite=True))
    assert (other / "a.txt").read_text() == "mine"
    distckpt.save(_state(9), storage_writer=distckpt.FileSystemWriter(mgr.path(1), overwrite=True))  # a checkpoint: fine
    out = {"w": torch.zeros(64), "step": 0}
    distckpt.load(out, checkpoint_id=mgr.path(1))
    assert out["step"] == 9


def test_a_directory_holding_other_files_is_refused_before_anything_is_written(tmp_path):
    target = tmp_path / "mine"
    target.mkdir()
    (target / "model.pt").write_bytes(b"not ours")
    with pytest.raises(CheckpointError, match=r"holds files that are not a distckpt checkpoint \(model\.pt\)"):
        distckpt.save(_state(1), checkpoint_id=str(target))
    assert sorted(os.listdir(tmp_path)) == ["mine"] and os.listdir(target) == ["model.pt"]  # no staging left either


def test_an_overwrite_keeps_the_files_the_replaced_checkpoint_did_not_list(tmp_path):
    path = str(tmp_path / "ck")
    distckpt.save(_state(1), checkpoint_id=path)
    with open(os.path.join(path, "NOTES.txt"), "w") as f:
        f.write("run 7: lr 3e-4")
    distckpt.save(_state(2), storage_writer=distckpt.FileSystemWriter(path, overwrite=True))
    assert open(os.path.join(path, "NOTES.txt")).read() == "run 7: lr 3e-4"
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # the replaced checkpoint is gone, and only it
    out = {"w": torch.zeros(64), "step": 0}
    distckpt.load(out, checkpoint_id=path)
    assert out["step"] == 2 and distckpt.verify(path).ok


# ---- 4 and 11: chunks must cover their tensor; conversion allocates only what is stored


class _ClaimsMore(DefaultSavePlanner):
    def create_global_plan(self, all_plans):
        plans, md = super().create_global_plan(all_plans)
        md.state_dict_metadata["w"].size = torch.Size([128])  # 64 elements written, 128 claimed
        return plans, md


def test_a_planner_whose_chunks_do_not_cover_the_tensor_commits_nothing(tmp_path):
    path = str(tmp_path / "ck")
    with pytest.raises(CorruptCheckpointError, match="hold 64 of the tensor's 128 elements"):
        distckpt.save(_state(), checkpoint_id=path, planner=_ClaimsMore())
    assert not os.path.exists(path)


@pytest.mark.parametrize("edit", ["no chunks", "half", "overlap"])
def test_metadata_whose_chunks_do_not_cover_a_tensor_is_refused_everywhere(tmp_path, edit):
    path = str(tmp_path / "ck")
    distckpt.save({"w": torch.arange(64, dtype=torch.float32).reshape(8, 8)}, checkpoint_id=path)
    body = _metadata(path)
    entry = body["state_dict_metadata"]["w"]
    chunk = entry["chunks"][0]
    if edit == "no chunks":
        entry["chunks"] = []
    elif edit == "half":
        chunk[1] = [4, 8]
    else:  # two chunks of 4 rows over rows 0-5, rows 6-7 stored nowhere; same element count
        entry["chunks"] = [[[0, 0], [4, 8], chunk[2], chunk[3], chunk[4]], [[2, 0], [4, 8], chunk[2], chunk[3] + 128, chunk[4]]]
    _write_metadata(path, body)
    with pytest.raises(CorruptCheckpointError, match="elements|overlap"):
        distckpt.read_metadata(path)
    with pytest.raises(CorruptCheckpointError):
        distckpt.verify(path)
    dest = torch.full((8, 8), 7.0)
    with pytest.raises(CorruptCheckpointError):
        distckpt.load({"w": dest}, checkpoint_id=path)
    assert torch.equal(dest, torch.full((8, 8), 7.0))  # refused before anything was read


def test_convert_allocates_no_more_than_the_checkpoint_stores(tmp_path):
    from distckpt import convert

    path = str(tmp_path / "ck")
    distckpt.save({"w": torch.ones(16)}, checkpoint_id=path)
    body = _metadata(path)
    entry = body["state_dict_metadata"]["w"]
    entry["size"] = [1 << 28]
    entry["chunks"][0][1] = [1 << 28]
    body["storage_data"]["$files"]["files"][0][1] = 1 << 31  # the table claims a 2 GiB file
    _write_metadata(path, body)
    with pytest.raises(CorruptCheckpointError, match="claims 1073741824 bytes of tensors, but its data files hold"):
        convert.to_safetensors(path, str(tmp_path / "out.safetensors"))
    assert not os.path.exists(tmp_path / "out.safetensors")


# ---- 5, 13, 24: rank-local names


def test_a_plain_key_cannot_take_the_stored_name_of_a_rank_local_value(tmp_path):
    with pytest.raises(CheckpointError, match="ends like the stored name of a RankLocal"):
        distckpt.save({"x@rank0": torch.ones(2)}, checkpoint_id=str(tmp_path / "a"))
    assert not os.path.exists(tmp_path / "a")
    distckpt.save({"x": distckpt.RankLocal(torch.ones(2))}, checkpoint_id=str(tmp_path / "b"))
    with pytest.raises(CheckpointError, match="ends like the stored name of a RankLocal"):
        distckpt.load({"x@rank0": torch.ones(2)}, checkpoint_id=str(tmp_path / "b"))


def test_a_key_named_like_the_rank_local_marker_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(CheckpointError, match="reserved"):
        distckpt.save({"opt": {"$rank_local": torch.ones(2)}}, checkpoint_id=str(tmp_path / "a"))
    assert not os.path.exists(tmp_path / "a")


def test_rank_local_dicts_of_tensors_save_and_load(tmp_path):
    path = str(tmp_path / "a")
    sd = {"rng": distckpt.RankLocal({"cpu": torch.arange(5), "seed": 3, "nested": [torch.ones(2), 4]})}
    distckpt.save(sd, checkpoint_id=path)
    assert set(distckpt.read_metadata(path).state_dict_metadata) == {"rng.cpu@rank0", "rng.seed@rank0", "rng.nested.0@rank0",
                                                                     "rng.nested.1@rank0"}
    out = {"rng": distckpt.RankLocal({"cpu": torch.zeros(5, dtype=torch.int64), "seed": 0, "nested": [torch.zeros(2), 0]})}
    distckpt.load(out, checkpoint_id=path)
    assert torch.equal(out["rng"].value["cpu"], torch.arange(5)) and out["rng"].value["seed"] == 3
    assert torch.equal(out["rng"].value["nested"][0], torch.ones(2)) and out["rng"].value["nested"][1] == 4


# ---- 6: convert's temporary file


def test_convert_never_writes_through_a_link_planted_at_its_temporary_name(tmp_path, monkeypatch):
    import uuid

    from distckpt import convert

    src = str(tmp_path / "ck")
    distckpt.save({"w": torch.ones(4)}, checkpoint_id=src)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    dst = tmp_path / "out.pt"
    fixed = uuid.UUID(int=7)
    monkeypatch.setattr(convert.uuid, "uuid4", lambda: fixed)
    os.symlink(victim, tmp_path / f".out.pt.distckpt-tmp-{fixed.hex}")
    with pytest.raises(CheckpointError, match="temporary"):
        convert.to_torch_save(src, str(dst))
    assert victim.read_text() == "precious" and not os.path.lexists(dst)
    monkeypatch.undo()
    convert.to_torch_save(src, str(dst))
    assert os.stat(dst).st_nlink == 1 and torch.equal(torch.load(dst, weights_only=True)["w"], torch.ones(4))


# ---- 7 and 8: only regular files are read, never through a link, never blocking


def test_a_data_file_swapped_for_a_link_is_refused(tmp_path):
    path = str(tmp_path / "ck")
    distckpt.save(_state(), checkpoint_id=path)
    data = _data_file(path)
    os.rename(data, str(tmp_path / "moved"))
    os.symlink(str(tmp_path / "moved"), data)
    with pytest.raises(NotRegularFileError, match="symbolic link"):
        distckpt.load({"w": torch.zeros(64), "step": 0}, checkpoint_id=path)
    with pytest.raises(CorruptCheckpointError):
        distckpt.verify(path)


@pytest.mark.parametrize("which", ["data", "metadata"])
def test_a_fifo_in_place_of_a_file_is_refused_at_once(tmp_path, which):
    path = str(tmp_path / "ck")
    distckpt.save(_state(), checkpoint_id=path)
    target = _data_file(path) if which == "data" else os.path.join(path, "metadata.json")
    os.unlink(target)
    os.mkfifo(target)
    for call in (lambda: distckpt.load({"w": torch.zeros(64), "step": 0}, checkpoint_id=path),
                 lambda: distckpt.verify(path),
                 lambda: CliRunner().invoke(cli, ["inspect", path]).exit_code):
        outcome, value = _in_time(call)
        if outcome == "raised":
            assert isinstance(value, CorruptCheckpointError), value
            assert "FIFO" in str(value)
        else:  # the CLI's exit code: inspect reads only the metadata
            assert value == (1 if which == "metadata" else 0)


# ---- 9: truncation during a buffered load is an error, not a crash


def test_truncation_during_a_resharding_load_is_a_typed_error(tmp_path, monkeypatch):
    from distckpt.engine import read as reading

    path = str(tmp_path / "ck")
    distckpt.save({"w": torch.arange(1 << 20, dtype=torch.float32).reshape(1024, 1024)}, checkpoint_id=path)
    data = _data_file(path)
    opened = reading.open_and_validate

    def open_then_truncate(store, fsd, names, where, *rest):
        blobs = opened(store, fsd, names, where, *rest)
        os.truncate(data, 4096)  # another process cuts the file while the load runs
        return blobs

    monkeypatch.setattr(reading, "open_and_validate", open_then_truncate)
    dest = torch.zeros(1024, 2048)[:, ::2]  # not contiguous: the buffered path
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        distckpt.load({"w": dest}, checkpoint_id=path)


# ---- 10: read-only media


def test_a_read_only_root_with_crash_leftovers_opens_and_loads(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only file system needs root")
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount tmpfs here")
    try:
        root = str(mnt / "run")
        mgr = distckpt.CheckpointManager(root)
        mgr.save(1, _state(1))
        leave_crashed_save(distckpt.backends.filesystem.FsStore(os.path.join(root, "step-0000000002")), "c0ffee")
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        for opened in (distckpt.CheckpointManager(root), distckpt.CheckpointManager(root, read_only=True)):
            out = {"w": torch.zeros(64), "step": 0}
            assert opened.load(out) == 1 and out["step"] == 1
        with pytest.raises(CheckpointError, match="read_only"):
            distckpt.CheckpointManager(root, read_only=True).save(3, _state(3))
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


# ---- 12: damaged DCP input


@pytest.mark.parametrize("damage", ["truncated metadata", "missing data file"])
def test_damaged_dcp_input_gives_a_checkpoint_error(tmp_path, damage):
    import warnings

    import torch.distributed.checkpoint as dcp

    from distckpt import convert

    src = str(tmp_path / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(8)}, checkpoint_id=src, no_dist=True)
    if damage == "truncated metadata":
        with open(os.path.join(src, ".metadata"), "r+b") as f:
            f.truncate(20)
    else:
        for n in os.listdir(src):
            if n.endswith(".distcp"):
                os.unlink(os.path.join(src, n))
    with pytest.raises(CheckpointError):
        convert.from_dcp(src, str(tmp_path / "out"), trust_pickle=True)


# ---- 14 and 15: what a failed load leaves; aliasing destinations


def test_bytes_that_failed_their_checksum_are_not_left_in_the_destination(tmp_path):
    path = str(tmp_path / "ck")
    distckpt.save({"w": torch.arange(4096, dtype=torch.float32)}, checkpoint_id=path)
    info = distckpt.read_metadata(path).storage_data
    where = next(iter(info.items.values()))
    with open(_data_file(path), "r+b") as f:
        f.seek(where.offset + 100)
        f.write(b"\xff\xff")
    for dest in (torch.full((4096,), 7.0), torch.full((4096, 2), 7.0)[:, 0]):  # the direct and the buffered path
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
            distckpt.load({"w": dest}, checkpoint_id=path)
        assert torch.count_nonzero(dest) == 0


def test_destinations_that_alias_are_named_and_tied_ones_load(tmp_path):
    path = str(tmp_path / "ck")
    distckpt.save({"a": torch.ones(4, 4), "b": torch.full((4, 4), 2.0)}, checkpoint_id=path)
    base = torch.zeros(6, 4)
    with pytest.raises(CheckpointError, match="'a' and 'b' share memory"):
        distckpt.load({"a": base[:4], "b": base[2:]}, checkpoint_id=path)
    tied = torch.zeros(4, 4)
    distckpt.save({"a": torch.ones(4, 4), "b": torch.ones(4, 4)}, checkpoint_id=str(tmp_path / "tied"))
    distckpt.load({"a": tied, "b": tied}, checkpoint_id=str(tmp_path / "tied"))
    assert torch.equal(tied, torch.ones(4, 4))
    halves = torch.zeros(4, 8)
    distckpt.load({"a": halves[:, :4], "b": halves[:, 4:]}, checkpoint_id=path)  # interleaved, disjoint: fine
    assert torch.equal(halves[:, 4:], torch.full((4, 4), 2.0))


# ---- 16, 17, 18: metadata and header must agree, every time


def test_metadata_dtype_that_disagrees_with_the_header_is_refused(tmp_path):
    path = str(tmp_path / "ck")
    distckpt.save({"w": torch.ones(8)}, checkpoint_id=path)
    body = _metadata(path)
    body["state_dict_metadata"]["w"]["properties"][0] = "int32"
    _write_metadata(path, body)
    with pytest.raises(CorruptCheckpointError, match=r"stores it as F32 \[8\], the metadata as I32"):
        distckpt.load({"w": torch.zeros(8, dtype=torch.int32)}, checkpoint_id=path)
    assert not distckpt.verify(path, raise_on_error=False).ok


def test_a_header_of_another_save_is_refused_even_with_a_matching_checksum(tmp_path):
    path = str(tmp_path / "ck")
    distckpt.save({"w": torch.ones(8)}, checkpoint_id=path)
    data = _data_file(path)
    with open(data, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    body = _metadata(path)
    save_id = body["storage_data"]["$files"]["save_id"]
    forged = raw[8:8 + n].replace(save_id.encode(), b"f" * len(save_id))
    with open(data, "r+b") as f:
        f.seek(8)
        f.write(forged)
    body["storage_data"]["$files"]["files"][0][3] = crc32c(forged, crc32c(raw[:8]))  # the metadata forged to match
    _write_metadata(path, body)
    with pytest.raises(CorruptCheckpointError, match="belongs to save"):
        distckpt.load({"w": torch.zeros(8)}, checkpoint_id=path)


def test_duplicate_json_member_names_are_refused(tmp_path):
    path = str(tmp_path / "ck")
    distckpt.save({"w": torch.ones(8)}, checkpoint_id=path)
    with open(os.path.join(path, "metadata.json"), "rb") as f:
        raw = f.read()
    prefix = raw[:raw.rindex(b',"crc32c"')]
    prefix = prefix.replace(b'"format":"distckpt",', b'"format":"distckpt","format":"distckpt",', 1)
    with open(os.path.join(path, "metadata.json"), "wb") as f:
        f.write(prefix + b',"crc32c":"' + f"{crc32c(prefix):08x}".encode() + b'"}\n')
    with pytest.raises(CorruptCheckpointError, match="appears twice"):
        distckpt.read_metadata(path)


# ---- 19-21, 26: the manager's steps


def test_only_canonical_step_names_are_steps(tmp_path):
    root = tmp_path / "run"
    mgr = distckpt.CheckpointManager(str(root), keep_last=1)
    mgr.save(3, _state(3))
    distckpt.save(_state(5), checkpoint_id=str(root / "step-5"))
    distckpt.save(_state(3), checkpoint_id=str(root / "step-3"))
    assert mgr.all_steps() == [3] and mgr.latest_step() == 3
    mgr.save(4, _state(4))
    assert mgr.all_steps() == [4] and os.path.isdir(root / "step-5")  # not ours to delete


@pytest.mark.parametrize("step", [2.0, "3", True, -1, 10**19])
def test_steps_that_are_not_integers_in_range_are_typed_errors(tmp_path, step):
    mgr = distckpt.CheckpointManager(str(tmp_path / "run"))
    with pytest.raises(distckpt.InvalidStepError):
        mgr.save(step, _state())


def test_the_largest_step_is_listed(tmp_path):
    mgr = distckpt.CheckpointManager(str(tmp_path / "run"))
    mgr.save(10**19 - 1, _state())
    mgr.save(np.int64(7), _state())
    assert mgr.all_steps() == [7, 10**19 - 1]


def test_a_retention_race_never_fails_a_committed_save(tmp_path, monkeypatch):
    from distckpt.backends.filesystem import FsStore

    root = str(tmp_path / "run")
    mgr = distckpt.CheckpointManager(root, keep_last=1)
    mgr.save(1, _state(1))
    other = distckpt.CheckpointManager(root, keep_last=1)
    original = FsStore.remove

    def deleted_by_the_other_first(self):
        import shutil

        shutil.rmtree(self.root, ignore_errors=True)  # the other manager's retention got there first
        original(self)

    monkeypatch.setattr(FsStore, "remove", deleted_by_the_other_first)
    mgr.save(2, _state(2))
    assert other.all_steps() == [2]


def test_steps_shows_a_damaged_step_and_the_rest(tmp_path):
    root = str(tmp_path / "run")
    mgr = distckpt.CheckpointManager(root)
    for step in (1, 2, 3):
        mgr.save(step, _state(step))
    with open(os.path.join(mgr.path(1), "metadata.json"), "r+b") as f:
        f.write(b"garbage")
    res = CliRunner().invoke(cli, ["steps", root])
    assert res.exit_code == 1
    lines = res.output.splitlines()
    assert [line.split()[1] for line in lines] == ["1", "2", "3"] and "DAMAGED" in lines[0]


# ---- 22: terminal output


def test_inspect_escapes_control_characters_in_keys(tmp_path):
    path = str(tmp_path / "ck")
    distckpt.save({"a\x1b]0;owned\x07\nforged line": torch.ones(1)}, checkpoint_id=path)
    out = CliRunner().invoke(cli, ["inspect", path]).output
    assert "\x1b" not in out and "\x07" not in out and "\nforged line" not in out and "\\x1b" in out
    doc = json.loads(CliRunner().invoke(cli, ["inspect", path, "--json"]).output)
    assert doc["keys"][0]["key"] == "a\x1b]0;owned\x07\nforged line"


# ---- 23, 25: values


def test_bool_tensors_are_stored_as_zero_and_one(tmp_path):
    path = str(tmp_path / "ck")
    raw = torch.tensor([0, 1, 2, 255], dtype=torch.uint8)
    flags = raw.view(torch.bool)
    distckpt.save({"m": flags}, checkpoint_id=path)
    info = next(iter(distckpt.read_metadata(path).storage_data.items.values()))
    with open(_data_file(path), "rb") as f:
        f.seek(info.offset)
        assert f.read(4) == b"\x00\x01\x01\x01"
    out = torch.zeros(4, dtype=torch.bool)
    distckpt.load({"m": out}, checkpoint_id=path)
    assert out.tolist() == [False, True, True, True]
    assert raw.tolist() == [0, 1, 2, 255]  # the caller's tensor is left as it was


class _Color(enum.IntEnum):
    RED = 1


class _Mode(str, enum.Enum):
    FAST = "fast"


class _Items(list):
    pass


_Point = namedtuple("_Point", "x")


@pytest.mark.parametrize("value", [_Color.RED, _Mode.FAST, np.float64(1.5), _Items([1]), _Point(1),
                                   np.float32(1.0)])
def test_subclasses_of_plain_types_are_refused_unless_pickle_is_allowed(tmp_path, value):
    with pytest.raises(UnsafeValueError, match="Convert it first|cannot be stored without pickle"):
        distckpt.save({"v": value}, checkpoint_id=str(tmp_path / "a"))
    assert not os.path.exists(tmp_path / "a")
    distckpt.save({"v": value}, checkpoint_id=str(tmp_path / "b"), planner=DefaultSavePlanner(allow_pickle=True))
    out = {"v": None}
    distckpt.load(out, checkpoint_id=str(tmp_path / "b"), planner=DefaultLoadPlanner(allow_pickle=True))
    assert type(out["v"]) is type(value) and out["v"] == value


def test_files_distckpt_creates_are_plain_and_new(tmp_path):
    path = str(tmp_path / "ck")
    distckpt.save(_state(), checkpoint_id=path)
    for name in os.listdir(path):
        st = os.lstat(os.path.join(path, name))
        assert stat.S_ISREG(st.st_mode) and st.st_nlink == 1


@pytest.mark.parametrize("kind", ["safetensors", "torch-save"])
def test_convert_reads_only_regular_files(tmp_path, kind):
    from distckpt import convert

    real = tmp_path / "real"
    if kind == "safetensors":
        from safetensors.torch import save_file

        save_file({"w": torch.ones(2)}, str(real))
        read = convert.from_safetensors
    else:
        torch.save({"w": torch.ones(2)}, str(real))
        read = convert.from_torch_save
    link, fifo = tmp_path / "link", tmp_path / "fifo"
    os.symlink(real, link)
    os.mkfifo(fifo)
    for bad, kind_name in ((link, "symbolic link"), (fifo, "FIFO")):
        outcome, value = _in_time(lambda: read(str(bad), str(tmp_path / f"out-{bad.name}")))
        assert outcome == "raised" and isinstance(value, NotRegularFileError) and kind_name in str(value), value
    assert read(str(real), str(tmp_path / "out")) == 1


def test_a_save_creates_missing_parent_directories_and_leaves_no_lease(tmp_path):
    path = tmp_path / "a" / "b" / "ck"
    distckpt.save(_state(), checkpoint_id=str(path))
    assert distckpt.verify(str(path)).ok and os.listdir(tmp_path / "a" / "b") == ["ck"]


def test_destinations_measured_in_the_plan_and_apart_are_checked_together(tmp_path):
    path = str(tmp_path / "ck")
    distckpt.save({"a": torch.arange(8.0), "e": torch.zeros(0), "t": torch.ones(3)}, checkpoint_id=path)
    base = torch.zeros(8)
    t = torch.zeros(6)[::2]  # not contiguous: measured apart from the contiguous ones
    distckpt.load({"a": base, "e": base[3:3], "t": t}, checkpoint_id=path)
    assert torch.equal(base, torch.arange(8.0)) and torch.equal(t, torch.ones(3))
    with pytest.raises(CheckpointError, match="'a' and 't' share memory"):
        distckpt.load({"a": base, "e": base[3:3], "t": base[1:7:2]}, checkpoint_id=path)
