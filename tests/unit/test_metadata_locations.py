"""The stored locations of a decoded format-2.x or 3.x document: a read-only mapping built from columns."""

import json
import os
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import distckpt
from distckpt.errors import CorruptCheckpointError
from distckpt.format.codec import parse_metadata
from distckpt.format.locations import ChunkLocations, check_no_overlap
from distckpt.format.records import FileInfo, FileStorageData, StorageInfo
from distckpt.metadata import MetadataIndex
from tests.security.helpers import per_key_entries

GOLDEN_ROOT = os.path.join(os.path.dirname(__file__), "..", "golden")
GOLDEN = os.path.join(GOLDEN_ROOT, "v2.0")


def _expected_items(body: dict) -> dict:
    """MetadataIndex -> StorageInfo as the document lists them, decoded by hand."""
    files = body["storage_data"]["$files"]["files"]
    out = {}
    for fqn, entry in per_key_entries(body)["state_dict_metadata"].items():
        if entry["type"] == "bytes":
            f, begin, length, crc = entry["at"]
            out[MetadataIndex(fqn)] = StorageInfo(files[f][0], begin, length, crc)
            continue
        width = torch.empty(0, dtype=getattr(torch, entry["properties"][0])).element_size()
        for offsets, sizes, f, begin, crc in entry["chunks"]:
            out[MetadataIndex(fqn, offsets)] = StorageInfo(files[f][0], begin, width * int(torch.Size(sizes).numel()), crc)
    return out


@pytest.mark.parametrize("version", ["v2.0", "v3.0"])
@pytest.mark.parametrize("name", ["plain", "sharded-2ranks"])
def test_decoded_locations_are_the_documents_locations(name, version):
    raw = open(os.path.join(GOLDEN_ROOT, version, name, "metadata.json"), "rb").read()
    md = parse_metadata(raw, "golden")
    items = md.storage_data.items
    assert isinstance(items, ChunkLocations)
    want = _expected_items(json.loads(raw))
    assert len(items) == len(want) and list(items) == list(want)  # document order
    assert dict(items.items()) == want and items == want and want == items
    for index, info in want.items():
        assert index in items and items[index] == info and items.get(index) == info
        # the lookup hint takes no part in finding a location
        assert items[MetadataIndex(index.fqn, index.offset, index=7)] == info
    tensor = next(ix for ix in want if ix.offset is not None)
    value = next((ix for ix in want if ix.offset is None), None)
    for missing in (MetadataIndex(tensor.fqn), MetadataIndex(tensor.fqn, [9999] * len(tensor.offset)), MetadataIndex("no such key", [0]),
                    *([MetadataIndex(value.fqn, [0])] if value else [])):
        assert missing not in items and items.get(missing) is None
        with pytest.raises(KeyError):
            items[missing]
    assert "no such key" not in items  # not even a MetadataIndex
    with pytest.raises(TypeError):
        items[tensor] = want[tensor]  # read-only
    again = pickle.loads(pickle.dumps(md.storage_data))
    assert isinstance(again, FileStorageData) and again == md.storage_data and again.items == want
    assert "ChunkLocations(" in repr(items)


def test_decoded_locations_serve_loads_and_verification(tmp_path):
    ck = str(tmp_path / "ck")
    sd = {"w": torch.arange(12.0).reshape(3, 4), "step": 3}
    distckpt.save(sd, checkpoint_id=ck)
    assert isinstance(distckpt.read_metadata(ck).storage_data.items, ChunkLocations)
    out = {"w": torch.zeros(3, 4), "step": 0}
    distckpt.load(out, checkpoint_id=ck)
    assert torch.equal(out["w"], sd["w"]) and out["step"] == 3
    assert distckpt.verify(ck).ok


_spans = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40), st.integers(0, 12)), min_size=0, max_size=12)


@settings(deadline=None)
@given(_spans, st.booleans())
def test_the_column_overlap_check_refuses_what_the_reference_refuses(spans, as_values):
    """Values and chunks, in files: the numpy check and the one over a dict agree, and name both keys."""
    files = {f"f{i}.safetensors": FileInfo(100, 0, 0) for i in range(3)}
    locations = ChunkLocations(list(files.items()))
    reference = {}
    for k, (f, begin, length) in enumerate(spans):
        fqn = f"k{k}"
        offsets = None if as_values else torch.Size([k])
        locations.add(fqn, offsets, f, begin, length, 0, "here")
        reference[MetadataIndex(fqn, offsets)] = StorageInfo(f"f{f}.safetensors", begin, length, 0)
    assert locations == reference

    def outcome(check):
        try:
            check()
        except CorruptCheckpointError as exc:
            return str(exc)
        return None

    got = outcome(lambda: locations.check_no_overlap("here"))
    want = outcome(lambda: check_no_overlap(reference, files, "here"))
    assert (got is None) == (want is None), (spans, got, want)
    if got is not None:
        # the pair reported overlaps: both names are keys whose spans meet in the named file
        named = [w.strip("'") for w in got.split() if w.startswith("'k")]
        (a, b), file = named, got.rsplit(" ", 1)[-1].strip("'")
        sa, sb = (reference[next(ix for ix in reference if ix.fqn == name)] for name in (a, b))
        first, second = sorted((sa, sb), key=lambda si: (si.offset, si.offset + si.length))
        assert sa.file == sb.file == file and second.offset < first.offset + first.length


def test_a_chunk_listed_twice_in_one_key_is_refused():
    raw = open(os.path.join(GOLDEN, "sharded-2ranks", "metadata.json"), "rb").read()
    body = json.loads(raw)
    entry = next(e for e in body["state_dict_metadata"].values() if e["type"] == "tensor" and len(e["chunks"]) > 1)
    entry["chunks"][1][0] = list(entry["chunks"][0][0])
    from tests.security.test_hostile import _doc

    with pytest.raises(CorruptCheckpointError, match="listed twice"):
        parse_metadata(_doc(body), "test")
    # a key is one entry of the document: its value, or its chunks back to back
    locations = ChunkLocations([("f.safetensors", FileInfo(100, 0, 0))])
    locations.add("v", None, 0, 0, 4, 0, "here")
    locations.add("t", torch.Size([0]), 0, 4, 4, 0, "here")
    for fqn, offsets in (("v", None), ("v", torch.Size([1])), ("t", None)):
        with pytest.raises(CorruptCheckpointError, match="listed twice"):
            locations.add(fqn, offsets, 0, 50, 4, 0, "here")
    locations.add("u", torch.Size([0]), 0, 8, 4, 0, "here")
    with pytest.raises(CorruptCheckpointError, match="listed twice"):
        locations.add("t", torch.Size([1]), 0, 12, 4, 0, "here")  # its chunks no longer end the columns


@st.composite
def _boxes(draw):
    """A few boxes inside a small tensor: often a true cover, sometimes with a gap, overlap or empty box."""
    ndim = draw(st.integers(1, 3))
    size = [draw(st.integers(1, 5)) for _ in range(ndim)]
    boxes = []
    for _ in range(draw(st.integers(2, 9))):
        off = [draw(st.integers(0, d - 1)) for d in size]
        ext = [draw(st.integers(0, d - o)) for o, d in zip(off, size)]
        boxes.append((off, ext))
    return size, boxes


@settings(deadline=None)
@given(_boxes())
def test_the_cover_check_of_few_chunks_agrees_with_counting_every_element(drawn):
    """check_cover compares a few chunks pairwise in Python, more on a grid in numpy: both must refuse
    exactly the boxes that do not cover every element once, and name a pair that really overlaps."""
    import itertools
    import math

    from distckpt.format.locations import check_cover
    from distckpt.metadata import ChunkStorageMetadata

    size, boxes = drawn
    chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(e)) for o, e in boxes]
    counts = {cell: 0 for cell in itertools.product(*[range(d) for d in size])}
    for o, e in boxes:
        for cell in itertools.product(*[range(a, a + n) for a, n in zip(o, e)]):
            counts[cell] += 1
    exact = all(n == 1 for n in counts.values())
    try:
        check_cover(chunks, torch.Size(size), "here")
        refused = None
    except CorruptCheckpointError as exc:
        refused = str(exc)
    assert (refused is None) == exact, (size, boxes, refused)
    if refused and "overlap" in refused:
        assert sum(math.prod(e) for _, e in boxes) == math.prod(size)
        named = [(o, e) for o, e in boxes if f"{o}+{e}" in refused]
        assert any(all(x < y + m and y < x + n for x, n, y, m in zip(o1, e1, o2, e2))
                   for (o1, e1), (o2, e2) in itertools.combinations(named, 2)) or len(named) == 1, refused
