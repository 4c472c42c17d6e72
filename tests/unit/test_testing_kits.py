"""The shipped state helpers (distckpt.testing.states) tell states apart, so the tests built on them can fail."""

import pytest
import torch

from distckpt.testing.states import assert_same, blank_like, seeded


def test_seeded_is_reproducible_and_blank_like_keeps_shapes_and_dtypes():
    a = seeded({"w": (3, 4), "n": 5, "ids": torch.arange(3)}, seed=2, values={"step": 1, "cfg": {"lr": 0.1}})
    assert_same(a, seeded({"w": (3, 4), "n": 5, "ids": torch.arange(3)}, seed=2, values={"step": 1, "cfg": {"lr": 0.1}}))
    blank = blank_like(a)
    assert blank["w"].shape == (3, 4) and blank["ids"].dtype == torch.int64 and not blank["w"].any()
    assert blank["step"] is None and blank["cfg"] == {"lr": None}


@pytest.mark.parametrize("change", ["bytes", "dtype", "shape", "key", "value", "negative zero"])
def test_assert_same_names_the_key_that_differs(change):
    want = {"m": {"w": torch.zeros(4)}, "step": 3}
    got = {"m": {"w": torch.zeros(4)}, "step": 3}
    if change == "bytes":
        got["m"]["w"][2] = 1
    elif change == "dtype":
        got["m"]["w"] = got["m"]["w"].double()
    elif change == "shape":
        got["m"]["w"] = torch.zeros(2, 2)
    elif change == "key":
        got["m"]["x"] = got["m"].pop("w")
    elif change == "value":
        got["step"] = 4
    else:
        got["m"]["w"][0] = -0.0
    with pytest.raises(AssertionError, match="step" if change == "value" else "m"):
        assert_same(got, want)


def _where_am_i(rank, world_size):
    import os
    import sys

    return {"env": os.environ.get("DISTCKPT_KIT_PROBE"), "cwd": os.getcwd(), "path": sys.path[0],
            "rank": os.environ["RANK"]}


@pytest.mark.parametrize("start_method", [None, "spawn"])
def test_ranks_see_the_caller_s_environment_directory_and_path_of_the_moment(tmp_path, monkeypatch, start_method):
    """A fork server started by an earlier group holds the environment of its start; each rank must still get
    the caller's environment, working directory and sys.path as they are when the group starts."""
    from distckpt.testing import run_ranks

    run_ranks(_where_am_i, 1, start_method=start_method)  # the server (if any) starts before the changes below
    monkeypatch.setenv("DISTCKPT_KIT_PROBE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    got = run_ranks(_where_am_i, 2, start_method=start_method)
    assert [g["rank"] for g in got] == ["0", "1"]
    for g in got:
        assert g["env"] == "set after the server started" and g["cwd"] == str(tmp_path) and g["path"] == str(tmp_path), g
