import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from distckpt import CheckpointError, RankLocal, UnsafeValueError
from distckpt.format.values import decode_value, encode_value
from distckpt.planning.flatten import flatten_state_dict, get_element, set_element


def test_flatten_nested_dicts_and_lists_with_tensors():
    t1, t2 = torch.zeros(1), torch.ones(2)
    sd = {"model": {"layer": {"w": t1}}, "opt": {"state": {0: {"m": t2}}, "groups": [{"lr": 0.1, "params": [0, 1]}]}, "seq": [t1, 3]}
    flat, mappings = flatten_state_dict(sd)
    assert flat["model.layer.w"] is t1
    assert flat["opt.state.0.m"] is t2
    assert flat["opt.groups"] == [{"lr": 0.1, "params": [0, 1]}]  # no tensor inside: one value
    assert flat["seq.0"] is t1 and flat["seq.1"] == 3
    assert mappings["opt.state.0.m"] == ("opt", "state", 0, "m")
    for key, path in mappings.items():
        assert get_element(sd, path) is flat[key]
    set_element(sd, mappings["seq.1"], 4)
    assert sd["seq"][1] == 4


def test_flatten_collision_is_an_error():
    with pytest.raises(CheckpointError, match="same key 'a.b'"):
        flatten_state_dict({"a.b": 1, "a": {"b": 2}})


def test_rank_local_keys_carry_the_rank():
    flat, mappings = flatten_state_dict({"rng": RankLocal(torch.zeros(2))}, rank=3)
    assert list(flat) == ["rng@rank3"]


values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text() | st.binary(),
    lambda children: st.lists(children) | st.tuples(children, children) | st.dictionaries(st.text() | st.integers(), children),
    max_leaves=20,
)


@given(values)
def test_values_round_trip_without_pickle(v):
    assert decode_value(encode_value(v)) == v


def test_non_finite_floats_round_trip():
    out = decode_value(encode_value([float("inf"), float("-inf"), float("nan")]))
    assert out[0] == math.inf and out[1] == -math.inf and math.isnan(out[2])


class Opaque:
    def __eq__(self, other):
        return isinstance(other, Opaque)


def test_unsafe_value_needs_opt_in_on_both_sides():
    with pytest.raises(UnsafeValueError, match="allow_pickle=True"):
        encode_value(Opaque(), where="key 'x'")
    raw = encode_value(Opaque(), allow_pickle=True)
    with pytest.raises(UnsafeValueError, match="allow_pickle=True"):
        decode_value(raw)
    assert decode_value(raw, allow_pickle=True) == Opaque()


@given(st.binary(max_size=200))
def test_decoding_garbage_gives_only_typed_errors(raw):
    try:
        decode_value(b"DCKV1\n" + raw)
    except CheckpointError:
        pass


def test_flattening_leaves_no_reference_cycle_holding_the_values():
    """Values are freed when the caller drops them, not at the next garbage collection (async_save's staging
    buffers are among them: release_buffers must be able to give their memory back at once)."""
    import gc
    import weakref

    class Box:
        pass

    box = Box()
    ref = weakref.ref(box)
    state = {"a": {"b": [torch.ones(1), box]}, "c": 1}
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        flat, mappings = flatten_state_dict(state)
        assert flat["a.b.1"] is box and mappings["a.b.1"] == ("a", "b", 1)
        del flat, mappings, state, box
        assert ref() is None
    finally:
        if was_enabled:
            gc.enable()


def test_map_leaves_walks_as_leaves_does_and_keeps_the_structure():
    from distckpt.planning.flatten import RankLocal, leaves, map_leaves

    t = torch.zeros(2)
    state = {"a": {"b": t, "c": [1, 2], "d": (t, 3)}, "e": RankLocal({"f": t}), "g": {}}
    seen = []
    out = map_leaves(state, lambda path, leaf: seen.append(path) or (leaf + 1 if isinstance(leaf, torch.Tensor) else leaf))
    assert seen == [p for p, _, _ in leaves(state)]
    assert out["a"]["c"] == [1, 2] and out["a"]["c"] is state["a"]["c"]  # a list without tensors is one leaf
    assert isinstance(out["a"]["d"], tuple) and out["a"]["d"][1] == 3 and torch.equal(out["a"]["d"][0], t + 1)
    assert isinstance(out["e"], RankLocal) and torch.equal(out["e"].value["f"], t + 1)
    assert out["g"] == {} and out["a"] is not state["a"] and torch.equal(state["a"]["b"], t)


def test_a_tier_view_s_fingerprint_follows_the_layout_not_the_cache():
    from distckpt.tiers.local_view import LocalView

    a = LocalView({"w": torch.zeros(4), "b": {"x": torch.zeros(2, dtype=torch.float16)}}, 0, 2)
    again = LocalView({"w": torch.ones(4), "b": {"x": torch.ones(2, dtype=torch.float16)}}, 0, 2)
    other_dtype = LocalView({"w": torch.zeros(4, dtype=torch.float64), "b": {"x": torch.zeros(2, dtype=torch.float16)}}, 0, 2)
    other_shape = LocalView({"w": torch.zeros(5), "b": {"x": torch.zeros(2, dtype=torch.float16)}}, 0, 2)
    other_rank = LocalView({"w": torch.zeros(4), "b": {"x": torch.zeros(2, dtype=torch.float16)}}, 1, 2)
    other_name = LocalView({"v": torch.zeros(4), "b": {"x": torch.zeros(2, dtype=torch.float16)}}, 0, 2)
    assert a.fingerprint == again.fingerprint
    assert len({a.fingerprint, other_dtype.fingerprint, other_shape.fingerprint, other_rank.fingerprint,
                other_name.fingerprint}) == 5
