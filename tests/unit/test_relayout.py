"""Re-layout between a checkpoint's keys and shapes and a model's (planning/relayout.py), in one process, through
distckpt.save / distckpt.load with the relayout planners: every rule both ways, bit for bit, its errors, and each
stored byte read once."""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import distckpt
from distckpt.planning.relayout import Drop, Fuse, Relayout, RelayoutError, Rename, Split, Stack, Unstack, frames
from distckpt.planning.relayout_planners import RelayoutLoadPlanner, RelayoutSavePlanner
from distckpt.testing.read_counts import FileReads


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def zeros_like(state):
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()}


def same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def save(state, path, planner=None):
    distckpt.save(state, checkpoint_id=str(path), no_dist=True, planner=planner)


def load(state, path, planner=None):
    distckpt.load(state, checkpoint_id=str(path), no_dist=True, planner=planner)
    return state


def per_layer(n, shape, seed, name="layers.{}.w"):
    return {name.format(i): rand(*shape, seed=seed + i) for i in range(n)}


def _cases():
    """(id, checkpoint state, the model state it is, rules)."""
    q, k, v = rand(5, 3, seed=1), rand(4, 3, seed=2), rand(3, 3, seed=3)
    a1, b1 = rand(4, 3, seed=4), rand(4, 5, seed=5)
    w0, w1 = rand(7, 3, seed=6), rand(3, 7, seed=7)
    layers = per_layer(3, (2, 3), 10)
    stacked = [layers[f"layers.{i}.w"] for i in range(3)]
    big = rand(3, 2, 3, seed=20)
    attn = ["model.layers.{n}.attn.q.weight", "model.layers.{n}.attn.k.weight", "model.layers.{n}.attn.v.weight"]
    return [
        ("rename", {"model.a.w": w0, "model.b": rand(2, seed=8), "model.step": 7},
         {"a.w": w0, "b": rand(2, seed=8), "step": 7}, [Rename("model.{*rest}", "{*rest}")]),
        ("fuse-dim0", {"model.layers.0.attn.q.weight": q, "model.layers.0.attn.k.weight": k, "model.layers.0.attn.v.weight": v},
         {"model.layers.0.attn.qkv.weight": torch.cat([q, k, v])}, [Fuse(attn, "model.layers.{n}.attn.qkv.weight", sizes=[5, 4, 3])]),
        ("fuse-dim1", {"a": a1, "b": b1}, {"ab": torch.cat([a1, b1], 1)}, [Fuse(["a", "b"], "ab", dim=1, sizes=[3, 5])]),
        ("fuse-equal", {"a": q[:4], "b": k}, {"ab": torch.cat([q[:4], k])}, [Fuse(["a", "b"], "ab")]),
        ("split-dim0", {"w": w0}, {"x": w0[:4], "y": w0[4:]}, [Split("w", ["x", "y"])]),
        ("split-dim1", {"w": w1}, {"x": w1[:, :4], "y": w1[:, 4:]}, [Split("w", ["x", "y"], dim=1)]),
        ("stack-dim0", layers, {"w": torch.stack(stacked)}, [Stack("layers.{i}.w", "w")]),
        ("stack-dim1", layers, {"w": torch.stack(stacked, 1)}, [Stack("layers.{i}.w", "w", dim=1)]),
        ("stack-dim-last", layers, {"w": torch.stack(stacked, 2)}, [Stack("layers.{i}.w", "w", dim=-1)]),
        ("unstack-dim0", {"w": big}, {f"layers.{i}.w": big[i] for i in range(3)}, [Unstack("w", "layers.{i}.w")]),
        ("unstack-dim1", {"w": big}, {f"layers.{i}.w": big[:, i] for i in range(2)}, [Unstack("w", "layers.{i}.w", dim=1)]),
        ("several", {**layers, "h.x.a": a1, "h.x.b": b1, "n": 3},
         {"p.w": torch.stack(stacked), "p.x.ab": torch.cat([a1, b1], 1), "p.n": 3},
         [Stack("layers.{i}.w", "p.w"), Fuse(["h.{s}.a", "h.{s}.b"], "p.{s}.ab", dim=1, sizes=[3, 5]), Rename("{x}", "p.{x}")]),
    ]


CASES = _cases()


@pytest.mark.parametrize("name,ckpt,model,rules", CASES, ids=[c[0] for c in CASES])
def test_each_rule_loads_and_saves_bit_for_bit(tmp_path, name, ckpt, model, rules):
    save(ckpt, tmp_path / "ckpt")
    got = load(zeros_like(model), tmp_path / "ckpt", RelayoutLoadPlanner(Relayout(rules)))
    same(got, model)
    # saving from the model publishes the checkpoint's layout: the default planner sees the checkpoint's keys
    save(model, tmp_path / "back", RelayoutSavePlanner(rules))
    assert distckpt.read_metadata(str(tmp_path / "back")).state_dict_metadata.keys() == ckpt.keys()
    same(load(zeros_like(ckpt), tmp_path / "back"), ckpt)
    # model -> checkpoint -> model
    same(load(zeros_like(model), tmp_path / "back", RelayoutLoadPlanner(rules)), model)


def test_views_along_dim_1_are_not_contiguous_and_are_filled_through_the_read_engine(tmp_path):
    a, b = rand(64, 48, seed=1), rand(64, 80, seed=2)
    save({"a": a, "b": b}, tmp_path)
    planner = RelayoutLoadPlanner([Fuse(["a", "b"], "ab", dim=1)])
    model = {"ab": torch.full((64, 128), float("nan"))}
    load(model, tmp_path, planner)
    assert not any(view.is_contiguous() for frame in planner._frames.values() for view, _, _ in frame.pieces)
    assert torch.equal(model["ab"], torch.cat([a, b], 1))


def test_drop_both_ways(tmp_path):
    a, freq = rand(3, 2, seed=1), rand(4, seed=2)
    save({"a": a, "rotary.inv_freq": freq, "other.inv_freq": freq}, tmp_path / "ckpt")
    rules = [Drop("{*x}.inv_freq")]
    model = {"a": torch.zeros(3, 2), "rotary.inv_freq": torch.zeros(4)}
    # a dropped checkpoint key is not unexpected, and a model key that maps to a dropped name is not loaded
    load(model, tmp_path / "ckpt", RelayoutLoadPlanner(rules, allow_unexpected_keys=False))
    assert torch.equal(model["a"], a) and not model["rotary.inv_freq"].any()
    with pytest.raises(distckpt.UnexpectedKeyError, match="other.inv_freq"):
        load(model, tmp_path / "ckpt", RelayoutLoadPlanner([], allow_unexpected_keys=False))
    save(model, tmp_path / "back", RelayoutSavePlanner(rules))
    assert list(distckpt.read_metadata(str(tmp_path / "back")).state_dict_metadata) == ["a"]
    # a Fuse part that is dropped is neither read nor written
    q, k = rand(2, 3, seed=3), rand(2, 3, seed=4)
    save({"q": q, "k": k}, tmp_path / "qk")
    fused = {"qk": torch.zeros(4, 3)}
    load(fused, tmp_path / "qk", RelayoutLoadPlanner([Fuse(["q", "k"], "qk"), Drop("k")]))
    assert torch.equal(fused["qk"], torch.cat([q, torch.zeros(2, 3)]))
    save(fused, tmp_path / "q", RelayoutSavePlanner([Fuse(["q", "k"], "qk"), Drop("k")]))
    assert list(distckpt.read_metadata(str(tmp_path / "q")).state_dict_metadata) == ["q"]


def test_tied_weights_load_once_and_are_not_missing(tmp_path):
    emb = rand(6, 4, seed=1)
    save({"model.emb": emb}, tmp_path)
    shared = torch.zeros(6, 4)
    model = {"emb": shared, "head": shared}
    load(model, tmp_path, RelayoutLoadPlanner([Rename("model.{*r}", "{*r}")], allow_unexpected_keys=False))
    assert torch.equal(shared, emb)
    with pytest.raises(distckpt.MissingKeyError, match="'head'"):
        load({"emb": torch.zeros(6, 4), "head": torch.zeros(6, 4)}, tmp_path, RelayoutLoadPlanner([Rename("model.{*r}", "{*r}")]))
    # two tied keys that the rules send to the same checkpoint key fill it once, both ways
    rules = [Rename("model.emb", "head"), Rename("model.{*r}", "{*r}")]
    load(model, tmp_path, RelayoutLoadPlanner(rules))
    save(model, tmp_path / "back", RelayoutSavePlanner(rules))
    same(load({"model.emb": torch.zeros(6, 4)}, tmp_path / "back"), {"model.emb": emb})


# ---------------------------------------------------------------- errors, each naming the key


def test_a_mapping_that_uses_a_region_twice_is_refused(tmp_path):
    save({"a": rand(2, seed=1)}, tmp_path)
    model = {"x": torch.zeros(2), "a": torch.zeros(2)}
    with pytest.raises(RelayoutError, match=r"'a'.*'x'|'x'.*'a'"):
        load(model, tmp_path, RelayoutLoadPlanner([Rename("a", "x")]))
    with pytest.raises(RelayoutError, match="checkpoint key 'a'"):
        save(model, tmp_path / "back", RelayoutSavePlanner([Rename("a", "x")]))
    with pytest.raises(RelayoutError, match="overlapping regions of checkpoint key 'w'"):
        save({"x": torch.zeros(2, 3), "y": torch.zeros(2, 3)}, tmp_path / "w", RelayoutSavePlanner([Rename("w", "x"), Rename("w", "y")]))


def test_missing_fuse_part_names_the_model_and_the_checkpoint_key(tmp_path):
    q, v = rand(2, 3, seed=1), rand(2, 3, seed=2)
    save({"q": q, "v": v}, tmp_path)
    rules = [Fuse(["q", "k", "v"], "qkv")]
    with pytest.raises(distckpt.MissingKeyError, match=r"'k' \(for model key 'qkv'\)"):
        load({"qkv": torch.zeros(6, 3)}, tmp_path, RelayoutLoadPlanner(rules))
    model = {"qkv": torch.zeros(6, 3), "other": torch.ones(1)}
    save({"q": q, "v": v, "other": torch.full((1,), 5.0)}, tmp_path / "b")
    load(model, tmp_path / "b", RelayoutLoadPlanner(rules, allow_partial_load=True))
    assert not model["qkv"].any() and model["other"].item() == 5.0  # skipped whole, the rest loaded


def test_split_needs_every_part_in_the_state_dict(tmp_path):
    save({"w": rand(5, 3, seed=1)}, tmp_path)
    with pytest.raises(RelayoutError, match=r"lacks \['y'\]"):
        load({"x": torch.zeros(2, 3)}, tmp_path, RelayoutLoadPlanner([Split("w", ["x", "y"])]))
    with pytest.raises(RelayoutError, match=r"lacks \['y'\]"):
        save({"x": torch.zeros(2, 3)}, tmp_path / "b", RelayoutSavePlanner([Split("w", ["x", "y"])]))


def test_sizes_that_do_not_sum_are_refused(tmp_path):
    save({"q": rand(5, 3, seed=1), "k": rand(4, 3, seed=2)}, tmp_path)
    with pytest.raises(distckpt.ShapeMismatchError, match=r"model key 'qk'.*sum to 9.*has 10"):
        load({"qk": torch.zeros(10, 3)}, tmp_path, RelayoutLoadPlanner([Fuse(["q", "k"], "qk")]))
    with pytest.raises(distckpt.ShapeMismatchError, match=r"sizes \[5, 4\].*says \[4, 5\]"):
        load({"qk": torch.zeros(9, 3)}, tmp_path, RelayoutLoadPlanner([Fuse(["q", "k"], "qk", sizes=[4, 5])]))
    # the other dimensions are the default checks, naming the checkpoint key and the model key
    with pytest.raises(distckpt.ShapeMismatchError, match=r"key 'q'.*model key\(s\) qk"):
        load({"qk": torch.zeros(9, 4)}, tmp_path, RelayoutLoadPlanner([Fuse(["q", "k"], "qk")]))
    with pytest.raises(distckpt.DTypeMismatchError, match=r"model key\(s\) qk"):
        load({"qk": torch.zeros(9, 3, dtype=torch.bfloat16)}, tmp_path, RelayoutLoadPlanner([Fuse(["q", "k"], "qk")]))
    with pytest.raises(RelayoutError, match=r"sizes=\[\.\.\.\]"):
        save({"qk": torch.zeros(9, 3)}, tmp_path / "b", RelayoutSavePlanner([Fuse(["q", "k"], "qk")]))
    with pytest.raises(RelayoutError, match=r"sum to 10.*'qk' has 9"):
        save({"qk": torch.zeros(9, 3)}, tmp_path / "b", RelayoutSavePlanner([Fuse(["q", "k"], "qk", sizes=[5, 5])]))


def test_unexpected_keys_use_the_translated_names(tmp_path):
    save({"q": rand(2, 3, seed=1), "k": rand(2, 3, seed=2), "z": rand(1, seed=3)}, tmp_path)
    rules = [Fuse(["q", "k"], "qk")]
    with pytest.raises(distckpt.UnexpectedKeyError, match=r"'z'") as err:
        load({"qk": torch.zeros(4, 3)}, tmp_path, RelayoutLoadPlanner(rules, allow_unexpected_keys=False))
    assert "'q'" not in str(err.value)
    load({"qk": torch.zeros(4, 3)}, tmp_path, RelayoutLoadPlanner(rules + [Drop("z")], allow_unexpected_keys=False))


def test_templates_must_use_the_same_placeholders():
    with pytest.raises(RelayoutError, match=r"'model.\{\*rest\}' and '\{rest\}'"):
        Rename("model.{*rest}", "{rest}")
    with pytest.raises(RelayoutError, match=r"'b.\{y\}'"):
        Fuse(["a.{x}", "b.{y}"], "c.{x}")
    with pytest.raises(RelayoutError, match=r"needs the layer placeholder"):
        Stack("layers.{n}.w", "w")
    with pytest.raises(RelayoutError, match=r"may not use the layer placeholder"):
        Unstack("w.{i}", "layers.{i}.w")
    with pytest.raises(RelayoutError, match=r"twice"):
        Rename("{a}.{a}", "{a}.{a}")
    with pytest.raises(RelayoutError, match=r"brace"):
        Rename("{a-b}", "x")
    with pytest.raises(RelayoutError, match=r"Drop"):
        Relayout(["not a rule"])


def test_unstack_needs_every_layer(tmp_path):
    save({"w": rand(3, 2, seed=1)}, tmp_path)
    model = {"layers.0.w": torch.zeros(2), "layers.2.w": torch.zeros(2)}
    with pytest.raises(distckpt.ShapeMismatchError, match=r"lacks \['layers.1.w'\]"):
        load(model, tmp_path, RelayoutLoadPlanner([Unstack("w", "layers.{i}.w")]))
    with pytest.raises(RelayoutError, match=r"lacks \['layers.1.w'\]"):
        save(model, tmp_path / "b", RelayoutSavePlanner([Unstack("w", "layers.{i}.w")]))
    model["layers.1.w"], model["layers.3.w"] = torch.zeros(2), torch.zeros(2)
    with pytest.raises(distckpt.ShapeMismatchError, match=r"has \['layers.3.w'\] beyond"):
        load(model, tmp_path, RelayoutLoadPlanner([Unstack("w", "layers.{i}.w")]))


def test_rules_apply_in_order_and_only_rename_applies_to_values(tmp_path):
    save({"a.x": rand(2, seed=1), "b.x": rand(2, seed=2), "b.n": 4}, tmp_path)
    model = {"x": torch.zeros(2), "y.x": torch.zeros(2), "y.n": 0}
    load(model, tmp_path, RelayoutLoadPlanner([Rename("a.x", "x"), Rename("b.{*r}", "y.{*r}"), Rename("c.{*r}", "{*r}")]))
    assert torch.equal(model["x"], rand(2, seed=1)) and torch.equal(model["y.x"], rand(2, seed=2)) and model["y.n"] == 4
    with pytest.raises(RelayoutError, match=r"'y.n'.*non-tensor"):
        load({"y.n": 0}, tmp_path, RelayoutLoadPlanner([Fuse(["b.{s}"], "y.{s}")]))


# ---------------------------------------------------------------- each stored byte read once


def test_a_relayout_load_reads_the_stored_bytes_once(tmp_path):
    n = 64
    ckpt = {f"layers.{i}.{p}": rand(n, n, seed=10 * i + j) for i in range(3) for j, p in enumerate("qkv")}
    ckpt.update({f"layers.{i}.mlp": rand(n, 3 * n, seed=100 + i) for i in range(3)})
    save(ckpt, tmp_path)
    stored = sum(t.nbytes for t in ckpt.values())
    files = sum(e.stat().st_size for e in os.scandir(tmp_path))
    rules = [Fuse(["layers.{n}.q", "layers.{n}.k", "layers.{n}.v"], "layers.{n}.qkv", dim=1), Stack("layers.{i}.mlp", "mlp")]
    model = {f"layers.{i}.qkv": torch.zeros(n, 3 * n) for i in range(3)}
    model["mlp"] = torch.zeros(3, n, 3 * n)
    counter = FileReads()
    load(model, tmp_path, RelayoutLoadPlanner(rules))
    assert stored <= counter.total <= files, (counter.total, stored, files)
    assert torch.equal(model["mlp"][1], ckpt["layers.1.mlp"])
    assert torch.equal(model["layers.2.qkv"], torch.cat([ckpt["layers.2.q"], ckpt["layers.2.k"], ckpt["layers.2.v"]], 1))


# ---------------------------------------------------------------- the piece math, with blocks as DTensor shards make them


def _blocks(shape, dim, parts):
    """The blocks of a tensor of ``shape`` cut in ``parts`` along ``dim`` (as ranks' Shard(dim) would hold them)."""
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
    out, at = [], 0
    for n in parts:
        offsets = tuple(at if d == dim else 0 for d in range(len(shape)))
        sizes = tuple(n if d == dim else s for d, s in enumerate(shape))
        out.append((full.narrow(dim, at, n), offsets, sizes))
        at += n
    return full, out


def _assemble(frame_map):
    out = {}
    for key, frame in frame_map.items():
        t = torch.full(frame.size, float("nan"), dtype=torch.float64)
        for view, offsets, sizes in frame.pieces:
            region = t
            for d, (o, s) in enumerate(zip(offsets, sizes)):
                region = region.narrow(d, o, s)
            assert torch.isnan(region).all(), key  # each region filled once
            region.copy_(view)
        out[key] = t
    return out


def _cuts(total, draw):
    cuts = sorted(draw(st.lists(st.integers(0, total), max_size=3)))
    bounds = [0] + cuts + [total]
    return [b - a for a, b in zip(bounds, bounds[1:])]


@settings(deadline=None)
@given(st.data())
def test_blocks_of_any_sharding_cover_each_checkpoint_key_exactly(data):
    draw = data.draw
    kind = draw(st.sampled_from(["fuse", "stack", "unstack", "split"]))
    rank = draw(st.integers(1, 3))
    dim = draw(st.integers(0, rank - 1))
    shard_dim = draw(st.integers(0, rank - 1))
    if kind == "fuse":
        sizes = draw(st.lists(st.integers(0, 4), min_size=1, max_size=3))
        shape = tuple(sum(sizes) if d == dim else draw(st.integers(1, 3)) for d in range(rank))
        rule = Fuse([f"p{j}" for j in range(len(sizes))], "m", dim=dim, sizes=sizes)
        full, blocks = _blocks(shape, shard_dim, _cuts(shape[shard_dim], draw))
        expected, at = {}, 0
        for j, n in enumerate(sizes):
            expected[f"p{j}"] = full.narrow(dim, at, n)
            at += n
        model = {"m": (shape, blocks)}
    elif kind == "stack":
        shape = tuple(draw(st.integers(1, 3)) for _ in range(rank))
        rule = Stack("l.{i}", "m", dim=dim)
        full, blocks = _blocks(shape, shard_dim, _cuts(shape[shard_dim], draw))
        expected = {f"l.{i}": full.select(dim, i) for i in range(shape[dim])}
        model = {"m": (shape, blocks)}
    elif kind == "unstack":
        layers = draw(st.integers(1, 3))
        shape = tuple(draw(st.integers(1, 3)) for _ in range(rank))
        rule = Unstack("s", "l.{i}", dim=dim)
        model, parts = {}, []
        for i in range(layers):
            full, blocks = _blocks(shape, shard_dim, _cuts(shape[shard_dim], draw))
            model[f"l.{i}"] = (shape, blocks)
            parts.append(full)
        expected = {"s": torch.stack(parts, dim)}
    else:
        sizes = draw(st.lists(st.integers(0, 4), min_size=1, max_size=3))
        other = [draw(st.integers(1, 3)) for _ in range(rank)]
        rule = Split("w", [f"m{j}" for j in range(len(sizes))], dim=dim)
        model, parts = {}, []
        for j, n in enumerate(sizes):
            shape = tuple(n if d == dim else other[d] for d in range(rank))
            full, blocks = _blocks(shape, shard_dim, _cuts(shape[shard_dim], draw))
            model[f"m{j}"] = (shape, blocks)
            parts.append(full)
        expected = {"w": torch.cat(parts, dim)}
    tr = Relayout([rule]).translate({k: shape for k, (shape, _) in model.items()})
    got = _assemble(frames(tr, {k: b for k, (_, b) in model.items()}, {k: (torch.float64, False) for k in model}))
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


def test_a_nested_state_dict_records_the_checkpoint_keys_paths(tmp_path):
    q, k = rand(2, 3, seed=1), rand(2, 3, seed=2)
    state = {"model": {"qk": torch.cat([q, k]), "emb": rand(4, seed=3)}, "opt": {"lr": 0.5}}
    save(state, tmp_path, RelayoutSavePlanner([Fuse(["model.q", "model.k"], "model.qk"), Rename("model.{x}", "model.{x}")]))
    md = distckpt.read_metadata(str(tmp_path))
    assert {k: tuple(v) for k, v in md.planner_data.items()} == {
        "model.q": ("model", "q"), "model.k": ("model", "k"), "model.emb": ("model", "emb"), "opt.lr": ("opt", "lr")}
    back = {"model": {"q": torch.zeros(2, 3), "k": torch.zeros(2, 3), "emb": torch.zeros(4)}, "opt": {"lr": 0.0}}
    load(back, tmp_path)
    assert torch.equal(back["model"]["k"], k) and back["opt"]["lr"] == 0.5


def test_frames_refuse_two_blocks_of_one_region_in_different_memory():
    from distckpt.planning.relayout import Piece, Translation

    box = ((0,), (2,))
    tr = Translation(pieces={name: [Piece(name, *box, "w", *box, (2,))] for name in ("a", "b")})
    blocks = {name: [(torch.zeros(2), (0,), (2,))] for name in ("a", "b")}
    with pytest.raises(RelayoutError, match="'a' and 'b'.*checkpoint key 'w'"):
        frames(tr, blocks, {"a": (torch.float32, False), "b": (torch.float32, False)})
    shared = torch.zeros(2)  # tied: one block
    got = frames(tr, {name: [(shared, (0,), (2,))] for name in ("a", "b")}, {"a": (torch.float32, False), "b": (torch.float32, False)})
    assert len(got["w"].pieces) == 1


def test_a_value_and_a_tensor_on_one_checkpoint_key_are_refused(tmp_path):
    save({"x": rand(2, seed=1)}, tmp_path)
    model = {"x": torch.zeros(2), "y": 3}
    with pytest.raises(RelayoutError, match="both map to checkpoint key 'x'"):
        load(model, tmp_path, RelayoutLoadPlanner([Rename("x", "y")]))
    with pytest.raises(RelayoutError, match="both map to checkpoint key 'x'"):
        save(model, tmp_path / "b", RelayoutSavePlanner([Rename("x", "y")]))
