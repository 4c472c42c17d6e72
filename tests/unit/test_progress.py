"""Save and load report progress as DISTCKPT_PROGRESS asks: log lines or a bar."""

import logging
import re
import sys

import pytest
import torch

import distckpt
from distckpt.testing.states import seeded


def _state():
    return seeded({"a": (1000, 100), "b": torch.arange(10)}, values={"step": 3})


def test_log_mode_reports_every_byte_of_save_and_load(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("DISTCKPT_PROGRESS", "log")
    sd = _state()
    with caplog.at_level(logging.INFO, logger="distckpt"):
        distckpt.save(sd, checkpoint_id=tmp_path / "ck")
        out = {"a": torch.zeros(1000, 100), "b": torch.zeros(10, dtype=torch.int64), "step": 0}
        distckpt.load(out, checkpoint_id=tmp_path / "ck")
    lines = [r.getMessage() for r in caplog.records if r.name == "distckpt"]
    tensor_bytes = 1000 * 100 * 4 + 10 * 8
    save_done = [m for m in lines if m.startswith("rank 0: save done")]
    load_done = [m for m in lines if m.startswith("rank 0: load done")]
    assert save_done and load_done, lines
    assert "(100%)" in save_done[0] and "(100%)" in load_done[0]
    done, total = (float(x) for x in re.search(r"done: ([0-9.]+) kB of ([0-9.]+) kB", load_done[0]).groups())
    assert done == total and abs(total * 1e3 - tensor_bytes) < 100, load_done[0]  # the tensors, and the step's bytes
    assert torch.equal(out["a"], sd["a"])


def test_bar_mode_draws_a_bar_and_off_is_silent(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DISTCKPT_PROGRESS", "bar")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)  # capsys's stream, as a terminal
    distckpt.save(_state(), checkpoint_id=tmp_path / "ck")
    assert "distckpt save (rank 0)" in capsys.readouterr().err
    monkeypatch.setenv("DISTCKPT_PROGRESS", "off")
    distckpt.save(_state(), checkpoint_id=tmp_path / "ck2")
    assert capsys.readouterr().err == ""


def test_unknown_mode_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTCKPT_PROGRESS", "loud")
    with pytest.raises(distckpt.CheckpointError, match="DISTCKPT_PROGRESS='loud'"):
        distckpt.save(_state(), checkpoint_id=tmp_path / "ck")


def test_bar_mode_off_a_terminal_writes_lines_instead_of_frames(tmp_path, monkeypatch, capsys):
    """Off a terminal (a job's log file, a notebook) a bar becomes lines on stderr, whatever logging is configured:
    with none, INFO records are dropped, and a bar asked for must show something."""
    monkeypatch.setenv("DISTCKPT_PROGRESS", "bar")  # capsys's standard error is no terminal, as a log file is not
    logging.getLogger("distckpt").setLevel(logging.WARNING)  # no logging configured for INFO
    try:
        distckpt.save(_state(), checkpoint_id=tmp_path / "ck")
    finally:
        logging.getLogger("distckpt").setLevel(logging.NOTSET)
    err = capsys.readouterr().err
    assert "\r" not in err and "distckpt: rank 0: save done" in err and "kB" in err, err
