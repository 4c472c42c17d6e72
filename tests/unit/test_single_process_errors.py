"""A single process raises the error itself: its own type and message, once, with no "failed on 1 rank(s)"."""

import subprocess
import sys
import textwrap
import traceback

import pytest
import torch

import distckpt
from distckpt.errors import MissingKeyError, RankFailuresError


def test_an_error_of_the_family_is_raised_as_it_is(tmp_path):
    distckpt.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "ck")
    with pytest.raises(MissingKeyError) as info:
        distckpt.load({"w": torch.zeros(2), "gone": torch.zeros(1)}, checkpoint_id=tmp_path / "ck")
    assert type(info.value).__name__ == "MissingKeyError" and isinstance(info.value, distckpt.CheckpointException)
    assert "rank(s)" not in str(info.value) and info.value.__cause__ is None
    text = "".join(traceback.format_exception(info.value))
    assert text.count("Missing key in checkpoint state_dict") == 1, text


class _Broken:
    def state_dict(self):
        raise ValueError("the optimizer is broken")

    def load_state_dict(self, sd):
        pass


def test_any_other_error_keeps_its_words_once_and_stays_in_the_family(tmp_path):
    with pytest.raises(RankFailuresError) as info:
        distckpt.save({"opt": _Broken(), "w": torch.ones(2)}, checkpoint_id=tmp_path / "ck")
    assert "rank(s)" not in str(info.value) and "ValueError: the optimizer is broken" in str(info.value)
    text = "".join(traceback.format_exception(info.value))
    assert text.count("the optimizer is broken") == 2, text  # the message, and the line that raised it
    assert "direct cause" not in text and "_Broken" not in str(info.value)
    assert "state_dict" in text  # the traceback is where the error was raised
    assert not (tmp_path / "ck").exists()


def test_s3_without_boto3_names_the_extra_to_install():
    code = textwrap.dedent("""
        import sys
        sys.modules["boto3"] = None
        sys.modules["botocore"] = None
        import torch, distckpt
        for call in (distckpt.save, distckpt.load):
            try:
                call({"w": torch.ones(3)}, checkpoint_id="s3://bucket/run/step-1")
            except distckpt.CheckpointError as exc:
                print(type(exc).__name__, "|", exc, "|", exc.__cause__)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2, (out.stdout, out.stderr)
    for line in lines:
        expected = "s3:// checkpoints: needs boto3, which is not installed: pip install 'distckpt[s3]'"
        assert line == f"MissingDependencyError | {expected} | None", line
