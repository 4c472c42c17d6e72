"""Incremental saves through CheckpointManager(incremental=True): what is written, what every kept step loads, and
what retention keeps, on disk and in memory (S3: tests/storage/test_incremental_s3.py)."""

import json
import os

import pytest
import torch

import distckpt
from distckpt import CheckpointManager
from distckpt.backends.memory import clear_memory_store

FROZEN, TRAINED = 9, 1


def _state(step: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    sd = {f"frozen.{i}": torch.randn(128, 256, generator=g) for i in range(FROZEN)}
    sd["head.weight"] = torch.full((128, 256), float(step))
    sd["head.bias"] = torch.arange(7, dtype=torch.bfloat16) * step
    sd["step"] = step
    sd["flags"] = torch.tensor([True, False, True])
    return sd


def _empty_like(sd: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in sd.items()}


def _assert_same(got: dict, want: dict) -> None:
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


def _own_bytes(step_dir: str) -> int:
    return sum(e.stat().st_size for e in os.scandir(step_dir) if e.name.endswith(".safetensors"))


def _files(step_dir: str) -> list:
    with open(os.path.join(step_dir, "metadata.json")) as f:
        return json.load(f)["storage_data"]["$files"]["files"]


def test_unchanged_chunks_are_referenced_and_every_kept_step_loads_bit_exact(tmp_path):
    root = str(tmp_path / "run")
    mgr = CheckpointManager(root, keep_last=2, incremental=True, no_dist=True)
    full_bytes = 0
    for step in range(1, 7):
        md = mgr.save(step, _state(step))
        own = _own_bytes(mgr.path(step))
        if step == 1:
            full_bytes = own
            assert md.version in ("3.0", "2.0")  # nothing referenced yet
        else:
            assert md.version == "4.0"
            assert own < 0.15 * full_bytes, (step, own, full_bytes)  # only the head and the values were written
            refs = [row for row in _files(mgr.path(step)) if len(row) == 5]
            assert refs and all(row[0].startswith("step-0000000001/") for row in refs)  # always to where bytes are
    assert mgr.all_steps() == [5, 6]
    for step in (5, 6):  # every step before them is deleted; they still load on their own
        out = _empty_like(_state(step))
        mgr.load(out, step=step)
        _assert_same(out, _state(step))
        out = _empty_like(_state(step))
        distckpt.load(out, checkpoint_id=mgr.path(step))  # without the manager, as any reader would
        _assert_same(out, _state(step))
    assert distckpt.verify(mgr.path(6)).ok


def test_retention_keeps_only_referenced_files_and_removes_them_once_unreferenced(tmp_path):
    root = str(tmp_path / "run")
    mgr = CheckpointManager(root, keep_last=1, incremental=True, full_every=2, no_dist=True)
    for step in range(1, 4):
        mgr.save(step, _state(step))
    # steps 1 (full) and 2 are gone; step 3 is a full save again (full_every=2), so nothing references step 1's files
    assert mgr.all_steps() == [3]
    assert not any(len(row) == 5 for row in _files(mgr.path(3)))
    assert [n for n in os.listdir(root) if n.startswith(".")] == []
    mgr.save(4, _state(4))
    hidden = [n for n in os.listdir(root) if n.startswith(".")]
    assert len(hidden) == 1 and "retired" in hidden[0]  # step 3 retired: step 4 references its frozen chunks
    assert os.listdir(os.path.join(root, hidden[0])) == ["data-00000.safetensors"]
    out = _empty_like(_state(4))
    mgr.load(out, step=4)
    _assert_same(out, _state(4))


def test_a_failed_save_makes_the_next_one_full(tmp_path):
    root = str(tmp_path / "run")
    mgr = CheckpointManager(root, keep_last=3, incremental=True, no_dist=True)
    mgr.save(1, _state(1))
    with pytest.raises(distckpt.CheckpointError):
        mgr.save(1, _state(1))  # step 1 exists: this save fails
    mgr.save(2, _state(2))
    assert not any(len(row) == 5 for row in _files(mgr.path(2)))
    mgr.save(3, _state(3))
    assert any(len(row) == 5 for row in _files(mgr.path(3)))


def test_a_restarted_manager_writes_everything_once_then_references(tmp_path):
    root = str(tmp_path / "run")
    CheckpointManager(root, keep_last=2, incremental=True, no_dist=True).save(1, _state(1))
    mgr = CheckpointManager(root, keep_last=2, incremental=True, no_dist=True)
    mgr.save(2, _state(2))
    mgr.save(3, _state(3))
    assert not any(len(row) == 5 for row in _files(mgr.path(2)))
    assert {row[0].split("/")[0] for row in _files(mgr.path(3)) if len(row) == 5} == {"step-0000000002"}


def test_a_deleted_referenced_file_fails_the_load_by_name_and_the_next_commit_is_refused_then_full(tmp_path):
    root = str(tmp_path / "run")
    mgr = CheckpointManager(root, incremental=True, no_dist=True)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    os.unlink(os.path.join(mgr.path(1), "data-00000.safetensors"))  # outside distckpt's retention
    with pytest.raises(distckpt.CheckpointNotFoundError, match="step-0000000001"):
        distckpt.load(_empty_like(_state(2)), checkpoint_id=mgr.path(2))
    with pytest.raises(distckpt.CorruptCheckpointError, match="is gone; nothing was committed"):
        mgr.save(3, _state(3))
    assert 3 not in mgr.all_steps()
    mgr.save(4, _state(4))  # full: it references nothing
    out = _empty_like(_state(4))
    mgr.load(out, step=4)
    _assert_same(out, _state(4))


def test_compressed_incremental_steps_reference_compressed_chunks(tmp_path):
    root = str(tmp_path / "run")
    mgr = CheckpointManager(root, keep_last=2, incremental=True, compression="zstd", no_dist=True)
    for step in range(1, 4):
        mgr.save(step, _state(step))
    for step in (2, 3):
        out = _empty_like(_state(step))
        mgr.load(out, step=step)
        _assert_same(out, _state(step))


def test_memory_store_runs_are_incremental_too():
    clear_memory_store()
    mgr = CheckpointManager("memory://inc-run", keep_last=2, incremental=True, no_dist=True)
    for step in range(1, 5):
        mgr.save(step, _state(step))
    assert mgr.all_steps() == [3, 4]
    for step in (3, 4):
        out = _empty_like(_state(step))
        mgr.load(out, step=step)
        _assert_same(out, _state(step))
    clear_memory_store()


def test_async_incremental_saves_reference_the_previous_commit(tmp_path):
    root = str(tmp_path / "run")
    mgr = CheckpointManager(root, keep_last=2, incremental=True, no_dist=True)
    for step in range(1, 4):
        mgr.async_save(step, _state(step)).result()
    assert any(len(row) == 5 for row in _files(mgr.path(3)))
    out = _empty_like(_state(3))
    mgr.load(out, step=3)
    _assert_same(out, _state(3))


def test_a_save_while_an_async_save_is_in_flight_builds_on_its_commit_and_retention_keeps_what_it_references(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "run"), keep_last=1, incremental=True, no_dist=True)
    for step in range(1, 13, 2):
        handle = mgr.async_save(step, _state(step))
        mgr.save(step + 1, _state(step + 1))  # the async save may still be writing: this one waits for its commit
        handle.result()
        assert mgr.all_steps() == [step + 1]
        out = _empty_like(_state(step + 1))
        mgr.load(out, step=step + 1)
        _assert_same(out, _state(step + 1))


def test_compact_copies_referenced_files_in_and_the_step_survives_the_rest_of_the_run(tmp_path):
    from click.testing import CliRunner

    from distckpt.cli import main as cli

    root = str(tmp_path / "run")
    mgr = CheckpointManager(root, keep_last=1, incremental=True, no_dist=True)
    for step in (1, 2, 3):
        mgr.save(step, _state(step))
    assert [n for n in os.listdir(root) if "retired" in n]
    result = CliRunner().invoke(cli, ["compact", mgr.path(3)])
    assert result.exit_code == 0 and "copied 1 referenced file(s)" in result.output, result.output
    assert not any(len(row) == 5 for row in _files(mgr.path(3)))
    assert distckpt.verify(mgr.path(3)).ok
    CheckpointManager(root, keep_last=1, incremental=True, no_dist=True)  # its cleanup sweeps what nothing references
    assert [n for n in os.listdir(root) if n.startswith(".")] == []
    out = _empty_like(_state(3))
    mgr.load(out, step=3)
    _assert_same(out, _state(3))
    assert "nothing to do" in CliRunner().invoke(cli, ["compact", mgr.path(3)]).output
    mgr.save(4, _state(4))  # after compaction the manager's next save writes every chunk
    assert not any(len(row) == 5 for row in _files(mgr.path(4)))


def test_steps_and_verify_report_written_referenced_and_compression(tmp_path):
    from click.testing import CliRunner

    from distckpt.cli import main as cli

    root = str(tmp_path / "run")
    mgr = CheckpointManager(root, keep_last=3, incremental=True, compression="zstd", no_dist=True)
    for step in (1, 2):
        mgr.save(step, {"w": torch.zeros(4096), "b": torch.full((64,), float(step))})
    rows = json.loads(CliRunner().invoke(cli, ["steps", root, "--json"]).output)["steps"]
    assert rows[0]["referenced"] == 0 and rows[1]["referenced"] > 0 and rows[1]["written"] < rows[0]["written"]
    assert rows[0]["compression_ratio"] > 5  # zeros compress
    text = CliRunner().invoke(cli, ["steps", root]).output
    assert "referenced" in text and "compression" in text
    report = distckpt.verify(mgr.path(2))
    assert report.stored.referenced == rows[1]["referenced"] and report.stored.decoded == 4096 * 4 + 64 * 4
    assert "referenced in earlier steps" in CliRunner().invoke(cli, ["verify", mgr.path(2)]).output


def test_steps_and_inspect_count_each_step_s_own_files_and_the_run_s_bytes_once(tmp_path):
    from click.testing import CliRunner

    from distckpt.cli import main as cli

    root = str(tmp_path / "run")
    mgr = CheckpointManager(root, keep_last=3, incremental=True, no_dist=True)
    for step in range(1, 9):
        mgr.save(step, {"frozen": torch.arange(1 << 16, dtype=torch.float32), "head": torch.full((4096,), float(step))})
    listing = json.loads(CliRunner().invoke(cli, ["steps", root, "--json"]).output)
    on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs if f.endswith(".safetensors"))
    assert listing["run_bytes"] == on_disk  # the retired first step's file, counted once, and each step's own
    assert [r["bytes"] for r in listing["steps"]] == [_own_bytes(mgr.path(s)) for s in (6, 7, 8)]
    assert sum(r["bytes"] for r in listing["steps"]) < on_disk < sum(r["bytes"] + r["files_referenced"] for r in listing["steps"])
    text = CliRunner().invoke(cli, ["inspect", mgr.path(8)]).output
    assert "1 data file(s) of its own" in text and "which it references" in text


@pytest.mark.parametrize("where", ["disk", "memory"])
def test_overwriting_a_referenced_step_keeps_the_files_later_steps_reference(tmp_path, where):
    clear_memory_store()
    root = str(tmp_path / "run") if where == "disk" else "memory://overwrite-run"
    mgr = CheckpointManager(root, incremental=True, no_dist=True)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    replaced = _state(1, seed=5)
    distckpt.save(replaced, checkpoint_id=mgr.path(1), overwrite=True, no_dist=True)
    for step, want in ((1, replaced), (2, _state(2))):
        out = _empty_like(want)
        distckpt.load(out, checkpoint_id=mgr.path(step), no_dist=True)
        _assert_same(out, want)
    assert distckpt.verify(mgr.path(2)).ok
    if where == "disk":
        assert [n for n in os.listdir(root) if "retired" in n]
    clear_memory_store()


def test_open_diff_inspect_and_convert_read_a_referencing_step(tmp_path):
    from click.testing import CliRunner

    from distckpt.cli import main as cli

    root = str(tmp_path / "run")
    mgr = CheckpointManager(root, keep_last=1, incremental=True, no_dist=True)
    for step in (1, 2, 3):
        mgr.save(step, _state(step))
    with distckpt.open(mgr.path(3)) as ck:
        assert torch.equal(ck["frozen.3"][5:9], _state(3)["frozen.3"][5:9]) and ck["step"] == 3
    assert CliRunner().invoke(cli, ["diff", mgr.path(3), mgr.path(3)]).exit_code == 0
    text = CliRunner().invoke(cli, ["inspect", mgr.path(3)]).output
    assert "step-0000000001/data-00000.safetensors" in text and "references" in text
    dcp = str(tmp_path / "dcp")
    assert CliRunner().invoke(cli, ["convert", "--to", "dcp", mgr.path(3), dcp]).exit_code == 0
    out = _empty_like(_state(3))
    distckpt.load(out, checkpoint_id=dcp, no_dist=True)
    _assert_same(out, _state(3))


def test_a_store_that_cannot_keep_references_gets_full_saves(tmp_path, monkeypatch):
    from distckpt.backends.filesystem import FsStore
    from distckpt.engine.blobs import REFERENCES

    monkeypatch.setattr(FsStore, "capabilities", FsStore.capabilities - {REFERENCES})
    root = str(tmp_path / "run")
    mgr = CheckpointManager(root, keep_last=2, incremental=True, no_dist=True)
    for step in (1, 2, 3):
        mgr.save(step, _state(step))
        assert not any(len(row) == 5 for row in _files(mgr.path(step)))
    out = _empty_like(_state(3))
    mgr.load(out, step=3)
    _assert_same(out, _state(3))
