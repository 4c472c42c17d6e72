"""HuggingFaceWriter, the streaming conversions and the re-layout planners attacked as a stranger would: input that
lies (sizes, shard numbers, names, configs, layer counts, keys built to make a template backtrack), a second process
changing the staging directory, and ranks that disagree. Each gets a typed error naming what is wrong, before
anything is committed, or correct bytes; nothing hangs."""

from __future__ import annotations

import os
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import distckpt
from distckpt import faults
from distckpt.planning import Drop, Unstack
from distckpt.testing import run_ranks

from . import hf_publish_hostile_workers as w

W = distckpt.HuggingFaceWriter


def _publish(state: dict, path: str, **kwargs) -> None:
    distckpt.save(state, storage_writer=W(path, **kwargs), no_dist=True)


# ---------------------------------------------------------------- input that lies: sizes and shard numbers


def test_a_max_shard_size_too_large_for_a_float_is_a_typed_error(tmp_path):
    with pytest.raises(distckpt.CheckpointError, match="max_shard_size"):
        W(str(tmp_path / "out"), max_shard_size="9" * 400 + "GB")
    assert W(str(tmp_path / "out"), max_shard_size=10**30).max_shard_size == 10**30


def test_shard_numbers_of_a_mapping_name_files_they_do_not_count_them(tmp_path):
    state = {"x": torch.arange(4.0), "y": torch.arange(3)}
    path = str(tmp_path / "gaps")
    _publish(state, path, fqn_to_index_mapping={"x": 2, "y": 5})
    # only the shards that hold a tensor exist: no empty files the index never names
    assert sorted(os.listdir(path)) == ["model-00002-of-00005.safetensors", "model-00005-of-00005.safetensors",
                                        "model.safetensors.index.json"]
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    distckpt.load(back, checkpoint_id=path, no_dist=True)
    assert all(torch.equal(back[k], state[k]) for k in state)
    # a shard number of a billion is one file with that number, not a billion groups and files
    start = time.monotonic()
    _publish({"x": torch.ones(2)}, str(tmp_path / "huge"), fqn_to_index_mapping={"x": 10**9})
    assert time.monotonic() - start < 10
    assert sorted(os.listdir(tmp_path / "huge")) == ["model-1000000000-of-1000000000.safetensors", "model.safetensors.index.json"]


@pytest.mark.parametrize("name", ["a\0b", "__metadata__", "k" * 5000, ""])
def test_a_name_no_safetensors_header_holds_is_refused_with_a_shard_mapping_too(tmp_path, name):
    target = str(tmp_path / "out")
    with pytest.raises(distckpt.CheckpointError, match="not a name a safetensors header can hold"):
        _publish({name: torch.ones(2), "ok": torch.ones(1)}, target, fqn_to_index_mapping={name: 1, "ok": 2})
    assert os.listdir(tmp_path) == []  # nothing staged, nothing committed


def test_writer_options_of_the_wrong_kind_are_typed_errors(tmp_path):
    target = str(tmp_path / "out")
    with pytest.raises(distckpt.CheckpointError, match="a path is a str"):
        W(target.encode())
    with pytest.raises(distckpt.CheckpointError, match="fqn_to_index_mapping"):
        W(target, fqn_to_index_mapping=["w"])
    with pytest.raises(distckpt.CheckpointError, match="shard numbers are ints"):
        _publish({"w": torch.ones(2), "v": torch.ones(2)}, target, fqn_to_index_mapping={"w": "1", "v": 2})
    with pytest.raises(distckpt.CheckpointError, match="metadata"):
        W(target, metadata=[("a", "b")])
    # the shards say what from_pretrained reads them as: format "pt", whatever metadata= holds
    with pytest.raises(distckpt.CheckpointError, match="format 'tf'"):
        W(target, metadata={"format": "tf"})
    assert os.listdir(tmp_path) == []


def test_an_empty_path_is_no_directory(tmp_path, monkeypatch):
    """"hf://" names no directory: a publish there must not take the working directory (it was removed and replaced)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    before = os.stat(cwd).st_ino
    for kwargs in ({"checkpoint_id": "hf://"}, {"storage_writer": W("")}):
        with pytest.raises(distckpt.CheckpointError, match="no path"):
            distckpt.save({"w": torch.ones(2)}, no_dist=True, **kwargs)
    assert os.stat(cwd).st_ino == before and os.listdir(cwd) == [] and os.listdir(tmp_path) == ["cwd"]


def test_an_object_store_url_is_refused_not_made_a_local_directory(tmp_path, monkeypatch):
    """HuggingFaceWriter writes local (or mounted) directories: "s3://bucket/m" made local was ./s3:/bucket/m, and the
    caller, who saves distckpt's own checkpoints to s3:// with the same spelling, believed the model uploaded."""
    monkeypatch.chdir(tmp_path)
    for url in ("s3://bucket/model", "hf://gs://bucket/model"):
        with pytest.raises(distckpt.CheckpointError, match="local"):
            _publish({"w": torch.ones(2)}, url)
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- input that lies: config


def _deep(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    return str(path)


def _not_utf8(tmp_path):
    path = tmp_path / "latin1.json"
    path.write_bytes(b'{"name": "caf\xe9"}')
    return str(path)


class _BytesConfig:
    def to_json_string(self, use_diff=True):
        return b"{}"


def _circular():
    d: dict = {}
    d["self"] = d
    return d


@pytest.mark.parametrize("kind", ["nested too deep", "not utf-8", "a dtype in a dict", "mixed key types", "circular",
                                  "to_json_string gives bytes"])
def test_a_config_that_is_not_json_text_is_a_typed_error_at_once(tmp_path, kind):
    config = {"nested too deep": lambda: _deep(tmp_path), "not utf-8": lambda: _not_utf8(tmp_path),
              "a dtype in a dict": lambda: {"torch_dtype": torch.float16}, "mixed key types": lambda: {1: 2, "a": 3},
              "circular": _circular, "to_json_string gives bytes": _BytesConfig}[kind]()
    with pytest.raises(distckpt.CheckpointError, match=r"config"):
        W(str(tmp_path / "out"), config=config)


# ---------------------------------------------------------------- shared ground: the staging directory


def _swap_at_config(tmp_path, swap):
    """Publish with a config; ``swap(staging)`` runs when the coordinator writes config.json, after every rank wrote."""
    target = str(tmp_path / "out")

    def hook(kind: str, what: str) -> None:
        if kind == "write" and what.endswith("config.json"):
            swap(os.path.dirname(what))

    with pytest.raises(distckpt.CorruptCheckpointError, match="not the"):
        with faults.inject(faults.Fault("call", None, callback=hook)):
            _publish({"w": torch.arange(8.0)}, target, config={"model_type": "x"})
    assert not os.path.lexists(target)  # nothing committed


def test_a_shard_replaced_in_the_staging_directory_is_not_committed(tmp_path):
    def swap(staging):
        shard = os.path.join(staging, "model.safetensors")
        forged = shard + ".forged"
        with open(shard, "rb") as f:
            header = f.read(os.path.getsize(shard) - 32)
        with open(forged, "wb") as f:  # same header, same size, other bytes: only its identity tells it apart
            f.write(header + torch.full((8,), 7.0).numpy().tobytes())
        os.replace(forged, shard)

    _swap_at_config(tmp_path, swap)
    assert os.listdir(tmp_path) == []  # the staging directory removed, the lease released


def test_a_staging_directory_replaced_by_a_link_is_not_committed(tmp_path):
    def swap(staging):
        elsewhere = str(tmp_path / "attacker")
        os.rename(staging, elsewhere)
        os.symlink(elsewhere, staging)

    _swap_at_config(tmp_path, swap)


# ---------------------------------------------------------------- ranks that disagree


def test_ranks_whose_chunks_overlap_commit_nothing(tmp_path):
    """Rank 2 claims a replica of "w" that ranks 0 and 1 shard: its chunk starts where rank 0's does, so the
    metadata records rank 0's and the cover check passes, but rank 2's bytes would land over both."""
    path = str(tmp_path / "out")
    results = run_ranks(w.placements_disagree, 3, path, timeout_s=120)
    if all(r is None for r in results):
        pytest.fail(f"published with overlapping chunks: {load_file(os.path.join(path, 'model.safetensors'))}")
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} did not raise"
        name, text, seconds = result
        assert "'w'" in text and "overlap" in text, (rank, text)
        assert seconds < 30
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- re-layout: checkpoints that lie


@pytest.mark.xfail(strict=True, reason="values are decoded while the read engine fills tensors, so a value refused "
                   "late (pickled, damaged) leaves the tensors loaded; the default planner does the same. The fix belongs "
                   "in the load sequence or DefaultLoadPlanner (decode and check values before any tensor is filled), "
                   "not in the relayout planner")
def test_a_value_refused_during_a_relayout_load_leaves_the_model_untouched(tmp_path):
    import fractions

    path = str(tmp_path / "ck")
    distckpt.save({"w": torch.ones(4), "obj": fractions.Fraction(1, 3)}, checkpoint_id=path,
                  planner=distckpt.DefaultSavePlanner(allow_pickle=True), no_dist=True)
    state = {"w": torch.zeros(4), "obj": None}
    with pytest.raises(distckpt.CheckpointError, match="'obj'"):
        distckpt.load(state, checkpoint_id=path, planner=distckpt.RelayoutLoadPlanner([]), no_dist=True)
    assert torch.equal(state["w"], torch.zeros(4)), "the load failed but filled the model's tensor"




def test_an_unstack_of_a_checkpoint_claiming_a_trillion_layers_is_a_shape_error(tmp_path):
    os.makedirs(tmp_path / "hf")
    save_file({"w": torch.empty((10**12, 0))}, str(tmp_path / "hf" / "model.safetensors"))
    state = {f"layers.{i}.w": torch.empty(0) for i in range(2)}
    planner = distckpt.RelayoutLoadPlanner([Unstack("w", "layers.{i}.w")])
    with pytest.raises(distckpt.CheckpointError, match=r"stacks 1000000000000 layers.*lacks \['layers.2.w'"):
        distckpt.load(state, checkpoint_id=str(tmp_path / "hf"), planner=planner, no_dist=True)


def test_a_checkpoint_key_built_to_make_a_template_backtrack_costs_linear_time(tmp_path):
    os.makedirs(tmp_path / "hf")
    long_key = "a." * 1500 + "zz"  # 3002 characters: a key a Hugging Face header may hold
    save_file({"w": torch.ones(2), long_key: torch.ones(1)}, str(tmp_path / "hf" / "model.safetensors"))
    planner = distckpt.RelayoutLoadPlanner([Drop("{*a}.{*b}.{*c}.skip")])
    start = time.monotonic()
    with pytest.raises(distckpt.UnexpectedKeyError, match="a.a.a"):
        distckpt.load({"w": torch.zeros(2)}, checkpoint_id=str(tmp_path / "hf"), planner=planner, no_dist=True)
    assert time.monotonic() - start < 2


def _reference(template: str, layer: bool):
    """The regular expression a template stood for, as the backtracking matcher ran it."""
    import re

    out, pos = [], 0
    for m in re.finditer(r"\{(\*?)([A-Za-z_][A-Za-z0-9_]*)\}", template):
        out.append(re.escape(template[pos:m.start()]))
        group = "0|[1-9][0-9]*" if layer and m.group(2) == "i" else ".+" if m.group(1) else "[^.]+"
        out.append(f"(?P<{m.group(2)}>{group})")
        pos = m.end()
    out.append(re.escape(template[pos:]))
    return re.compile("".join(out))


@pytest.mark.parametrize("template", ["{*a}.{b}.x.{*c}", "{x}_{*y}", "p{a}{b}q", "{*a}{*b}", "{a}.{*b}.{c}", "w",
                                      "l.{i}.{n}", "{*p}.{i}{i2}", "{i}", "{*a}0{i}"])
def test_templates_capture_what_the_regular_expressions_captured(template):
    """The matcher that replaced the regular expressions captures what they captured (the first placeholder
    longest), on keys over an alphabet of the characters that matter."""
    import random

    from distckpt.planning import Relayout, Rename

    layer = "{i}" in template
    names = _reference(template, False).groupindex
    if layer:
        other = "s" + "".join("{" + ("*" if "{*" + n + "}" in template else "") + n + "}" for n in names if n != "i")
        rule = Unstack(other, template)
    else:
        rule = Rename(template, template)
    reference = _reference(template, layer)
    rng = random.Random(template)
    alphabet = ["a", ".", "0", "1", "9", "_", "x", "\n", "p", "q", "w", "l", "é"]
    for _ in range(3000):
        key = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 9)))
        m = reference.fullmatch(key)
        hit = Relayout([rule]).match(key)
        assert (hit is None) == (m is None), (template, key, hit)
        if m is not None:
            assert hit[2] == m.groupdict(), (template, key, hit[2], m.groupdict())
