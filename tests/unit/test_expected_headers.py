"""A reader compares each data file's header with the one the metadata implies, and parses only when they differ."""

import glob
import os

import pytest
import torch

import distckpt
from distckpt.engine import data_files
from distckpt.engine import read as reading
from distckpt.errors import CorruptCheckpointError
from distckpt.format import expected_headers
from distckpt.format.checksum import crc32c
from distckpt.format.expected_headers import expected_leads
from distckpt.testing import run_ranks
from distckpt.testing.states import assert_same

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden")


def _leads(path):
    md = distckpt.read_metadata(path)
    return md, expected_leads(md, list(md.storage_data.files))


def _lead_of(path, name, n):
    with open(os.path.join(path, name), "rb") as f:
        return f.read(n)


def _every_kind():
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(33, 7, generator=g),  # an odd size: written after the items of whole cache lines
        "b": torch.randn(64, generator=g).to(torch.bfloat16),
        "mask": torch.randn(5, 5, generator=g) > 0,
        "z": torch.randn(3, generator=g, dtype=torch.complex64),  # no safetensors code: stored as U8 bytes
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "empty2": torch.zeros(2, 0),
        "ids": torch.arange(300),
        "step": 17,
        "cfg": {"name": "x", "sizes": [1, 2]},
    }


@pytest.mark.parametrize("version", ["v2.1", "v3.0"])
def test_the_writer_s_headers_are_the_ones_the_metadata_implies(version):
    for path in sorted(glob.glob(os.path.join(GOLDEN, version, "*"))):
        md, leads = _leads(path)
        assert set(leads) == set(md.storage_data.files), path
        for name, lead in leads.items():
            assert _lead_of(path, name, len(lead)) == lead, (path, name)


def test_every_kind_of_item_matches_and_loads_without_parsing_a_header(tmp_path, monkeypatch):
    path = str(tmp_path / "ck")
    sd = _every_kind()
    distckpt.save(sd, checkpoint_id=path)
    _, leads = _leads(path)
    assert leads and all(_lead_of(path, n, len(lead)) == lead for n, lead in leads.items())

    def no_parse(*args, **kwargs):
        raise AssertionError("the header was parsed although it is the one the metadata implies")

    monkeypatch.setattr(data_files, "read_header", no_parse)
    dest = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in sd.items()}
    dest["cfg"] = {"name": "", "sizes": [0, 0]}
    distckpt.load(dest, checkpoint_id=path)
    assert_same(dest, sd)


def test_zstandard_items_match_too(tmp_path):
    pytest.importorskip("zstandard")
    path = str(tmp_path / "ck")
    sd = _every_kind()
    distckpt.save(sd, storage_writer=distckpt.FileSystemWriter(path, _extensions=[distckpt.ZStandard()]))
    md, leads = _leads(path)
    assert md.version == "2.1" and set(leads) == set(md.storage_data.files)
    assert all(_lead_of(path, n, len(lead)) == lead for n, lead in leads.items())


def _sharded_save(rank, world_size, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(24 * 6, dtype=torch.float32).reshape(24, 6)
    distckpt.save({"sharded": distribute_tensor(full, mesh, [Shard(1)]), "plain": torch.ones(5),
                   "rank": distckpt.RankLocal(rank)}, checkpoint_id=path)


def test_sharded_chunks_match(tmp_path):
    path = str(tmp_path / "ck")
    run_ranks(_sharded_save, 2, path)
    md, leads = _leads(path)
    assert set(leads) == set(md.storage_data.files) and len(leads) == 2
    assert all(_lead_of(path, n, len(lead)) == lead for n, lead in leads.items())


def test_a_header_that_differs_from_the_implied_one_is_parsed_and_checked(tmp_path, monkeypatch):
    path = str(tmp_path / "ck")
    sd = _every_kind()
    distckpt.save(sd, checkpoint_id=path)
    parsed = []
    real = data_files.read_header
    monkeypatch.setattr(data_files, "read_header", lambda *a: parsed.append(1) or real(*a))
    real_leads = expected_headers.expected_leads
    # another writer's header (here: a reader that expects one byte more) is parsed, and the load still works
    monkeypatch.setattr(reading, "expected_leads", lambda md, names: {n: b + b" " for n, b in real_leads(md, names).items()})
    dest = {k: torch.zeros_like(v) for k, v in sd.items() if isinstance(v, torch.Tensor)}
    distckpt.load(dest, checkpoint_id=path, planner=distckpt.DefaultLoadPlanner(allow_partial_load=True))
    assert parsed and all(torch.equal(dest[k], sd[k]) for k in dest)


def test_the_implied_header_with_another_recorded_checksum_is_refused(tmp_path):
    from tests.security.helpers import read_body, write_body

    path = str(tmp_path / "ck")
    distckpt.save({"w": torch.ones(8)}, checkpoint_id=path)
    body = read_body(path, per_key=False)
    body["storage_data"]["$files"]["files"][0][3] ^= 1
    write_body(path, body)
    with pytest.raises(CorruptCheckpointError, match="header checksum mismatch"):
        distckpt.load({"w": torch.zeros(8)}, checkpoint_id=path)


def test_a_header_edited_to_disagree_is_named_whatever_its_checksum(tmp_path):
    from tests.security.helpers import read_body, write_body

    path = str(tmp_path / "ck")
    distckpt.save({"w": torch.ones(8), "v": torch.ones(4)}, checkpoint_id=path)
    body = read_body(path, per_key=False)
    name = body["storage_data"]["$files"]["files"][0][0]
    data = os.path.join(path, name)
    raw = open(data, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    forged = raw[8:8 + n].replace(b'"shape":[8]', b'"shape":[2]')  # still valid JSON, now disagreeing
    forged = forged.replace(b'"data_offsets":[0,32]', b'"data_offsets":[0,8] ')
    with open(data, "r+b") as f:
        f.seek(8)
        f.write(forged)
    body["storage_data"]["$files"]["files"][0][3] = crc32c(forged, crc32c(raw[:8]))
    write_body(path, body)
    with pytest.raises(CorruptCheckpointError, match="lists no entry|stores it as"):
        distckpt.load({"w": torch.zeros(8), "v": torch.zeros(4)}, checkpoint_id=path)
