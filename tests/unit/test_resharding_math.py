"""Property tests of the pure chunk arithmetic: any save sharding reassembles into any load sharding."""

import itertools
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distckpt.metadata import ChunkStorageMetadata
from distckpt.planning.resharding import ChunkIndex, intersect, local_box, overlaps, shard_extent


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


@settings(deadline=None)
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


@st.composite
def chunks_and_box(draw):
    ndim = draw(st.integers(0, 3))
    extent = st.integers(0, 12)
    box = st.tuples(st.tuples(*[extent] * ndim), st.tuples(*[st.integers(0, 6)] * ndim))
    # a grid cut along one dimension (as saves make them), or boxes anywhere, in any order
    if ndim and draw(st.booleans()):
        d = draw(st.integers(0, ndim - 1))
        cuts = sorted(set(draw(st.lists(st.integers(0, 30), min_size=1, max_size=20))))
        saved = [(tuple(a if i == d else 0 for i in range(ndim)), tuple(b - a if i == d else 4 for i in range(ndim)))
                 for a, b in zip([0] + cuts, cuts)]
        if draw(st.booleans()):
            saved = draw(st.permutations(saved))
    else:
        saved = draw(st.lists(box, max_size=20))
    return saved, draw(box)


@settings(deadline=None)
@given(chunks_and_box())
def test_the_chunk_index_finds_exactly_what_a_scan_finds(c):
    saved, (off, size) = c
    chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in saved]
    assert ChunkIndex(chunks).overlaps(off, size) == overlaps(saved, off, size)


def test_the_chunk_index_bisects_row_shards_in_order_or_not():
    rows = [ChunkStorageMetadata(torch.Size([16 * r, 0]), torch.Size([16, 64])) for r in range(4096)]
    for chunks in (rows, rows[::-1]):
        index = ChunkIndex(chunks)
        assert index.dim == 0 and (index.order is None) == (chunks is rows)
        got = index.overlaps((100, 8), (20, 8))
        assert [ov.chunk_index for ov in got] == sorted(chunks.index(rows[r]) for r in (6, 7))
        assert got == overlaps([(c.offsets, c.sizes) for c in chunks], (100, 8), (20, 8))
    columns = [ChunkStorageMetadata(torch.Size([0, 8 * r]), torch.Size([4, 8])) for r in range(10)]
    assert ChunkIndex(columns).dim == 1
