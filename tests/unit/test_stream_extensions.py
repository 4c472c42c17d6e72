"""Stream extensions (DCP's ``_extensions=`` and ``_extension_registry=``): every item written through a chain of
stream transforms, recorded in the metadata (format 2.1), loaded bit-exact with resharding, verified, and named
when damaged. DCP's own extension classes and registry work as distckpt's."""

import io
import json
import os

import numpy as np
import pytest
import torch

import distckpt
from distckpt import ExtensionRegistry, FileSystemReader, FileSystemWriter, StreamTransformExtension, ZStandard
from distckpt.testing import run_ranks
from distckpt.testing.states import assert_same, blank_like


class Flip(StreamTransformExtension):
    """Inverts every bit: other bytes of the same length (written for these tests)."""

    @staticmethod
    def registry_name():
        return "test.flip"

    @staticmethod
    def from_descriptor(version):
        if version != "1":
            raise ValueError(f"test.flip version {version}")
        return Flip()

    def get_descriptor(self):
        return "test.flip/1"

    def transform_to(self, output):
        class Writer(io.RawIOBase):
            def writable(self):
                return True

            def write(self, b):
                data = np.frombuffer(bytes(b), dtype=np.uint8) ^ 0xFF
                output.write(data.tobytes())
                return data.size

            def flush(self):
                output.flush()

        return Writer()

    def transform_from(self, input):
        class Reader(io.RawIOBase):
            def readable(self):
                return True

            def readinto(self, b):
                data = input.read(len(b))
                if not data:
                    return 0
                memoryview(b)[: len(data)] = (np.frombuffer(data, dtype=np.uint8) ^ 0xFF).tobytes()
                return len(data)

        return Reader()


class Blob:
    def __init__(self, value):
        self.state = {"blob": value}

    def state_dict(self):
        return self.state

    def load_state_dict(self, state_dict):
        self.state = state_dict


def _state():
    g = torch.Generator().manual_seed(7)
    return {
        "zeros": torch.zeros(256, 64),  # compresses
        "rand": torch.randn(33, 17, generator=g),
        "half": torch.randn(40, generator=g).to(torch.bfloat16),
        "ids": torch.arange(1000),
        "flags": torch.rand(9, generator=g) > 0.5,
        "empty": torch.zeros(0, 3),
        "step": 12,
        "blob": Blob(b"SomeBlobForTesting"),
    }


def _blank():
    out = blank_like({k: v for k, v in _state().items() if k != "blob"})
    out["blob"] = Blob(b"")
    return out


def _check(out):
    want = _state()
    assert out["blob"].state == {"blob": b"SomeBlobForTesting"}
    assert_same({k: v for k, v in out.items() if k != "blob"}, {k: v for k, v in want.items() if k != "blob"})


def _document(path):
    return json.loads(open(os.path.join(path, "metadata.json"), "rb").read())


@pytest.mark.parametrize("threads", [1, 2])
def test_zstandard_round_trip_is_recorded_and_needs_no_reader_option(tmp_path, threads):
    path = str(tmp_path / "ck")
    distckpt.save(_state(), storage_writer=FileSystemWriter(path, thread_count=threads, _extensions=[ZStandard()]))
    doc = _document(path)
    assert doc["format_version"] == "2.1"
    rows = doc["state_dict_metadata"]
    assert rows["zeros"]["chunks"][0][5]["codec"] == ["stream.zstd/1"]
    assert rows["zeros"]["chunks"][0][5]["length"] < 256 * 64 * 4 // 50  # stored compressed
    assert rows["step"]["at"][4] == {"codec": ["stream.zstd/1"]}
    stored = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    assert stored < 256 * 64 * 4 // 4
    out = _blank()
    distckpt.load(out, checkpoint_id=path)
    _check(out)
    report = distckpt.verify(path)
    assert report.problems == [] and report.items == len(rows)


def test_a_users_extension_is_rebuilt_from_its_registry_and_named_without_it(tmp_path):
    path = str(tmp_path / "ck")
    distckpt.save(_state(), storage_writer=FileSystemWriter(path, _extensions=[Flip()]))
    raw = open(os.path.join(path, "data-00000.safetensors"), "rb").read()
    assert b"SomeBlobForTesting" not in raw  # the values went through the transform too
    with pytest.raises(distckpt.CheckpointError, match=r"test\.flip/1.*_extension_registry"):
        distckpt.load(_blank(), checkpoint_id=path)
    registry = ExtensionRegistry()
    registry.register(Flip)
    out = _blank()
    distckpt.load(out, storage_reader=FileSystemReader(path, _extension_registry=registry))
    _check(out)
    assert distckpt.verify(path, FileSystemReader(path, _extension_registry=registry)).problems == []


def test_a_chain_is_undone_in_the_right_order(tmp_path):
    path = str(tmp_path / "ck")
    distckpt.save(_state(), storage_writer=FileSystemWriter(path, _extensions=[Flip(), ZStandard()]))
    rows = _document(path)["state_dict_metadata"]
    assert rows["rand"]["chunks"][0][5]["codec"] == ["stream.zstd/1", "test.flip/1"]  # DCP's order: the last given first
    registry = ExtensionRegistry()
    registry.register(Flip)
    out = _blank()
    distckpt.load(out, storage_reader=FileSystemReader(path, _extension_registry=registry))
    _check(out)


def test_dcps_own_extension_classes_and_registry_work(tmp_path):
    checkpoint_utils = pytest.importorskip("torch.testing._internal.distributed.checkpoint_utils")
    from torch.distributed.checkpoint._extension import ZStandard as TorchZStandard

    if not TorchZStandard.is_available():
        pytest.skip("torch's ZStandard needs zstandard")
    for name, ext, registry in (("zstd", TorchZStandard(), None),
                                ("rot13", checkpoint_utils.Rot13Example(), checkpoint_utils.get_test_extension_registry())):
        path = str(tmp_path / name)
        distckpt.save(_state(), storage_writer=FileSystemWriter(path, _extensions=[ext]))
        out = _blank()
        distckpt.load(out, storage_reader=FileSystemReader(path, _extension_registry=registry))
        _check(out)


def test_damage_inside_a_compressed_item_names_the_key(tmp_path):
    path = str(tmp_path / "ck")
    distckpt.save(_state(), storage_writer=FileSystemWriter(path, _extensions=[ZStandard()]))
    file_no, begin = _document(path)["state_dict_metadata"]["rand"]["chunks"][0][2:4]
    data_file = os.path.join(path, _document(path)["storage_data"]["$files"]["files"][file_no][0])
    blob = bytearray(open(data_file, "rb").read())
    blob[begin + 3] ^= 0x10
    open(data_file, "wb").write(bytes(blob))
    out = _blank()
    with pytest.raises(distckpt.CorruptCheckpointError, match="key 'rand'.*checksum mismatch"):
        distckpt.load(out, checkpoint_id=path)
    assert not out["rand"].any()  # left zeroed, never half-loaded
    report = distckpt.verify(path, raise_on_error=False)
    assert len(report.problems) == 1 and "'rand'" in report.problems[0]


def test_a_checkpoint_dcp_wrote_through_zstandard_loads(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard as TorchZStandard

    if not TorchZStandard.is_available():
        pytest.skip("torch's ZStandard needs zstandard")
    sd = {"w": torch.randn(8, 4), "zeros": torch.zeros(64), "step": 3}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp"), _extensions=[TorchZStandard()]), no_dist=True)
    out = {"w": torch.zeros(8, 4), "zeros": torch.ones(64), "step": 0}
    distckpt.load(out, checkpoint_id=str(tmp_path / "dcp"))
    assert torch.equal(out["w"], sd["w"]) and not out["zeros"].any() and out["step"] == 3


def _save_sharded(rank, world_size, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    sd = {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": 4}
    distckpt.save(sd, storage_writer=FileSystemWriter(path, _extensions=[ZStandard()]))
    return True


def test_a_compressed_save_at_two_ranks_reshards_at_one(tmp_path):
    path = str(tmp_path / "ck")
    assert run_ranks(_save_sharded, 2, path) == [True, True]
    out = {"w": torch.zeros(6, 10), "step": 0}
    distckpt.load(out, checkpoint_id=path)
    assert torch.equal(out["w"], torch.arange(60, dtype=torch.float32).reshape(6, 10)) and out["step"] == 4
    doc = _document(path)
    assert [c[5]["codec"] for c in doc["state_dict_metadata"]["w"]["chunks"]] == [["stream.zstd/1"]] * 2
    assert distckpt.read_metadata(path).version == "2.1"
