"""Decoding is bounded: a value stored through a codec decodes to at most DISTCKPT_MAX_VALUE_BYTES (or the
``limit`` a caller gives), every stage of a chain of stream transforms is capped, even one a user wrote that
reads its input whole, and verify checks a value that decodes to hundreds of MiB in a few MiB of memory."""

import io
import json
import os
import subprocess
import sys
import textwrap
import tracemalloc

import pytest

import distckpt
from distckpt import CorruptCheckpointError, FileSystemWriter, StreamTransformExtension, ZStandard
from distckpt.format.chunk_codec import ChunkCodec
from distckpt.format.stream_transforms import StreamTransforms

pytestmark = pytest.mark.skipif(not ZStandard.is_available(), reason="needs zstandard")


class Whole(StreamTransformExtension):
    """Passes bytes through, but its reader reads all of its input at once, as a careless transform might."""

    @staticmethod
    def registry_name():
        return "test.whole"

    @staticmethod
    def from_descriptor(version):
        return Whole()

    def get_descriptor(self):
        return "test.whole/1"

    def transform_to(self, output):
        return output

    def transform_from(self, input):
        return io.BytesIO(input.read())


class OldStyle(ChunkCodec):
    """A codec written before ``limit`` existed: decode takes three arguments."""

    name = "test-old-style"

    def encode(self, data):
        return bytes(data) * 2

    def decode(self, stored, nbytes, where):
        return memoryview(bytes(stored[: len(stored) // 2]))


def _bomb(nbytes, extensions=None):
    codec = StreamTransforms(extensions or [ZStandard()])
    return codec, memoryview(codec.encode(memoryview(bytes(nbytes))))


def test_a_value_may_not_decode_past_the_limit():
    codec, stored = _bomb(8 << 20)
    assert len(stored) < 4096
    assert len(codec.decode(stored, -1, "key 'v'")) == 8 << 20
    assert codec.decoded_size(stored, -1, "key 'v'") == 8 << 20
    with pytest.raises(CorruptCheckpointError, match=r"key 'v'.*stream.zstd/1.*more than 1048576 bytes.*limit=1048576"):
        codec.decode(stored, -1, "key 'v'", limit=1 << 20)
    with pytest.raises(CorruptCheckpointError, match=r"key 'v'.*more than 1048576"):
        codec.decoded_size(stored, -1, "key 'v'", limit=1 << 20)
    assert len(codec.decode(stored, -1, "key 'v'", limit=8 << 20)) == 8 << 20  # exactly the limit is fine


def test_the_knob_is_the_default_limit(monkeypatch):
    codec, stored = _bomb(2 << 20)
    monkeypatch.setenv("DISTCKPT_MAX_VALUE_BYTES", str(1 << 20))
    with pytest.raises(CorruptCheckpointError, match=r"key 'v'.*more than 1048576 bytes.*raise DISTCKPT_MAX_VALUE_BYTES"):
        codec.decode(stored, -1, "key 'v'")
    monkeypatch.setenv("DISTCKPT_MAX_VALUE_BYTES", "lots")
    with pytest.raises(distckpt.CheckpointError, match="DISTCKPT_MAX_VALUE_BYTES"):
        codec.decode(stored, -1, "key 'v'")


def test_a_chunk_may_not_decode_past_its_bytes():
    codec, stored = _bomb(1 << 20)
    with pytest.raises(CorruptCheckpointError, match=r"key 'w'.*more than the 1000 bytes of the item"):
        codec.decode(stored, 1000, "key 'w'")
    with pytest.raises(CorruptCheckpointError, match=r"key 'w'.*more than the 1000 bytes of the item"):
        codec.decoded_size(stored, 1000, "key 'w'")
    with pytest.raises(CorruptCheckpointError, match=r"key 'w'.*to 1048576 bytes, not the 2000000"):
        codec.decode(stored, 2_000_000, "key 'w'")
    assert bytes(codec.decode(stored, 1 << 20, "key 'w'")) == bytes(1 << 20)


def test_every_stage_of_a_chain_is_capped_even_one_that_reads_its_input_whole():
    # written as Whole(ZStandard(data)): on load zstd's output is what Whole reads at once
    codec, stored = _bomb(64 << 20, [ZStandard(), Whole()])
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match=r"key 'v'.*at stream.zstd/1.*more than 1048576 bytes"):
            codec.decode(stored, -1, "key 'v'", limit=1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20
    assert len(codec.decode(stored, -1, "key 'v'", limit=64 << 20)) == 64 << 20


def test_a_codec_whose_decode_takes_no_limit_is_checked_after_it_returns():
    codec = OldStyle()
    stored = memoryview(codec.encode(memoryview(bytes(100))))
    assert len(codec.decode(stored, -1, "key 'v'")) == 100
    assert len(codec.decode(stored, 100, "key 'v'", limit=10)) == 100  # a chunk's bound is its bytes
    assert codec.decoded_size(stored, -1, "key 'v'", limit=100) == 100
    with pytest.raises(CorruptCheckpointError, match=r"key 'v'.*test-old-style.*more than 99 bytes"):
        codec.decode(stored, -1, "key 'v'", limit=99)
    with pytest.raises(CorruptCheckpointError, match=r"more than the 50 bytes of the item"):
        codec.decode(stored, 50, "key 'v'")


def test_a_load_stops_at_the_knob(tmp_path, monkeypatch):
    path = str(tmp_path / "ck")
    distckpt.save({"blob": bytes(4 << 20)}, storage_writer=FileSystemWriter(path, _extensions=[ZStandard()]))
    out = {"blob": b""}
    distckpt.load(out, checkpoint_id=path)
    assert out["blob"] == bytes(4 << 20)
    monkeypatch.setenv("DISTCKPT_MAX_VALUE_BYTES", str(1 << 20))
    with pytest.raises(CorruptCheckpointError, match=r"key 'blob'.*more than 1048576 bytes.*DISTCKPT_MAX_VALUE_BYTES"):
        distckpt.load({"blob": b""}, checkpoint_id=path)
    report = distckpt.verify(path, raise_on_error=False)
    assert len(report.problems) == 1 and "DISTCKPT_MAX_VALUE_BYTES" in report.problems[0]


# The peak RSS of this process alone (VmHWM): ru_maxrss carries the parent's peak across fork and exec.
_MEASURE = textwrap.dedent("""
    import sys
    import distckpt

    def peak_kib():
        return int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM:")).split()[1])

    small, big = sys.argv[1:3]
    distckpt.verify(small)  # everything a verify imports or caches, before the measure
    before = peak_kib()
    report = distckpt.verify(big)
    print(report.items, (peak_kib() - before) // 1024)
""")


@pytest.mark.slow  # guards that stay: test_a_load_stops_at_the_knob, tests/security's zstd bombs (bounded memory)
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the peak RSS from /proc")
def test_verify_checks_a_value_that_decodes_to_300_mib_in_bounded_memory(tmp_path):
    small, big = str(tmp_path / "small"), str(tmp_path / "big")
    distckpt.save({"blob": bytes(1000)}, storage_writer=FileSystemWriter(small, _extensions=[ZStandard()]))
    distckpt.save({"blob": bytes(224 << 20)}, storage_writer=FileSystemWriter(big, _extensions=[ZStandard()]))
    stored = sum(os.path.getsize(os.path.join(big, f)) for f in os.listdir(big))
    assert stored < 1 << 20  # the 224 MiB value is stored as its base64 text (about 300 MiB), compressed
    doc = json.loads(open(os.path.join(big, "metadata.json"), "rb").read())
    assert doc["state_dict_metadata"]["blob"]["at"][4] == {"codec": ["stream.zstd/1"]}
    run = subprocess.run([sys.executable, "-c", _MEASURE, small, big], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    items, growth_mib = map(int, run.stdout.split())
    assert items == 1
    assert growth_mib < 64, f"verify grew the peak RSS by {growth_mib} MiB"
