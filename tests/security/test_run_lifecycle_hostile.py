"""The run lifecycle (retention, overwrite, cleanup, the commit check, compaction) decides what a step references by
parsing its document and its data files' headers as the loader does: a valid checkpoint written another way, an
overwrite whose new document references the save it replaces, and a lookalike file table elsewhere in the document
never cost a committed step. tests/storage/test_incremental_s3.py runs the same checks on S3."""

from __future__ import annotations

import uuid

import pytest
import torch

import distckpt
from distckpt import backends
from distckpt.backends import clear_memory_store
from distckpt.testing import rewritten


def state(step: int, salt: float = 0.0) -> dict:
    """Most tensors unchanged from step to step: an incremental save references them in the step before."""
    return {"frozen": torch.arange(4096, dtype=torch.float32) + salt, "emb": torch.ones(32, 16) * salt,
            "head": torch.full((64,), float(step) + salt), "step": step}


def assert_loads(path: str, want: dict) -> None:
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in want.items()}
    distckpt.load(out, checkpoint_id=path, no_dist=True)
    for k, v in want.items():
        assert (torch.equal(out[k], v) if isinstance(v, torch.Tensor) else out[k] == v), (path, k)
    assert distckpt.verify(path).ok, path


def overwrite_a_step_of_an_incremental_run(root: str) -> None:
    """A step saved again over itself, incrementally: the new save references the steps before (never the save it
    replaces, docs/format.md section 6), and every step of the run loads before and after retention."""
    mgr = distckpt.CheckpointManager(root, incremental=True, no_dist=True, keep_last=2)
    mgr.save(4, state(4))
    mgr.save(5, state(5))
    again = state(5)
    again["head"] = again["head"] + 1  # the rest unchanged: referenced, in step 4 and (not) in the save replaced
    mgr.save(5, again, storage_writer=backends.writer_for(mgr.path(5), overwrite=True))
    refs = {name for name, info in distckpt.read_metadata(mgr.path(5)).storage_data.files.items() if info.save_id}
    assert refs and all(name.startswith(mgr._name(4) + "/") for name in refs), refs
    assert_loads(mgr.path(5), again)
    assert_loads(mgr.path(4), state(4))
    mgr.save(6, state(6))  # retention (keep_last=2) now retires step 4, which steps 5 and 6 reference
    assert mgr.all_steps() == [5, 6]
    assert_loads(mgr.path(5), again)
    assert_loads(mgr.path(6), state(6))
    mgr.save(6, state(6, salt=1.0), storage_writer=backends.writer_for(mgr.path(6), overwrite=True))
    assert_loads(mgr.path(5), again)
    assert_loads(mgr.path(6), state(6, salt=1.0))


def retention_after_a_rewrite(root: str, rewrite) -> None:
    mgr = distckpt.CheckpointManager(root, incremental=True, no_dist=True)
    mgr.save(1, state(1))
    mgr.save(2, state(2))
    rewrite(mgr.path(2))
    assert_loads(mgr.path(2), state(2))
    mgr.delete(1)
    assert_loads(mgr.path(2), state(2))
    mgr.save(3, state(3))
    mgr.apply_retention()
    assert_loads(mgr.path(2), state(2))
    assert_loads(mgr.path(3), state(3))


def many_keys(step: int) -> dict:
    """A state whose data file's header runs to kilobytes: where its save id sits in it is anywhere."""
    return {**state(step), **{f"layers.{i}.weight": torch.full((8,), float(i)) for i in range(40)}}


def a_reserialised_header_is_still_its_save(root: str, how: str = "reordered") -> None:
    mgr = distckpt.CheckpointManager(root, incremental=True, no_dist=True)
    mgr.save(1, many_keys(1))
    mgr.save(2, many_keys(2))
    assert rewritten.header_reordered(mgr.path(1), [mgr.path(1), mgr.path(2)], how)
    assert_loads(mgr.path(2), many_keys(2))
    mgr.delete(1)  # step 1 is retired; its file is found under its save id by parsing its header
    assert_loads(mgr.path(2), many_keys(2))
    report = distckpt.compaction.compact(mgr.path(2))
    assert report.files >= 1
    assert_loads(mgr.path(2), many_keys(2))


@pytest.fixture(params=["disk", "memory"])
def root(request, tmp_path):
    clear_memory_store()
    yield str(tmp_path / "run") if request.param == "disk" else f"memory://lifecycle-{uuid.uuid4().hex[:8]}"
    clear_memory_store()


def test_an_overwrite_in_an_incremental_run_keeps_every_step_loadable(root):
    overwrite_a_step_of_an_incremental_run(root)


@pytest.mark.parametrize("rewrite", sorted(rewritten.REWRITES))
def test_retention_reads_a_document_written_another_way_as_the_loader_does(root, rewrite):
    retention_after_a_rewrite(root, rewritten.REWRITES[rewrite])


@pytest.mark.parametrize("how", rewritten.HEADER_REWRITES)
def test_a_referenced_file_whose_header_was_written_again_is_found_by_its_save_and_compacted(root, how):
    a_reserialised_header_is_still_its_save(root, how)


def test_a_document_of_an_unknown_major_version_keeps_every_file_it_could_reference(tmp_path):
    from tests.security.helpers import read_body, write_body

    mgr = distckpt.CheckpointManager(str(tmp_path / "run"), incremental=True, no_dist=True)
    mgr.save(1, state(1))
    mgr.save(2, state(2))
    body = read_body(mgr.path(2), per_key=False)
    body["format_version"] = "9.0"
    write_body(mgr.path(2), body)
    mgr.delete(1)
    body["format_version"] = "4.0"
    write_body(mgr.path(2), body)
    assert_loads(mgr.path(2), state(2))


def test_a_step_copied_out_of_its_run_names_compact_as_the_fix(tmp_path):
    import shutil

    mgr = distckpt.CheckpointManager(str(tmp_path / "run"), incremental=True, no_dist=True)
    mgr.save(1, state(1))
    mgr.save(2, state(2))
    copy = str(tmp_path / "elsewhere" / "step-2")
    shutil.copytree(mgr.path(2), copy)
    with pytest.raises(distckpt.CheckpointNotFoundError, match=r"distckpt compact"):
        distckpt.load({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state(0).items()}, checkpoint_id=copy,
                      no_dist=True)
    with pytest.raises(distckpt.CheckpointNotFoundError, match=r"incomplete.*step-0000000001.*distckpt compact"):
        distckpt.verify(copy)
    assert "distckpt compact" in distckpt.verify(copy, raise_on_error=False).problems[0]
    from click.testing import CliRunner

    from distckpt.cli import main as cli

    listed = CliRunner().invoke(cli, ["verify", copy])
    assert listed.exit_code == 3 and "incomplete" in listed.output and "damaged" not in listed.output, listed.output
    distckpt.compaction.compact(mgr.path(2))
    shutil.rmtree(copy)
    shutil.copytree(mgr.path(2), copy)
    assert_loads(copy, state(2))


@pytest.mark.parametrize("planted", ["fifo", "symlink"])
def test_a_link_or_fifo_where_a_retired_step_was_is_passed_over_for_the_retired_copy(tmp_path, planted):
    import os

    mgr = distckpt.CheckpointManager(str(tmp_path / "run"), incremental=True, no_dist=True)
    mgr.save(1, state(1))
    mgr.save(2, state(2))
    mgr.delete(1)  # retired: step 2 reads step 1's file from the retired copy
    os.mkdir(mgr.path(1))
    where = os.path.join(mgr.path(1), "data-00000.safetensors")
    os.mkfifo(where) if planted == "fifo" else os.symlink(str(tmp_path / "elsewhere"), where)
    assert_loads(mgr.path(2), state(2))


def test_a_damaged_referenced_file_is_called_damaged_not_missing(tmp_path):
    import os

    from click.testing import CliRunner

    from distckpt.cli import main as cli

    mgr = distckpt.CheckpointManager(str(tmp_path / "run"), incremental=True, no_dist=True)
    mgr.save(1, state(1))
    mgr.save(2, state(2))
    path = os.path.join(mgr.path(1), "data-00000.safetensors")
    with open(path, "r+b") as f:
        f.write(b"\xff" * 8)  # the header's length: damaged
    with pytest.raises(distckpt.CorruptCheckpointError, match="step-0000000001.*damaged"):
        distckpt.load({k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in state(2).items()},
                      checkpoint_id=mgr.path(2), no_dist=True)
    report = distckpt.verify(mgr.path(2), raise_on_error=False)
    assert report.problems and not any("incomplete" in p for p in report.problems), report.problems
    listed = CliRunner().invoke(cli, ["verify", mgr.path(2)])
    assert listed.exit_code == 1 and "damaged" in listed.output, listed.output


def test_delete_waits_for_the_managers_async_save_that_references_the_step(tmp_path):
    def pairs(step):  # "pair" changes at every even step: an odd step references what the step before wrote itself
        return {**state(step), "pair": torch.full((4096,), float(step // 2))}

    mgr = distckpt.CheckpointManager(str(tmp_path / "run"), incremental=True, no_dist=True)
    for step in (2, 4, 6):
        mgr.save(step, pairs(step))
        handle = mgr.async_save(step + 1, pairs(step + 1))  # references step's own file
        mgr.delete(step)
        handle.result()
        assert_loads(mgr.path(step + 1), pairs(step + 1))


def test_an_overwrite_of_a_memory_step_whose_document_cannot_be_read_is_refused(tmp_path):
    root = f"memory://unreadable-{uuid.uuid4().hex[:8]}"
    clear_memory_store()
    mgr = distckpt.CheckpointManager(root, incremental=True, no_dist=True)
    mgr.save(1, state(1))
    mgr.save(2, state(2))
    store = backends.store_for(mgr.path(1))
    blob = store.open("metadata.json")
    document = blob.pread(blob.size, 0)
    import re

    from distckpt.format.checksum import crc32c

    store.put_atomic("metadata.json", re.sub(rb'"format_version":"[0-9.]+"', b'"format_version":"9.0"', document, count=1),
                     sync=False)

    raw = store.open("metadata.json").pread(10**7, 0)
    body = raw[: raw.rindex(b',"crc32c":')]
    store.put_atomic("metadata.json", body + b',"crc32c":"' + f"{crc32c(body):08x}".encode() + b'"}\n', sync=False)
    with pytest.raises(distckpt.CheckpointError, match="cannot read"):
        distckpt.save(state(1), checkpoint_id=mgr.path(1), storage_writer=backends.writer_for(mgr.path(1), overwrite=True),
                      no_dist=True)
    assert_loads(mgr.path(2), state(2))
    clear_memory_store()


def test_a_memory_run_notices_its_base_was_compacted_by_another_manager():
    root = f"memory://base-{uuid.uuid4().hex[:8]}"
    clear_memory_store()
    mgr = distckpt.CheckpointManager(root, incremental=True, no_dist=True)
    mgr.save(1, state(1))
    mgr.save(2, state(2))
    mgr.delete(1)
    other = distckpt.CheckpointManager(root, incremental=True, no_dist=True)
    other.compact(2)  # step 2 now holds step 1's file under a new name; the retired copy goes
    other.remove_stale_temporaries()
    mgr.save(3, state(3))  # its base changed: a full save, not references to the swept file
    assert_loads(mgr.path(3), state(3))
    clear_memory_store()


def test_a_compaction_that_fails_leaves_no_copy_behind(tmp_path):
    import os

    mgr = distckpt.CheckpointManager(str(tmp_path / "run"), incremental=True, no_dist=True)
    mgr.save(1, many_keys(1))
    mgr.save(2, {**many_keys(2), "emb": torch.ones(32, 16) * 7})
    mgr.save(3, {**many_keys(3), "emb": torch.ones(32, 16) * 7})  # references steps 1 and 2
    before = sorted(os.listdir(mgr.path(3)))
    with open(os.path.join(mgr.path(2), "data-00000.safetensors"), "r+b") as f:
        f.write(b"\xff" * 8)
    for _ in range(3):
        with pytest.raises(distckpt.CheckpointError):
            mgr.compact(3)
    assert sorted(os.listdir(mgr.path(3))) == before


def test_an_overwrite_that_fails_after_its_swap_keeps_what_the_user_kept_in_the_step(tmp_path, monkeypatch):
    import errno
    import os

    from distckpt import faults

    monkeypatch.setenv("DISTCKPT_FSYNC", "1")
    root = str(tmp_path / "run")
    mgr = distckpt.CheckpointManager(root, no_dist=True)
    mgr.save(1, state(1))
    with open(os.path.join(mgr.path(1), "notes.txt"), "w") as f:
        f.write("the user's")
    fired = []

    def after_swap(kind, what):  # the fsync of the run's directory right after the exchange
        if not fired and os.path.abspath(what) == os.path.abspath(root):
            fired.append(what)
            raise OSError(errno.EIO, "Input/output error (injected)")

    with faults.inject(faults.Fault("call", kinds=("fsync",), callback=after_swap)):
        with pytest.raises(distckpt.CheckpointError):
            mgr.save(1, state(1, salt=2.0), storage_writer=backends.writer_for(mgr.path(1), overwrite=True))
    assert fired
    assert_loads(mgr.path(1), state(1, salt=2.0))  # the swap had committed the new step
    with open(os.path.join(mgr.path(1), "notes.txt")) as f:  # carried into it, as a whole overwrite does
        assert f.read() == "the user's"
