"""The chunk-codec seam: the write and read engines store and load a chunk through a codec other than the
identity without any change to their loops, and the metadata records the codec (format 2.1)."""

import json

import pytest
import torch

from distckpt import CorruptCheckpointError, DefaultLoadPlanner, DefaultSavePlanner
from distckpt.backends.filesystem import FsStore
from distckpt.engine.check import check_stored
from distckpt.engine.read import read_items
from distckpt.engine.write import write_file
from distckpt.format.checksum import crc32c, format_crc
from distckpt.format.chunk_codec import IDENTITY, ChunkCodec, register_codec
from distckpt.format.codec import encode_metadata, parse_metadata
from distckpt.format.records import FileResult, FileStorageData
from distckpt.metadata import MetadataIndex, StorageMeta
from distckpt.testing.states import assert_same, seeded


class Reversed(ChunkCodec):
    """Stores a chunk's bytes back to front, with a marker byte: other bytes, another length."""

    name = "test-reversed"

    def encode(self, data):
        return b"R" + bytes(data)[::-1]

    def decode(self, stored, nbytes, where):
        if len(stored) != nbytes + 1 or stored[0] != ord("R"):
            raise CorruptCheckpointError(f"{where}: not a reversed chunk")
        return memoryview(bytes(stored[1:])[::-1])


register_codec(Reversed())


def _save(tmp_path, sd, encoded=("w", "b16")):
    store = FsStore(str(tmp_path / "ck"))
    store.prepare()
    planner = DefaultSavePlanner()
    planner.set_up_planner(sd, StorageMeta(), True)
    (plan,), md = planner.create_global_plan([planner.create_local_plan()])
    codec_of = lambda fqn: Reversed() if fqn in encoded else IDENTITY  # noqa: E731
    results = write_file(store, "data-00000.safetensors", "s" * 32, 0, plan, planner, threads=2, sync=False,
                         codec_of=codec_of)
    fsd = FileStorageData("s" * 32)
    for r in results:
        if isinstance(r, FileResult):
            fsd.files[r.file] = r.storage_data
        else:
            fsd.items[r.index] = r.storage_data
    md.storage_data = fsd
    return store, md


def _load(store, md, dest, verify=True):
    planner = DefaultLoadPlanner()
    planner.set_up_planner(dest, md, True)
    read_items(store, md, planner.create_local_plan(), planner, "test", verify=verify, threads=2)


def test_chunks_stored_through_a_codec_load_and_verify(tmp_path):
    sd = seeded({"w": (64, 8), "plain": (100,)}, values={"step": 3})
    sd["b16"] = torch.randn(5, 3).to(torch.bfloat16)
    store, md = _save(tmp_path, sd)
    info = md.storage_data.items[MetadataIndex("w", [0, 0])]
    assert info.codec == "test-reversed" and info.length == 64 * 8 * 4 + 1
    raw = store.open("data-00000.safetensors").pread(info.length, info.offset)
    assert raw[0:1] == b"R" and raw[1:] == sd["w"].numpy().tobytes()[::-1]
    out = {"w": torch.zeros(64, 8), "plain": torch.zeros(100), "b16": torch.zeros(5, 3, dtype=torch.bfloat16), "step": None}
    _load(store, md, out)
    assert_same(out, sd)
    cols = {"w": torch.zeros(8, 64).t()}  # not contiguous: copied out of the decoded chunk
    _load(store, md, cols)
    assert torch.equal(cols["w"], sd["w"])
    assert check_stored(store, md, "test", threads=2).problems == []


def test_damaged_stored_bytes_are_caught_and_leave_the_destination_zeroed(tmp_path):
    sd = seeded({"w": (64, 8)})
    store, md = _save(tmp_path, sd)
    info = md.storage_data.items[MetadataIndex("w", [0, 0])]
    path = tmp_path / "ck" / "data-00000.safetensors"
    data = bytearray(path.read_bytes())
    data[info.offset + 40] ^= 0xFF
    path.write_bytes(bytes(data))
    out = {"w": torch.ones(64, 8)}
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        _load(store, md, out)
    assert not out["w"].any()
    problems = check_stored(store, md, "test", threads=1).problems
    assert len(problems) == 1 and "checksum mismatch" in problems[0]


def test_the_document_records_a_codec_as_format_2_1_and_reads_it_back(tmp_path):
    sd = seeded({"w": (4, 4), "plain": (3,)})
    store, md = _save(tmp_path, sd, encoded=("w",))
    doc = encode_metadata(md)
    body = json.loads(doc)
    assert body["format_version"] == "3.0"  # a table of whole tensors: "plain"; a codec record is part of 3.0 too
    assert body["state_dict_metadata"]["w"]["chunks"][0][5] == {"codec": ["test-reversed"], "length": 4 * 4 * 4 + 1}
    assert body["tensors"]["keys"] == ["plain"] and list(body["state_dict_metadata"]) == ["w"]  # stored as it is: no record
    only_coded = encode_metadata(_save(tmp_path / "c", {"w": sd["w"]}, encoded=("w",))[1])
    assert json.loads(only_coded)["format_version"] == "2.1" and "tensors" not in json.loads(only_coded)
    back = parse_metadata(doc, "test")
    assert back.storage_data.items[MetadataIndex("w", [0, 0])].codec == "test-reversed"
    out = {"w": torch.zeros(4, 4), "plain": torch.zeros(3)}
    _load(store, back, out)
    assert_same(out, sd)
    without = encode_metadata(_save(tmp_path / "b", sd, encoded=())[1])
    assert json.loads(without)["format_version"] == "3.0" and json.loads(without)["state_dict_metadata"] == {}


@pytest.mark.parametrize("record", [{"codec": []}, {"codec": ["a|b"], "length": 1}, {"codec": ["x"]}, {"codec": ["x"], "length": -1},
                                    {"codec": "x", "length": 1}, {"codec": ["x"], "length": 1, "more": 1}])
def test_malformed_codec_records_are_refused_by_key(tmp_path, record):
    store, md = _save(tmp_path, seeded({"w": (4, 4)}), encoded=("w",))
    body = json.loads(encode_metadata(md))
    del body["crc32c"]
    body["state_dict_metadata"]["w"]["chunks"][0][5] = record
    with pytest.raises(CorruptCheckpointError, match="key 'w'"):
        parse_metadata(_document(body), "test")


def _document(body: dict) -> bytes:
    prefix = json.dumps(body, separators=(",", ":"))[:-1].encode()
    return prefix + b',"crc32c":"' + format_crc(crc32c(prefix)).encode() + b'"}\n'
