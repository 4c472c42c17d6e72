"""distckpt.open, `distckpt cat` and `distckpt diff` attacked as a stranger would (HOSTILE.md): indices torch
reads otherwise, stored sizes that lie through a codec, value pairs that compare equal in Python but differ,
checkpoints whose data files a checksum-only diff would never open, rows larger than the memory budget."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import distckpt
from distckpt.errors import CheckpointIndexError

from .helpers import make_checkpoint


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("good") / "ck")
    return path, make_checkpoint(path)


# ------------------------------------------------------------------------------------------------ indices


@pytest.mark.parametrize("index", [torch.tensor([3]), torch.tensor([[3]]), torch.tensor(True), torch.tensor(1, dtype=torch.uint8),
                                   (slice(0, 2), torch.tensor([1])), np.array([3])],
                         ids=["one-element", "one-element-2d", "bool-0d", "uint8-0d", "second-dim", "numpy-1d"])
def test_an_index_torch_reads_as_advanced_or_a_mask_is_refused_not_taken_as_an_int(good, index):
    """A one-element tensor has __index__, but torch indexes with it as a list (keeping the dimension), and a bool
    or uint8 tensor as a mask: taken as an int, the slice came back of another shape, with other elements."""
    path, sd = good
    with distckpt.open(path) as ckpt:
        with pytest.raises(CheckpointIndexError, match="read it whole"):
            ckpt["w"][index]
        # what torch takes as an int still is one
        for as_int in (torch.tensor(3), np.int64(3), np.array(3)):
            assert torch.equal(ckpt["w"][as_int], sd["w"][3])


def test_a_step_beyond_64_bits_reads_one_row_not_a_runtime_error(good):
    path, sd = good
    with distckpt.open(path) as ckpt:
        got = ckpt["w"][::1 << 100, 1 << 70::1 << 64]
        assert got.shape == (1, 0)
        assert torch.equal(ckpt["w"][5::1 << 100], sd["w"][5:6])
        assert torch.equal(ckpt["ids"][-(1 << 80):1 << 80:1 << 65], sd["ids"][0:1])


# ------------------------------------------------------------------------------------------------ sizes that lie


_PEAK = """
import resource, sys, distckpt
from distckpt.errors import CorruptCheckpointError
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    with distckpt.open(sys.argv[1]) as ckpt:
        ckpt["w"][0]
    print("read")
except CorruptCheckpointError as exc:
    print("refused:", exc)
print("grew", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_a_compressed_chunk_claiming_a_huge_size_is_refused_without_filling_the_claim(tmp_path):
    """A chunk stored through a codec has no stored length to check its claimed size against: the decoder was
    handed a zero-filled buffer of the claimed size first (here 1 GiB for 12 KiB of zeros), so a slice of one
    row of a forged checkpoint of a few KiB made the reader take the whole claim in memory."""
    from distckpt import FileSystemWriter, ZStandard

    from .helpers import read_body, write_body

    path = str(tmp_path / "zstd")
    distckpt.save({"w": torch.zeros(64, 48)}, storage_writer=FileSystemWriter(path, _extensions=[ZStandard()]))
    body = read_body(path)
    entry = body["state_dict_metadata"]["w"]
    assert entry["chunks"][0][5]["codec"] != ["identity"]
    entry["size"] = entry["chunks"][0][1] = [1 << 22, 64]  # 1 GiB of float32 claimed
    write_body(path, body)
    out = _python(_PEAK, path)
    assert "refused:" in out and "'w'" in out and "not the 1073741824" in out, out
    assert int(out.rsplit("grew", 1)[1]) < 256, out  # MiB


def _python(script, *args):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


# ------------------------------------------------------------------------------------------------ diff's verdicts


def _diff_cli(*args):
    from click.testing import CliRunner

    from distckpt.cli import main

    result = CliRunner().invoke(main, ["diff", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output


@pytest.mark.parametrize("a, b", [({"lr": 1}, {"lr": 1.0}), ({"flag": True}, {"flag": 1}), (0.0, -0.0),
                                  ([1, 2], [1.0, 2]), ({"k": (1, [0.0])}, {"k": (1, [-0.0])}), ([{1: "x"}], [{True: "x"}])],
                         ids=["int-float", "bool-int", "signed-zero", "in-a-list", "nested", "dict-key"])
def test_values_that_python_calls_equal_but_that_differ_are_reported_as_differing(tmp_path, a, b):
    """A value came back as the same where == said so: 1, 1.0 and True, 0.0 and -0.0, nested anywhere."""
    from distckpt.diffing import diff

    distckpt.save({"v": a}, checkpoint_id=str(tmp_path / "a"))
    distckpt.save({"v": b}, checkpoint_id=str(tmp_path / "b"))
    report = diff(str(tmp_path / "a"), str(tmp_path / "b"))
    assert not report.identical, report.to_dict()
    assert report.differ and all(e["decided_by"] == "value" for e in report.differ) and not report.same


def test_values_equal_by_content_are_the_same_even_where_python_compares_identity(tmp_path):
    """A BytesIO (DCP's opaque bytes) equals only itself in Python: a checkpoint was reported to differ from
    itself. A NaN nested in a value, and dicts whose items come in another order, are the same too."""
    import io

    path = str(tmp_path / "ck")
    distckpt.save({"blob": io.BytesIO(b"opaque"), "cfg": {"x": [float("nan")], "a": 1, "b": 2}}, checkpoint_id=path)
    other = str(tmp_path / "other")
    distckpt.save({"blob": io.BytesIO(b"opaque"), "cfg": {"b": 2, "a": 1, "x": [float("nan")]}}, checkpoint_id=other)
    code, out = _diff_cli(path, path)
    assert code == 0 and "the same" in out, out
    code, out = _diff_cli(path, other)
    assert code == 0, out
    distckpt.save({"blob": io.BytesIO(b"opaquE"), "cfg": {"b": 2, "a": 1, "x": [float("nan")]}}, checkpoint_id=str(tmp_path / "c"))
    code, out = _diff_cli(path, str(tmp_path / "c"))
    assert code == 1 and "! blob differs" in out, out


def test_pickled_values_are_compared_by_their_stored_bytes_never_unpickled(tmp_path):
    """diff refused a pair of checkpoints holding pickled values (exit 4, "pass allow_pickle=True to load", which
    the command cannot take); cat's refusal named the same inapplicable fix."""
    import datetime

    from click.testing import CliRunner

    from distckpt.cli import main

    planner = distckpt.DefaultSavePlanner(allow_pickle=True)
    for name, day in (("a", 1), ("b", 1), ("c", 2)):
        distckpt.save({"when": datetime.date(2020, 1, day), "n": 3}, checkpoint_id=str(tmp_path / name), planner=planner)
    code, out = _diff_cli(str(tmp_path / "a"), str(tmp_path / "b"))
    assert code == 0 and "2 key(s) the same" in out, out
    code, out = _diff_cli(str(tmp_path / "a"), str(tmp_path / "c"))
    assert code == 1 and "! when differs" in out, out
    result = CliRunner().invoke(main, ["cat", str(tmp_path / "a"), "when"])
    assert result.exit_code == 4 and "'when'" in result.output and "never" in result.output, result.output
    with distckpt.open(str(tmp_path / "a"), allow_pickle=True) as ckpt:
        assert ckpt["when"] == datetime.date(2020, 1, 1)


@pytest.mark.parametrize("damage", ["missing", "truncated", "another-save"])
def test_a_checksum_verdict_is_not_given_for_a_checkpoint_whose_data_files_are_not_there(good, tmp_path, damage):
    """diff decides tensors stored alike by the checksums in the metadata, reading no chunk: a copy of a
    checkpoint whose data files were missing, truncated or another save's was "the same" (exit 0) as its
    original. Each data file a checksum verdict speaks for is validated (size, header, save id) first."""
    from .helpers import copy

    path, _ = good
    ck = copy(path, str(tmp_path / "ck"))
    name = os.path.join(ck, next(n for n in sorted(os.listdir(ck)) if n.endswith(".safetensors")))
    body = str(tmp_path / "tensors-only")
    distckpt.save({k: v for k, v in make_checkpoint(str(tmp_path / "tmp")).items() if isinstance(v, torch.Tensor)},
                  checkpoint_id=body)
    data = os.path.join(body, os.path.basename(name))
    twin = copy(body, str(tmp_path / "twin"))
    if damage == "missing":
        os.unlink(os.path.join(twin, os.path.basename(name)))
    elif damage == "truncated":
        os.truncate(os.path.join(twin, os.path.basename(name)), os.path.getsize(data) - 1)
    else:
        other = str(tmp_path / "other")
        distckpt.save({k: v for k, v in make_checkpoint(str(tmp_path / "tmp2")).items() if isinstance(v, torch.Tensor)},
                      checkpoint_id=other)
        os.replace(os.path.join(other, os.path.basename(name)), os.path.join(twin, os.path.basename(name)))
    code, out = _diff_cli(body, twin)
    assert code in (3, 5) and "twin" in out and "Traceback" not in out, out
    code, out = _diff_cli(body, copy(body, str(tmp_path / "intact")))
    assert code == 0, out


def test_a_refused_file_is_named_with_its_checkpoint_so_diff_says_which_side(good, tmp_path):
    """A store names a FIFO or a link it refuses by its file name alone: `distckpt diff` of two checkpoints said
    "metadata.json is a FIFO" without saying which."""
    from .helpers import copy

    path, _ = good
    ck = copy(path, str(tmp_path / "fifo-side"))
    name = next(n for n in sorted(os.listdir(ck)) if n.endswith(".safetensors"))
    os.unlink(os.path.join(ck, name))
    os.mkfifo(os.path.join(ck, name))
    code, out = _diff_cli(path, ck, "--exact")
    assert code == 5 and "fifo-side" in out and "FIFO" in out, out
    os.unlink(os.path.join(ck, "metadata.json"))
    os.mkfifo(os.path.join(ck, "metadata.json"))
    code, out = _diff_cli(ck, path)
    assert code == 5 and "fifo-side" in out and "FIFO" in out, out


# ------------------------------------------------------------------------------------------------ cat's summary


def test_cat_of_uint64_gives_the_true_min_and_max(tmp_path):
    """uint64 has no min or max in torch: cast to int64, values past 2**63 came out negative (min -2**63, max 5
    for [2**64 - 1, 5, 2**63])."""
    from click.testing import CliRunner

    from distckpt.cli import main

    path = str(tmp_path / "ck")
    distckpt.save({"u": torch.tensor([2**64 - 1, 5, 2**63], dtype=torch.uint64)}, checkpoint_id=path)
    result = CliRunner().invoke(main, ["cat", path, "u", "--json"])
    assert result.exit_code == 0, result.output
    import json

    doc = json.loads(result.output)
    assert doc["min"] == 5 and doc["max"] == 2**64 - 1 and doc["head"] == [2**64 - 1, 5, 2**63]


_SUMMARY_PEAK = """
import resource, sys, distckpt
from distckpt.opening import summarize
with distckpt.open(sys.argv[1]) as ckpt:
    summarize(ckpt["small"])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    doc = summarize(ckpt["wide"])
print(doc["min"], doc["max"], doc["nan"])
print("grew", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_a_summary_of_rows_larger_than_the_budget_holds_about_one_row(tmp_path):
    """A piece is whole rows, so a row larger than the budget comes whole (one request larger than the budget goes
    through alone, as for load); the summary then converted the whole piece to float64, masked and copied it:
    about 3.6 rows of memory for a budget of 1 MiB. It converts a budget's worth of elements at a time."""
    import subprocess
    import sys

    path = str(tmp_path / "wide")
    wide = torch.ones(2, 8 << 20)  # rows of 32 MiB
    wide[1, 5] = float("nan")
    distckpt.save({"wide": wide, "small": torch.ones(4)}, checkpoint_id=path)
    del wide
    done = subprocess.run([sys.executable, "-c", _SUMMARY_PEAK, path], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "DISTCKPT_MEMORY_BUDGET_BYTES": str(1 << 20)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[0] == "1.0 1.0 1", done.stdout
    assert int(done.stdout.rsplit("grew", 1)[1]) < 48, done.stdout  # MiB: one row of 32 MiB, and little else


# ------------------------------------------------------------------------------------------------ close and threads


def test_close_while_another_thread_reads_never_gives_it_another_files_bytes(good, tmp_path, monkeypatch):
    """close() closed the data files under a read in flight: the reading thread's preadv then ran on a file
    descriptor number the process had meanwhile given to another file, and the slice came back with that file's
    bytes (a slice read in part has no checksum to tell). close() now waits for the reads in flight."""
    import threading

    path, sd = good
    decoy = tmp_path / "decoy"
    decoy.write_bytes(b"\x7f" * (1 << 16))
    entered, go = threading.Event(), threading.Event()
    real = os.preadv
    reader = {}

    def paused(fd, buffers, offset, *flags):
        if threading.current_thread() is reader.get("thread") and not go.is_set():
            reader["fd"] = fd
            entered.set()
            go.wait(5)
        return real(fd, buffers, offset, *flags)

    ckpt = distckpt.open(path)
    ckpt["w"][0:1]  # the data file is open and validated
    monkeypatch.setattr(os, "preadv", paused)
    out = {}

    def read():
        try:
            out["got"] = ckpt["w"][8:10]
        except distckpt.errors.CheckpointError as exc:
            out["error"] = exc

    reader["thread"] = threading.Thread(target=read)
    reader["thread"].start()
    assert entered.wait(5)
    closer = threading.Thread(target=ckpt.close)
    closer.start()
    closer.join(0.3)
    fd = os.open(decoy, os.O_RDONLY)
    try:
        try:
            os.fstat(reader["fd"])
        except OSError:  # close() gave the reader's number back: another file takes it, as any open() may
            os.dup2(fd, reader["fd"])
        go.set()
        reader["thread"].join(5)
        closer.join(5)
    finally:
        os.close(fd)
    assert not closer.is_alive() and ckpt.closed
    assert "error" in out or torch.equal(out["got"], sd["w"][8:10]), out


def test_cat_json_of_any_value_is_strict_json_and_never_a_traceback(tmp_path):
    """`cat --json` of a value holding a dict with tuple keys ended in a TypeError traceback (exit 1, "damaged"),
    a NaN came out as a bare NaN (not JSON), a BytesIO as "<_io.BytesIO object at 0x...>"."""
    import io
    import json

    from click.testing import CliRunner

    from distckpt.cli import main

    path = str(tmp_path / "ck")
    distckpt.save({"pairs": [{(1, 2): "x", 3: "y"}], "nan": float("nan"), "blob": io.BytesIO(b"ab")}, checkpoint_id=path)
    got = {}
    for key in ("pairs", "nan", "blob"):
        result = CliRunner().invoke(main, ["cat", path, key, "--json"])
        assert result.exit_code == 0 and result.exception is None or isinstance(result.exception, SystemExit), result.output
        got[key] = json.loads(result.output, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))["value"]
    assert got == {"pairs": [[[[1, 2], "x"], [3, "y"]]], "nan": "nan", "blob": "b'ab'"}
    result = CliRunner().invoke(main, ["cat", path, "blob"])
    assert result.output.strip() == "BytesIO(b'ab')"
