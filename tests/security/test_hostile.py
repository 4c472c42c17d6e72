"""Hostile input: only typed errors, no unpickling, no escaping the checkpoint, bounded allocation."""

import json
import os
import pickle
import struct
import tracemalloc

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import distckpt
from distckpt import CheckpointError, CorruptCheckpointError, FormatVersionError, UnsafeValueError
from distckpt.format.codec import parse_metadata
from distckpt.format.datafile import read_header

from .helpers import blank_like, copy, make_checkpoint, read_body, write_body


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("good") / "ck")
    return path, make_checkpoint(path)


def _doc(body):
    from distckpt.format.checksum import crc32c

    body = {k: v for k, v in body.items() if k != "crc32c"}  # a document parsed back still holds its old one
    prefix = json.dumps(body, separators=(",", ":")).encode()[:-1]
    return prefix + b',"crc32c":"' + f"{crc32c(prefix):08x}".encode() + b'"}\n'


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12,
)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _damage(root, targets, values, times, data):
    """Replace ``times`` members of ``root``, each at a path drawn from ``targets``, with a value drawn from ``values``."""
    for _ in range(times):
        target = data.draw(targets)
        node = root
        try:
            for p in target[:-1]:
                node = node[p]
            node[target[-1]] = data.draw(values)
        except (KeyError, IndexError, TypeError):
            continue


@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_metadata_parser_raises_only_typed_errors(good, data):
    path, _ = good
    body = read_body(path)
    paths = list(_paths(body))[1:]
    _damage(body, st.sampled_from(paths), json_values, data.draw(st.integers(1, 3)), data)
    raw = _doc(body)
    tracemalloc.start()
    try:
        parse_metadata(raw, "fuzz")
    except CheckpointError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 50 * len(raw) + (4 << 20)


def _outcome(raw):
    try:
        md = parse_metadata(raw, "fuzz")
    except CheckpointError as exc:
        return type(exc)
    return md.state_dict_metadata, dict(md.storage_data.items), md.planner_data


@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_whole_tensor_rows_decode_as_the_general_path_does(good, data, monkeypatch):
    """Entries of one whole chunk take a fused decoder; on any entry, damaged or not, it must agree with the
    general path: the same metadata, or the same typed error."""
    import distckpt.format.codec as codec

    path, _ = good
    body = read_body(path)
    values = st.one_of(json_values, st.integers(-2, 2), st.sampled_from([True, False, 2**63, 2**32, [0], [], [True]]))
    parse_metadata(_doc(body), "warm")  # property lists are known after one decode: the fused path takes them
    paths = list(_paths(body["state_dict_metadata"]))[1:]
    chunk_fields = [p for p in paths if "chunks" in p]  # most of what the fused path checks
    targets = st.sampled_from(chunk_fields) | st.sampled_from(paths)
    _damage(body["state_dict_metadata"], targets, values, data.draw(st.integers(0, 3)), data)
    raw = _doc(body)
    fused = _outcome(raw)
    with monkeypatch.context() as m:
        m.setattr(codec, "_whole_tensor", lambda *args: None)
        general = _outcome(raw)
    assert fused == general


def test_whole_tensor_rows_agree_on_every_field_at_its_bounds(good, monkeypatch):
    """The same agreement as above, for each field of each one-chunk entry set to each edge value in turn."""
    import copy as copying

    import distckpt.format.codec as codec

    path, _ = good
    body = read_body(path)
    parse_metadata(_doc(body), "warm")
    edges = [-1, 0, 1, 2**32 - 1, 2**32, 2**63 - 1, 2**63, True, 1.0, None, "0", [], [0], [-1], [True], [2**63]]
    for key, entry in body["state_dict_metadata"].items():
        if entry.get("type") != "tensor":
            continue
        for field in range(5):
            for value in edges:
                damaged = copying.deepcopy(body)
                damaged["state_dict_metadata"][key]["chunks"][0][field] = value
                raw = _doc(damaged)
                fused = _outcome(raw)
                with monkeypatch.context() as m:
                    m.setattr(codec, "_whole_tensor", lambda *args: None)
                    assert _outcome(raw) == fused, (key, field, value)


@settings(deadline=None)
@given(st.binary(max_size=600))
def test_metadata_parser_on_random_bytes(raw):
    with pytest.raises(CheckpointError):
        parse_metadata(raw, "fuzz")


@settings(deadline=None)
@given(st.binary(max_size=400), st.integers(0, 2**64 - 1), st.booleans())
def test_header_parser_raises_only_typed_errors(payload, declared, honest):
    n = len(payload) if honest else declared
    blob = struct.pack("<Q", n) + payload
    tracemalloc.start()
    try:
        read_header(lambda k, off: blob[off:off + k], len(blob), "fuzz")
    except CheckpointError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 50 * len(blob) + (1 << 20)


@settings(deadline=None)
@given(json_values, st.integers(0, 64))
def test_header_parser_on_structured_json(header, pad):
    text = json.dumps({"__metadata__": {"format": "distckpt", "save_id": "x"}, "t": header}).encode() + b" " * pad
    blob = struct.pack("<Q", len(text)) + text + bytes(64)
    try:
        read_header(lambda k, off: blob[off:off + k], len(blob), "fuzz")
    except CheckpointError:
        pass


def _header_outcome(blob):
    try:
        return read_header(lambda k, off: blob[off:off + k], len(blob), "fuzz")
    except CheckpointError as exc:
        return type(exc), str(exc)


@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_header_entries_decode_as_the_checks_one_by_one_do(data, monkeypatch):
    """Header entries that pass every check are taken in one fused test; on any entry, damaged or not, the
    header must decode as the checks one by one decode it."""
    import distckpt.format.datafile as datafile

    entry = {"dtype": "F32", "shape": [2, 3], "data_offsets": [8, 32]}
    for key in data.draw(st.lists(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]), max_size=2)):
        entry[key] = data.draw(st.one_of(json_values, st.sampled_from(
            ["BF16", "U8", "F64", [6], [], [0, 24], [8, 8], [True, 3], [-1, 3], [-2, -3], [8, 2**63], [2, 3.0]])))
    text = json.dumps({"__metadata__": {"format": "distckpt", "save_id": "x"}, "t": entry,
                       "u": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}}).encode()
    blob = struct.pack("<Q", len(text)) + text + bytes(64)
    fused = _header_outcome(blob)
    with monkeypatch.context() as m:
        m.setattr(datafile, "_fine_entry", lambda *args: None)
        assert _header_outcome(blob) == fused


def test_header_length_beyond_the_file_is_refused_before_allocation():
    blob = struct.pack("<Q", 2**62) + b"{}"
    with pytest.raises(CorruptCheckpointError, match="header length"):
        read_header(lambda k, off: blob[off:off + k], len(blob), "x")


@pytest.mark.parametrize("bad", ["../escape.safetensors", "/etc/passwd", "sub/dir.safetensors", "..", ".hidden", "a\\b"])
def test_path_traversal_names_are_rejected(good, tmp_path, bad):
    path, sd = good
    ck = copy(path, str(tmp_path / "ck"))
    body = read_body(ck)
    body["storage_data"]["$files"]["files"][0][0] = bad
    write_body(ck, body)
    with pytest.raises(CorruptCheckpointError, match="not a plain file name"):
        distckpt.load(blank_like(sd), checkpoint_id=ck)


def test_symlink_out_of_the_checkpoint_is_not_followed(good, tmp_path):
    path, sd = good
    ck = copy(path, str(tmp_path / "ck"))
    name = [f for f in os.listdir(ck) if f.endswith(".safetensors")][0]
    outside = tmp_path / "outside.bin"
    os.replace(os.path.join(ck, name), outside)
    os.symlink(outside, os.path.join(ck, name))
    with pytest.raises(CheckpointError, match="symbolic link"):
        distckpt.load(blank_like(sd), checkpoint_id=ck)


def test_unknown_major_version_is_rejected_with_supported_version(good, tmp_path):
    path, sd = good
    ck = copy(path, str(tmp_path / "ck"))
    body = read_body(ck)
    body["format_version"] = "5.0"
    write_body(ck, body)
    with pytest.raises(FormatVersionError, match=r"5\.0.*reads format versions 1\.x, 2\.x, 3\.x, 4\.x"):
        distckpt.read_metadata(ck)


class Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


@pytest.fixture
def no_unpickling(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("an unpickler was used on the default load path")

    class NoUnpickler:
        def __init__(self, *a, **k):
            fail()

    monkeypatch.setattr(pickle, "loads", fail)
    monkeypatch.setattr(pickle, "load", fail)
    monkeypatch.setattr(pickle, "Unpickler", NoUnpickler)
    monkeypatch.setattr(torch, "load", fail)
    import _pickle

    monkeypatch.setattr(_pickle, "loads", fail)
    monkeypatch.setattr(_pickle, "load", fail)


def test_pickled_value_is_never_unpickled_by_default(tmp_path, no_unpickling):
    ck = str(tmp_path / "ck")
    distckpt.save({"evil": Boom(), "w": torch.ones(2)}, checkpoint_id=ck, planner=distckpt.DefaultSavePlanner(allow_pickle=True))
    out = {"evil": None, "w": torch.zeros(2)}
    with pytest.raises(UnsafeValueError, match="'evil'.*allow_pickle=True"):
        distckpt.load(out, checkpoint_id=ck)
    assert out["evil"] is None
    distckpt.verify(ck)  # verifying never decodes values


def test_pickle_payload_in_metadata_is_never_unpickled(good, tmp_path, no_unpickling):
    import base64

    path, sd = good
    ck = copy(path, str(tmp_path / "ck"))
    body = read_body(ck)
    body["planner_data"] = {"$t": "pickle", "v": base64.b64encode(b"cos\nsystem\n(S'echo pwned'\ntR.").decode()}
    write_body(ck, body)
    with pytest.raises(UnsafeValueError):
        distckpt.load(blank_like(sd), checkpoint_id=ck)


def test_raw_pickle_in_a_value_slot_is_corrupt_not_executed(tmp_path, no_unpickling):
    ck = str(tmp_path / "ck")
    distckpt.save({"v": "hello"}, checkpoint_id=ck)
    md = distckpt.read_metadata(ck)
    si = md.storage_data.items[distckpt.metadata.MetadataIndex("v")]
    p = os.path.join(ck, si.file)
    data = bytearray(open(p, "rb").read())
    payload = b"\x80\x04cos\nsystem\n."[: si.length].ljust(si.length, b".")
    data[si.offset:si.offset + si.length] = payload
    open(p, "wb").write(bytes(data))
    out = {"v": None}
    with pytest.raises(CheckpointError):
        distckpt.load(out, storage_reader=distckpt.FileSystemReader(ck, verify_checksums=False))


def test_data_files_are_safetensors_files(tmp_path):
    from safetensors import safe_open

    ck = str(tmp_path / "ck")
    sd = make_checkpoint(ck)
    md = distckpt.read_metadata(ck)
    files = {si.file for si in md.storage_data.items.values()}
    for name in files:
        with safe_open(os.path.join(ck, name), framework="pt") as f:
            assert f.metadata()["format"] == "distckpt"
            for key in ("w", "b", "ids", "mask"):
                t = f.get_tensor(f"{key}@" + ",".join("0" * sd[key].dim()))
                assert t.dtype == sd[key].dtype and torch.equal(t, sd[key])
            assert bytes(f.get_tensor("step").tolist()).startswith(b"DCKV1\n")


def _first_chunk(body):
    for entry in body["state_dict_metadata"].values():
        if entry["type"] == "tensor" and entry["chunks"]:
            return entry["chunks"][0]
    raise AssertionError("no tensor chunk")


@pytest.mark.parametrize("damage,message", [
    (lambda b: _first_chunk(b).__setitem__(2, 99), "file table lacks"),
    (lambda b: _first_chunk(b).__setitem__(2, -1), "file table lacks"),
    (lambda b: _first_chunk(b).__setitem__(3, 1 << 40), "outside data file"),
    (lambda b: _first_chunk(b).__setitem__(4, 1 << 33), "malformed checksum"),
    (lambda b: _first_chunk(b).pop(), "malformed chunk"),
    (lambda b: b["storage_data"]["$files"]["files"].append(list(b["storage_data"]["$files"]["files"][0])), "listed twice"),
    (lambda b: b["storage_data"]["$files"]["files"][0].__setitem__(1, 10), "outside data file"),
    (lambda b: next(e for e in b["state_dict_metadata"].values() if e["type"] == "bytes").pop("at"), "no valid location"),
])
def test_hostile_locations_in_format_2_are_refused(good, damage, message):
    path, _ = good
    body = read_body(path)
    damage(body)
    with pytest.raises(CorruptCheckpointError, match=message):
        parse_metadata(_doc(body), "test")


def test_overlapping_locations_are_refused(good):
    path, _ = good
    body = read_body(path)
    chunks = [c for e in body["state_dict_metadata"].values() if e["type"] == "tensor" for c in e["chunks"] if c[1] and all(c[1])]
    a, b = chunks[0], chunks[1]
    b[2], b[3] = a[2], a[3]
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        parse_metadata(_doc(body), "test")


_field = st.sampled_from([-1, -3, True, None, 2**32, 2**63, "x", [1], [1, 2, 3], 1.5, 7, 65, 201])  # as _HOSTILE


@st.composite
def _chunk_rows(draw):
    """A plausible format-2.x chunk row, often with one field made hostile."""
    row = [[draw(st.integers(0, 10)), draw(st.integers(0, 6))], [draw(st.integers(0, 10)), draw(st.integers(0, 6))],
           draw(st.integers(0, 1)), draw(st.integers(0, 200)), draw(st.integers(0, 2**32 - 1))]
    if draw(st.booleans()):
        where = draw(st.sampled_from([(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1), (2,), (3,), (4,)]))
        node = row
        for i in where[:-1]:
            node = node[i]
        node[where[-1]] = draw(_field)
    if draw(st.integers(0, 9)) == 0:
        return draw(st.one_of(_field, st.just(row[:4]), st.just(row + [0])))
    return row


def _fast_and_reference_agree(chunks_raw) -> None:
    """The hot loop of metadata decoding accepts, builds and refuses exactly what the careful path does."""
    from distckpt.format.locations import ChunkLocations, check_cover, inline_chunk, inline_chunks
    from distckpt.format.records import FileInfo

    size = torch.Size([10, 6])
    files = {"a.safetensors": FileInfo(200, 0, 0), "b.safetensors": FileInfo(64, 1, 0)}

    def run(decode):
        locations = ChunkLocations(list(files.items()))
        try:
            return decode(locations), locations, None
        except CorruptCheckpointError as exc:
            return None, None, str(exc)

    fast = run(lambda locations: inline_chunks(chunks_raw, "w", size, 4, locations, "here"))
    def reference(locations):
        chunks = [inline_chunk(c, "w", size, 4, locations, "here") for c in chunks_raw]
        check_cover(chunks, size, "here")
        return chunks

    ref = run(reference)
    assert fast[2] == ref[2], chunks_raw
    if fast[2] is None:
        assert fast[0] == ref[0] and fast[1] == ref[1] and dict(fast[1].items()) == dict(ref[1].items())
        assert all(type(c.offsets) is torch.Size and type(c.sizes) is torch.Size for c in fast[0])
        assert [hash(k) for k in fast[1]] == [hash(k) for k in ref[1]]


_HOSTILE = [-1, -3, True, None, 2**32, 2**63, "x", [1], [1, 2, 3], 1.5, 7, 65, 201]


def test_fast_chunk_decoding_agrees_with_the_reference_on_every_single_hostile_field():
    _fast_and_reference_agree([[[2, 1], [3, 4], 0, 8, 5], [[5, 0], [5, 6], 1, 0, 7]])  # valid: both build
    for where in [(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1), (2,), (3,), (4,)]:
        for value in _HOSTILE:
            row = [[2, 1], [3, 4], 0, 8, 5]
            node = row
            for i in where[:-1]:
                node = node[i]
            node[where[-1]] = value
            _fast_and_reference_agree([[[0, 0], [1, 1], 1, 0, 0], row])
    for row in ([[2, 1], [3, 4], 0, 8], [[2, 1], [3, 4], 0, 8, 5, 0], "x", None, [[2, 1], [3, 4], 0, 190, 5]):
        _fast_and_reference_agree([row])
    _fast_and_reference_agree([[[2, 1], [3, 4], 0, 8, 5], [[2, 1], [1, 1], 1, 0, 0]])  # the same chunk twice


@settings(deadline=None)
@given(st.lists(_chunk_rows(), max_size=6))
def test_fast_chunk_decoding_agrees_with_the_field_by_field_reference(chunks_raw):
    _fast_and_reference_agree(chunks_raw)
