"""The gs:// store against a real GCS-compatible server on loopback (fake-gcs-server): the contract suites, a save and
load by URL, a run with retention and incremental saves, the commit race decided by the service's precondition."""

from __future__ import annotations

import sys
import uuid

import pytest
import torch

import distckpt
from distckpt import CheckpointError, CorruptCheckpointError, MissingDependencyError
from distckpt.backends import gcs
from distckpt.backends.gcs import GcsStore
from distckpt.faults import Fault, inject
from distckpt.testing import run_ranks
from distckpt.testing.blob_store_suite import BlobStoreSuite
from distckpt.testing.states import blank_like, seeded
from distckpt.testing.storage_suite import StorageSuite

from ..distributed import workers


def names(client, bucket, prefix):
    return sorted(b.name[len(prefix) + 1:] for b in client.list_blobs(bucket, prefix=prefix + "/"))


class TestGcsStorage(StorageSuite):
    @pytest.fixture(autouse=True)
    def _bucket(self, gcs_bucket):
        self.bucket = gcs_bucket

    def checkpoint_id(self, tmp_path, name):
        return f"gs://{self.bucket}/{tmp_path.name}/{name}"


class TestGcsBlobStore(BlobStoreSuite):
    @pytest.fixture(autouse=True)
    def _bucket(self, gcs_bucket):
        self.bucket = gcs_bucket

    def make_store(self, tmp_path, name):
        return GcsStore(self.bucket, f"contract/{tmp_path.name}/{name}")


def _state(n=3 << 20):
    return seeded({"big": torch.arange(n, dtype=torch.float32), "small": torch.arange(10)}, seed=3, values={"step": 7})


def test_save_and_load_by_url_with_parts_and_parallel_reads(gcs_client, gcs_bucket, monkeypatch):
    """A 12 MiB tensor goes up as 5 MiB parts uploaded in parallel and composed, and comes back in parallel 1 MiB
    ranges; no part object is left."""
    monkeypatch.setenv("DISTCKPT_S3_READ_PIECE_BYTES", str(1 << 20))
    monkeypatch.setenv("DISTCKPT_S3_PART_BYTES", str(5 << 20))
    parts, ranges = [], []
    send, read_range = gcs.GcsObjectWriter._send, gcs.GcsObjectReader._read_range
    monkeypatch.setattr(gcs.GcsObjectWriter, "_send", lambda self, part: (parts.append(len(part)), send(self, part)))
    monkeypatch.setattr(gcs.GcsObjectReader, "_read_range", lambda self, v, o: (ranges.append(sum(map(len, v))), read_range(self, v, o)))
    cid = f"gs://{gcs_bucket}/url/step-1"
    sd = _state()
    store = GcsStore(gcs_bucket, "url/step-1")
    assert store.objects.write_buffer_bytes(12 << 20) <= 12 << 20
    md = distckpt.save(sd, checkpoint_id=cid)
    save_id = md.storage_meta.save_id
    assert names(gcs_client, gcs_bucket, "url/step-1") == ["metadata.json", f"saves/{save_id}/data-00000.safetensors"]
    assert gcs_client.bucket(gcs_bucket).get_blob("url/step-1/metadata.json").metadata == {"distckpt-save-id": save_id}
    out = blank_like(sd)
    distckpt.load(out, checkpoint_id=cid)
    assert torch.equal(out["big"], sd["big"]) and torch.equal(out["small"], sd["small"]) and out["step"] == 7
    assert distckpt.verify(cid).ok
    assert parts[:2] == [5 << 20, 5 << 20] and max(ranges) == 1 << 20 and len(ranges) >= 12, (parts, ranges)


def test_parts_past_one_compose_are_composed_in_a_tree_and_a_failed_writer_leaves_none(gcs_client, gcs_bucket, monkeypatch):
    """34 parts of 1 MiB: two composes of parts, one of those two; then a writer whose compose fails deletes its parts."""
    store = GcsStore(gcs_bucket, f"tree-{uuid.uuid4().hex[:8]}", part_size=1 << 20, upload_concurrency=4)
    data = torch.randint(0, 256, ((34 << 20) - 5,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)).numpy()
    w = store.create("big")
    for at in range(0, len(data), 3 << 20):
        w.pwrite(memoryview(data[at: at + (3 << 20)]), at)
    w.close(True)
    assert names(gcs_client, gcs_bucket, store.prefix) == ["big"]
    back = bytearray(len(data))
    assert store.open("big").readinto(memoryview(back), 0) == len(data) and bytes(back) == data.tobytes()

    def broken(self, bucket, sources, name):
        raise distckpt.StorageIOError(f"composing {name} failed (injected)")

    monkeypatch.setattr(gcs.GcsObjectWriter, "_compose", broken)
    w = store.create("broken")
    w.pwrite(memoryview(data[: 3 << 20]), 0)
    with pytest.raises(distckpt.StorageIOError, match="injected"):
        w.close(True)
    assert names(gcs_client, gcs_bucket, store.prefix) == ["big"]


def test_a_run_with_retention_and_incremental_saves(gcs_client, gcs_bucket):
    from tests.crash.test_incremental_machine import incremental_state, stray_keys

    root = f"gs://{gcs_bucket}/run-{uuid.uuid4().hex[:8]}"
    mgr = distckpt.CheckpointManager(root, keep_last=2, incremental=True)
    for step in (1, 2, 3, 4):
        mgr.save(step, incremental_state(step))
    assert mgr.all_steps() == [3, 4]
    assert any(n.startswith("step-0000000001/") for n in distckpt.read_metadata(mgr.path(4)).storage_data.files)
    prefix = root[len(f"gs://{gcs_bucket}/"):]
    assert stray_keys(names(gcs_client, gcs_bucket, prefix), mgr) == []
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in incremental_state(4).items()}
    assert mgr.load(out) == 4
    assert all(torch.equal(out[k], v) if isinstance(v, torch.Tensor) else out[k] == v for k, v in incremental_state(4).items())


def test_of_two_racing_saves_exactly_one_commits(gcs_client, gcs_bucket):
    """The loser's conditional upload (ifGenerationMatch=0) gets 412 from the service: never an overwrite."""
    cid = f"gs://{gcs_bucket}/race/ckpt"
    fired = []

    def other_save_commits_first(kind, where):
        if not fired:
            fired.append(where)
            distckpt.save({"w": torch.full((3,), 5.0)}, checkpoint_id=cid)

    with pytest.raises(CheckpointError, match="committed by another save"):
        with inject(Fault("call", kinds=("rename",), callback=other_save_commits_first)):
            distckpt.save({"w": torch.full((3,), 9.0)}, checkpoint_id=cid)
    out = {"w": torch.zeros(3)}
    distckpt.load(out, checkpoint_id=cid)
    assert torch.equal(out["w"], torch.full((3,), 5.0))
    assert len({k.split("/")[1] for k in names(gcs_client, gcs_bucket, "race/ckpt") if k.startswith("saves/")}) == 1
    assert GcsStore(gcs_bucket, "race/ckpt").incomplete_saves() == []


def test_an_object_replaced_while_open_is_an_error(gcs_client, gcs_bucket):
    store = GcsStore(gcs_bucket, "replaced")
    w = store.create("blob")
    w.pwrite(memoryview(b"a" * 100), 0)
    w.close(True)
    blob = store.open("blob")
    assert blob.pread(10, 5) == b"a" * 10
    gcs_client.bucket(gcs_bucket).blob("replaced/blob").upload_from_string(b"b" * 100)
    with pytest.raises(CorruptCheckpointError, match="changed while it was being read"):
        blob.pread(10, 5)


def test_a_missing_bucket_names_the_fix(gcs_endpoint):
    with pytest.raises(distckpt.StorageIOError, match="does not exist; create it"):
        distckpt.save({"w": torch.ones(2)}, checkpoint_id=f"gs://no-such-{uuid.uuid4().hex[:8]}/ck")


def test_without_the_sdk_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "google.cloud.storage", None)
    monkeypatch.setattr(gcs, "_CLIENTS", {})
    with pytest.raises(MissingDependencyError, match=r"distckpt\[gcs\]") as info:
        distckpt.save({"w": torch.ones(2)}, checkpoint_id="gs://bucket/ck")
    assert "google-cloud-storage" in str(info.value)


def test_an_empty_metadata_object_is_a_damaged_checkpoint(gcs_client, gcs_bucket):
    gcs_client.bucket(gcs_bucket).blob("empty/ck/metadata.json").upload_from_string(b"")
    with pytest.raises(CorruptCheckpointError):
        distckpt.load({"w": torch.zeros(2)}, checkpoint_id=f"gs://{gcs_bucket}/empty/ck")
    with pytest.raises(CheckpointError, match="cannot read") as info:
        distckpt.save({"w": torch.ones(2)}, checkpoint_id=f"gs://{gcs_bucket}/empty/ck", overwrite=True)
    assert "failed" not in str(info.value), info.value  # the document's damage, not a failed request


@pytest.mark.slow
def test_two_ranks_save_and_one_and_three_load_resharded(gcs_bucket):
    """Ranks are processes of their own: each makes its own client (clients are per process) from the environment."""
    cid = f"gs://{gcs_bucket}/ranks-{uuid.uuid4().hex[:8]}/ckpt"
    run_ranks(workers.save_all_layouts, 2, cid, timeout_s=180)
    for world in (1, 3):
        results = run_ranks(workers.load_all_layouts, world, [cid], timeout_s=180)
        assert all(r == {} for r in results), results


class _Counting:
    """A client that counts the buckets asked of it: proof that the given client is the one used."""

    def __init__(self, client):
        self.client, self.asked = client, 0

    def bucket(self, name):
        self.asked += 1
        return self.client.bucket(name)

    def __getattr__(self, name):
        return getattr(self.client, name)


def test_a_manager_on_gs_takes_a_client_as_a_storage_option(gcs_client, gcs_bucket):
    client = _Counting(gcs_client)
    mgr = distckpt.CheckpointManager(f"gs://{gcs_bucket}/{uuid.uuid4().hex}", keep_last=1, storage_options={"client": client})
    for step in (1, 2):
        mgr.save(step, {"w": torch.full((4,), float(step))})
    out = {"w": torch.zeros(4)}
    assert mgr.load(out) == 2 and torch.equal(out["w"], torch.full((4,), 2.0))
    assert mgr.all_steps() == [2] and client.asked > 0
    assert isinstance(distckpt.backends.writer_for(f"gs://{gcs_bucket}/x"), gcs.GcsWriter)
