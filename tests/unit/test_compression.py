"""compression="zstd": byte-grouped zstd chunks through the public API, and every lie their stored bytes or records can tell."""

import json
import os
import struct
import tracemalloc

import pytest
import torch
from click.testing import CliRunner

import distckpt
from distckpt import CheckpointError, CorruptCheckpointError, FileSystemReader, FileSystemWriter
from distckpt.cli import main
from distckpt.format.bytegroup import HEADER, MAX_RATIO, ByteGroupZstd, encode_planes
from distckpt.format.checksum import crc32c

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16, torch.int32,
          torch.int64, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn]


def _state():
    g = torch.Generator().manual_seed(0)
    sd = {}
    for dt in DTYPES:
        name = str(dt).removeprefix("torch.")
        base = torch.randn(300, 70, generator=g) * 0.02
        sd[name] = base.to(dt) if not dt.is_complex else torch.complex(base, base.flip(0)).to(dt)
        sd[f"{name}_0d"] = torch.tensor(1.5).to(dt)
        sd[f"{name}_empty"] = torch.zeros(0, 7, dtype=dt)
    sd["bool"] = torch.rand(300, 70, generator=g) > 0.5
    sd["ids"] = torch.arange(5000, dtype=torch.int64)  # high bytes all zero: the planes shrink to nothing
    sd["big"] = (torch.randn(1 << 20, generator=g) * 0.02).to(torch.bfloat16)  # more than one frame (2 MiB)
    sd["extra"] = {"step": 7, "name": "run", "lr": [0.1, 0.01]}
    return sd


def _blank(sd):
    return {k: ({"step": None, "name": None, "lr": None} if isinstance(v, dict) else torch.zeros_like(v)) for k, v in sd.items()}


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.numel() and a.dim() else a,
                                                                          b.view(torch.uint8) if b.numel() and b.dim() else b)
    return a == b


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("zstd") / "ck")
    sd = _state()
    distckpt.save(sd, storage_writer=FileSystemWriter(path, compression="zstd"))
    return path, sd


def _body(path):
    raw = open(os.path.join(path, "metadata.json"), "rb").read()
    return json.loads(raw[: raw.rindex(b',"crc32c":')] + b"}")


def _write_body(path, body):
    prefix = json.dumps(body, separators=(",", ":")).encode()[:-1]
    with open(os.path.join(path, "metadata.json"), "wb") as f:
        f.write(prefix + b',"crc32c":"' + f"{crc32c(prefix):08x}".encode() + b'"}\n')


def test_every_dtype_round_trips_bit_exact_and_the_document_is_4_0(saved):
    path, sd = saved
    out = _blank(sd)
    distckpt.load(out, checkpoint_id=path)
    for key in sd:
        assert _equal(out[key], sd[key]), key
    body = _body(path)
    assert body["format_version"] == "4.0"
    record = body["state_dict_metadata"]["bfloat16"]["chunks"][0][5]
    assert set(record) == {"codec", "length", "crc32c"} and record["codec"] == ["bytegroup.zstd/1"]
    assert record["crc32c"] == crc32c(sd["bfloat16"].view(torch.uint8).numpy().tobytes())


def test_stored_bytes_shrink_and_what_does_not_shrink_is_stored_as_it_is(saved):
    path, sd = saved
    md = distckpt.read_metadata(path)
    items = {ix.fqn: si for ix, si in md.storage_data.items.items()}
    assert items["big"].codec.startswith("bytegroup.zstd/1#") and items["big"].length < 0.75 * sd["big"].nbytes
    assert items["ids"].length < 0.1 * sd["ids"].nbytes
    assert items["bfloat16_0d"].codec == "identity"  # two bytes: a header would only add to them


def test_memory_writer_compresses_too():
    sd = {"w": (torch.randn(64, 64) * 0.02).to(torch.bfloat16), "step": 3}
    distckpt.save(sd, storage_writer=distckpt.MemoryWriter("zstd-mem", compression="zstd", compression_level=3))
    out = {"w": torch.zeros(64, 64, dtype=torch.bfloat16), "step": None}
    distckpt.load(out, checkpoint_id="memory://zstd-mem")
    assert torch.equal(out["w"], sd["w"]) and out["step"] == 3


@pytest.mark.parametrize("kwargs", [{"compression": "lz4"}, {"compression": "zstd", "compression_level": 99},
                                    {"compression_level": 3}, {"compression": "zstd", "compression_level": "3"}])
def test_unknown_compression_settings_are_refused(tmp_path, kwargs):
    with pytest.raises(CheckpointError, match="compression"):
        FileSystemWriter(str(tmp_path / "ck"), **kwargs)


def test_compression_and_stream_extensions_are_exclusive(tmp_path):
    with pytest.raises(CheckpointError, match="not both"):
        FileSystemWriter(str(tmp_path / "ck"), compression="zstd", _extensions=[distckpt.ZStandard()])


def test_open_slices_a_compressed_tensor(saved):
    path, sd = saved
    with distckpt.open(path) as ckpt:
        assert torch.equal(ckpt["bfloat16"][10:20, 3:9], sd["bfloat16"][10:20, 3:9])
        assert torch.equal(ckpt["big"][1000:3000], sd["big"][1000:3000])
        assert torch.equal(ckpt["complex128"][5], sd["complex128"][5])
        assert ckpt["extra.step"] == 7


def test_verify_api_and_cli_pass_a_compressed_checkpoint(saved):
    path, _ = saved
    assert distckpt.verify(path).ok
    res = CliRunner().invoke(main, ["verify", path])
    assert res.exit_code == 0, res.output


def _chunk(body, key):
    return body["state_dict_metadata"][key]["chunks"][0]


def _file(path, body, chunk):
    return os.path.join(path, body["storage_data"]["$files"]["files"][chunk[2]][0])


def _forge_stored(path, key, change):
    """Rewrite the stored bytes of ``key`` in place through ``change(bytearray)``, and reseal the location's
    checksum (and length, if ``change`` returns a shorter count), as an attacker can."""
    body = _body(path)
    chunk = _chunk(body, key)
    with open(_file(path, body, chunk), "r+b") as f:
        f.seek(chunk[3])
        stored = bytearray(f.read(chunk[5]["length"]))
        keep = change(stored) or len(stored)
        f.seek(chunk[3])
        f.write(stored)
    chunk[5]["length"] = keep
    chunk[4] = crc32c(bytes(stored[:keep]))
    _write_body(path, body)


def _copy(saved, tmp_path):
    import shutil

    return shutil.copytree(saved[0], str(tmp_path / "ck"))


def _refused(path, sd, key, match):
    """Load, open and verify each refuse ``key``'s chunk with a CorruptCheckpointError naming the key."""
    with pytest.raises(CorruptCheckpointError, match=match) as info:
        distckpt.load(_blank(sd), checkpoint_id=path)
    assert key in str(info.value)
    with pytest.raises(CorruptCheckpointError, match=match), distckpt.open(path) as ckpt:
        ckpt[key][0]
    report = distckpt.verify(path, raise_on_error=False)
    assert not report.ok and any(key in p for p in report.problems), report.problems
    res = CliRunner().invoke(main, ["verify", path])
    assert res.exit_code != 0 and key in res.output


def test_a_flipped_stored_byte_is_found(saved, tmp_path):
    path = _copy(saved, tmp_path)
    body = _body(path)
    chunk = _chunk(body, "float32")
    with open(_file(path, body, chunk), "r+b") as f:
        f.seek(chunk[3] + 100)
        b = f.read(1)
        f.seek(chunk[3] + 100)
        f.write(bytes([b[0] ^ 0x10]))
    _refused(path, saved[1], "float32", "checksum|CRC")


def test_a_forged_decoded_checksum_is_found(saved, tmp_path):
    path = _copy(saved, tmp_path)
    body = _body(path)
    _chunk(body, "float32")[5]["crc32c"] ^= 1
    _write_body(path, body)
    _refused(path, saved[1], "float32", "CRC-32C")


def test_a_record_without_its_decoded_checksum_is_refused(saved, tmp_path):
    path = _copy(saved, tmp_path)
    body = _body(path)
    del _chunk(body, "float32")[5]["crc32c"]
    _write_body(path, body)
    with pytest.raises(CorruptCheckpointError, match="crc32c"):
        distckpt.load(_blank(saved[1]), checkpoint_id=path)


@pytest.mark.parametrize("bad", [-1, 2**32, "00ff00ff", None, 1.5])
def test_a_malformed_decoded_checksum_is_refused(saved, tmp_path, bad):
    path = _copy(saved, tmp_path)
    body = _body(path)
    _chunk(body, "float32")[5]["crc32c"] = bad
    _write_body(path, body)
    with pytest.raises(CorruptCheckpointError, match="malformed"):
        distckpt.read_metadata(path)


def test_a_forged_element_width_is_found(saved, tmp_path):
    path = _copy(saved, tmp_path)
    _forge_stored(path, "float32", lambda s: s.__setitem__(5, 2))  # planes of 2 bytes in elements of 4: another table
    _refused(path, saved[1], "float32", "bytegroup.zstd/1")
    path = _copy(saved, tmp_path / "b")
    _forge_stored(path, "float32", lambda s: s.__setitem__(5, 0))
    _refused(path, saved[1], "float32", "malformed")


def _pieces(stored):
    """Where the pieces of stored bytes begin, their table's entries, and each piece's plane bytes."""
    width = stored[5]
    count = struct.unpack_from("<Q", stored, 8)[0] // width
    frame = struct.unpack_from("<I", stored, 16)[0]
    frames = -(-count // frame)
    lengths = struct.unpack_from(f"<{width * frames}I", stored, HEADER.size)
    planes = [min(frame, count - f * frame) for f in range(frames) for _ in range(width)]
    return HEADER.size + 4 * len(lengths), list(lengths), planes


def test_truncated_frames_are_found(saved, tmp_path):
    """The table gives a compressed piece 17 bytes less and the one before 17 more: every length adds up, the frame is
    cut; and stored bytes whose last frame is cut, its table entry to match."""
    path = _copy(saved, tmp_path)

    def change(stored):
        _, lengths, planes = _pieces(stored)
        p = next(i for i, (n, m) in enumerate(zip(lengths, planes)) if n != m)
        lengths[p] -= 17
        lengths[p - 1] += 17
        struct.pack_into(f"<{len(lengths)}I", stored, HEADER.size, *lengths)

    _forge_stored(path, "big", change)
    _refused(path, saved[1], "big", "frame")
    data = (torch.randn(5000) * 0.02).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    stored = bytearray(encode_planes(memoryview(data), 2))
    _, lengths, planes = _pieces(stored)
    assert lengths[-1] != planes[-1]
    lengths[-1] -= 17
    struct.pack_into(f"<{len(lengths)}I", stored, HEADER.size, *lengths)
    with pytest.raises(CorruptCheckpointError, match="key 'x': frame 0 of byte plane 1 does not decode"):
        ByteGroupZstd().decode(memoryview(stored[:-17]), len(data), "key 'x'")


def _frame_content_offset(frame):
    """Where a zstd frame's header records its content size, and in how many bytes (RFC 8878, 3.1.1.1)."""
    d = frame[4]
    single, dict_flag, fcs_flag = (d >> 5) & 1, d & 3, d >> 6
    at = 5 + (0 if single else 1) + (0, 1, 2, 4)[dict_flag]
    return at, (1 if single else 0, 2, 4, 8)[fcs_flag]


def test_a_frame_whose_content_size_disagrees_is_found(saved, tmp_path):
    path = _copy(saved, tmp_path)

    def change(stored):
        at, lengths, planes = _pieces(stored)
        p = next(i for i, (n, m) in enumerate(zip(lengths, planes)) if n != m)  # the first compressed piece
        at += sum(lengths[:p])
        where, size = _frame_content_offset(stored[at:at + 18])
        value = int.from_bytes(stored[at + where: at + where + size], "little")
        stored[at + where: at + where + size] = (value - 1).to_bytes(size, "little")

    _forge_stored(path, "float32", change)
    _refused(path, saved[1], "float32", "records")


def test_a_tiny_chunk_claiming_a_huge_size_is_refused_before_allocating():
    """A zstd frame of a few bytes that says it holds 4 GiB: refused from the header, nothing allocated."""
    claim = (1 << 32) - 1
    frame = b"\x28\xb5\x2f\xfd" + bytes([0b1110_0000]) + claim.to_bytes(8, "little") + bytes([0x03, 0x00, 0x10, 0x00])
    stored = HEADER.pack(b"DCBG", 1, 1, 0, claim, 0xFFFF_FFFF) + struct.pack("<I", len(frame)) + frame
    codec = ByteGroupZstd().expecting(0)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match="records") as info:
            codec.decode(memoryview(stored), claim, "key 'w'")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20 and "key 'w'" in str(info.value)
    assert claim > MAX_RATIO * len(frame)


def test_a_chunk_whose_header_disagrees_with_its_size_is_refused(saved, tmp_path):
    """The metadata claims a tensor of 512 GiB: the stored header's length must be it, and a header forged to say so
    needs a frame table that the stored bytes cannot hold."""
    path = _copy(saved, tmp_path)
    body = _body(path)
    entry = body["state_dict_metadata"]["big"]
    entry["size"] = entry["chunks"][0][1] = [1 << 38]
    _write_body(path, body)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match="big") as info, distckpt.open(path) as ckpt:
            ckpt["big"][0:4]
        assert "not the" in str(info.value)
        _forge_stored(path, "big", lambda s: s.__setitem__(slice(8, 16), struct.pack("<Q", 1 << 39)))
        with pytest.raises(CorruptCheckpointError, match="does not fit"), distckpt.open(path) as ckpt:
            ckpt["big"][0:4]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_codec_bytes_round_trip_at_frame_edges(width):
    data = os.urandom(width * 3) + bytes(width * 10000)  # 10003 elements
    for frame in (4096, 4099, 10002, 10003, 1 << 20):
        stored = encode_planes(memoryview(data), width, frame=frame)
        assert bytes(ByteGroupZstd().decode(memoryview(stored), len(data), "k")) == data
    with pytest.raises(CorruptCheckpointError, match="more than"):
        ByteGroupZstd().decode(memoryview(stored), -1, "k", limit=len(data) - 1)


def test_uncompressed_data_files_stay_safetensors_and_compressed_ones_hold_u8_entries(saved, tmp_path):
    from safetensors import safe_open

    plain = str(tmp_path / "plain")
    sd = {"w": (torch.randn(300, 70) * 0.02).to(torch.bfloat16)}
    distckpt.save(sd, storage_writer=FileSystemWriter(plain))
    body = _body(plain)
    assert body["format_version"] != "4.0"
    with safe_open(os.path.join(plain, body["storage_data"]["$files"]["files"][0][0]), framework="pt") as f:
        assert torch.equal(f.get_tensor("w@0,0"), sd["w"])
    # a compressed chunk is a valid U8 entry of a valid safetensors file: what safetensors sees is the stored bytes
    path, sd = saved
    body = _body(path)
    chunk = _chunk(body, "bfloat16")
    with safe_open(_file(path, body, chunk), framework="pt") as f:
        stored = f.get_tensor("bfloat16@0,0")
    assert stored.dtype == torch.uint8 and stored.shape == (chunk[5]["length"],)
    assert bytes(stored[:4].tolist()) == b"DCBG" and crc32c(stored.numpy().tobytes()) == chunk[4]


def test_older_documents_with_codec_records_still_load(tmp_path):
    """DCP's stream transforms keep format 2.1 records, with no decoded checksum."""
    path = str(tmp_path / "ck")
    sd = {"w": torch.randn(50, 5)}
    distckpt.save(sd, storage_writer=FileSystemWriter(path, _extensions=[distckpt.ZStandard()]))
    assert _body(path)["format_version"] in ("2.1", "3.0")
    out = {"w": torch.zeros(50, 5)}
    distckpt.load(out, storage_reader=FileSystemReader(path))
    assert torch.equal(out["w"], sd["w"])


@pytest.mark.parametrize("threads", [1, 2])
def test_compressed_items_are_encoded_file_by_file(tmp_path, monkeypatch, threads):
    """A rank's compressed tensors go into files of about DISTCKPT_MIN_FILE_BYTES each, encoded as they are written;
    views and bools with stray bytes are stored from their host bytes as plain items are."""
    monkeypatch.setenv("DISTCKPT_MIN_FILE_BYTES", str(64 << 10))
    g = torch.Generator().manual_seed(3)
    sd = {f"w{i}": (torch.randn(128, 256, generator=g) * 0.02).to(torch.bfloat16) for i in range(8)}
    sd["view"] = (torch.randn(256, 128, generator=g) * 0.02).t()
    sd["mask"] = torch.tensor([0, 2, 0, 7] * 2000, dtype=torch.uint8).view(torch.bool)
    path = str(tmp_path / "ck")
    distckpt.save(sd, storage_writer=FileSystemWriter(path, compression="zstd", thread_count=threads))
    files = _body(path)["storage_data"]["$files"]["files"]
    assert len(files) >= 4
    out = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sd.items()}
    distckpt.load(out, checkpoint_id=path)
    for k, v in sd.items():
        want = v.view(torch.uint8).ne(0) if k == "mask" else v
        assert torch.equal(out[k].view(torch.uint8) if k == "mask" else out[k], want.view(torch.uint8) if k == "mask" else want), k
    assert distckpt.verify(path).ok


@pytest.mark.parametrize("at, value", [(0, 0x44), (4, 2), (6, 1), (21, 1)])
def test_a_header_with_other_magic_layout_or_nonzero_reserved_bytes_is_refused(at, value):
    data = (torch.randn(4096) * 0.02).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    stored = bytearray(encode_planes(memoryview(data), 2))
    stored[at] = value if stored[at] != value else value + 1
    with pytest.raises(CorruptCheckpointError, match="key 'k'.*header"):
        ByteGroupZstd().decode(memoryview(stored), len(data), "key 'k'")


def test_frames_of_a_few_elements_are_refused_unless_one_frame_holds_all():
    """A forged E of one element a frame would make the decoder take one step per stored byte or two."""
    import struct

    from distckpt.errors import CorruptCheckpointError
    from distckpt.format.bytegroup import HEADER, MAGIC, ByteGroupZstd, encode_planes

    data = memoryview(bytes(range(256)) * 64)  # 16384 bytes: 8192 two-byte elements
    stored = bytearray(encode_planes(data, 2))
    magic, version, width, reserved, length, frame = HEADER.unpack_from(stored)
    assert magic == MAGIC and frame >= length // width  # one frame holds them all: allowed whatever E says
    forged = bytearray(stored)
    struct.pack_into("<I", forged, 16, 1)  # E = 1: 8192 frames of one element
    with pytest.raises(CorruptCheckpointError):
        ByteGroupZstd().decode(memoryview(forged), len(data), "forged")
