"""Property tests of the pure chunk arithmetic: any save sharding reassembles into any load sharding."""

import itertools
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distckpt.planning.resharding import intersect, local_box, overlaps, shard_extent


@given(st.integers(0, 50), st.integers(1, 9))
def test_shard_extents_tile_the_dimension_like_torch_chunk(n, k):
    parts = [shard_extent(n, k, i) for i in range(k)]
    pos = 0
    for off, length in parts:
        assert length >= 0
        if length:
            assert off == pos
        pos += length
    assert pos == n
    # same sizes as torch.chunk (which drops trailing empty chunks)
    torch_sizes = [c.shape[0] for c in torch.arange(n).chunk(k)] if n else []
    assert [l for _, l in parts if l] == [s for s in torch_sizes if s]


@st.composite
def sharding(draw, ndim):
    mesh_ndim = draw(st.integers(1, 2))
    mesh = tuple(draw(st.integers(1, 4)) for _ in range(mesh_ndim))
    placements = []
    for _ in range(mesh_ndim):
        if ndim and draw(st.booleans()):
            placements.append(("shard", draw(st.integers(0, ndim - 1))))
        else:
            placements.append(("replicate",))
    return mesh, placements


def boxes(shape, mesh, placements):
    out = []
    for coord in itertools.product(*[range(m) for m in mesh]):
        out.append(local_box(shape, mesh, coord, placements))
    return out


@st.composite
def case(draw):
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.integers(0, 7)) for _ in range(ndim))
    return shape, draw(sharding(ndim)), draw(sharding(ndim))


@settings(max_examples=200, deadline=None)
@given(case())
def test_any_save_sharding_reassembles_into_any_load_sharding(c):
    shape, (smesh, splace), (lmesh, lplace) = c
    full = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
    saved_boxes = sorted(set(boxes(shape, smesh, splace)))
    saved_boxes = [b for b in saved_boxes if 0 not in b[1] or not shape]
    chunks = [full[tuple(slice(o, o + s) for o, s in zip(off, size))] for off, size in saved_boxes]
    # the saved chunks tile the tensor exactly once
    assert sum(math.prod(s) for _, s in saved_boxes) == math.prod(shape)
    for off, size in boxes(shape, lmesh, lplace):
        dest = torch.full(size, -1, dtype=torch.int64)
        for ov in overlaps(saved_boxes, off, size):
            src = chunks[ov.chunk_index]
            for d, (o, l) in enumerate(zip(ov.storage_offsets, ov.lengths)):
                src = src.narrow(d, o, l)
            dst = dest
            for d, (o, l) in enumerate(zip(ov.dest_offsets, ov.lengths)):
                dst = dst.narrow(d, o, l)
            dst.copy_(src)
        want = full[tuple(slice(o, o + s) for o, s in zip(off, size))]
        assert torch.equal(dest, want)


@given(st.lists(st.tuples(st.integers(0, 10), st.integers(0, 10)), min_size=1, max_size=3),
       st.lists(st.tuples(st.integers(0, 10), st.integers(0, 10)), min_size=1, max_size=3))
def test_intersect_is_symmetric_and_contained(a, b):
    n = min(len(a), len(b))
    a, b = a[:n], b[:n]
    ao, asz = [x for x, _ in a], [y for _, y in a]
    bo, bsz = [x for x, _ in b], [y for _, y in b]
    r1, r2 = intersect(ao, asz, bo, bsz), intersect(bo, bsz, ao, asz)
    assert r1 == r2
    if r1 is not None:
        for lo, l, o1, s1, o2, s2 in zip(*r1, ao, asz, bo, bsz):
            assert o1 <= lo and lo + l <= o1 + s1 and o2 <= lo and lo + l <= o2 + s2 and l > 0
