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
