"""The S3 backend against a real S3-compatible server on loopback (moto's HTTP server)."""

from __future__ import annotations

import os
import uuid

import pytest
import torch
from click.testing import CliRunner
from hypothesis import settings

import distckpt
from distckpt import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, StorageIOError
from distckpt.backends import S3Reader, S3Writer, s3_objects
from distckpt.backends.s3 import S3Store
from distckpt.cli import main as cli
from distckpt.faults import Fault, inject
from distckpt.testing import run_ranks
from distckpt.testing.blob_store_suite import BlobStoreSuite
from distckpt.testing.states import blank_like, seeded
from distckpt.testing.storage_suite import StorageSuite

from ..crash.test_manager import ManagerMachine
from ..distributed import workers
from ..forking import run_in_fork


def keys(client, bucket, prefix):
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return sorted(o["Key"][len(prefix) + 1:] for page in pages for o in page.get("Contents", []))


def pending_uploads(client, bucket, prefix):
    return client.list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/").get("Uploads", [])


class TestS3(StorageSuite):
    @pytest.fixture(autouse=True)
    def _bucket(self, bucket):
        self.bucket = bucket

    def checkpoint_id(self, tmp_path, name):
        return f"s3://{self.bucket}/{tmp_path.name}/{name}"


class TestS3BlobStore(BlobStoreSuite):
    @pytest.fixture(autouse=True)
    def _bucket(self, bucket):
        self.bucket = bucket

    def make_store(self, tmp_path, name):
        return S3Store(self.bucket, f"contract/{tmp_path.name}/{name}")


def _state():
    return seeded({"big": 3 << 20, "small": torch.arange(10)}, seed=3, values={"step": 7})


def _load(cid, **reader_args):
    out = blank_like(_state())
    distckpt.load(out, checkpoint_id=cid, storage_reader=S3Reader(**reader_args))
    return out


def test_layout_multipart_upload_and_round_trip(client, bucket):
    cid = f"s3://{bucket}/layout/step-1"
    sd = _state()
    md = distckpt.save(sd, checkpoint_id=cid, storage_writer=S3Writer(part_size=5 << 20, thread_count=1))
    save_id = md.storage_meta.save_id
    assert keys(client, bucket, "layout/step-1") == ["metadata.json", f"saves/{save_id}/data-00000.safetensors"]
    head = client.head_object(Bucket=bucket, Key=f"layout/step-1/saves/{save_id}/data-00000.safetensors")
    assert head["ContentLength"] > 12 << 20 and "-" in head["ETag"]  # a multipart ETag: the object went up in parts
    assert pending_uploads(client, bucket, "layout/step-1") == []
    out = _load(cid)
    assert torch.equal(out["big"], sd["big"]) and torch.equal(out["small"], sd["small"]) and out["step"] == 7
    assert distckpt.verify(cid).ok


def test_overwrite_keeps_the_old_checkpoint_until_the_new_one_commits(client, bucket):
    cid = f"s3://{bucket}/over/ckpt"
    first = distckpt.save({"w": torch.ones(4)}, checkpoint_id=cid)
    with pytest.raises(StorageIOError):
        with inject(Fault("eio", kinds=("rename",))):
            distckpt.save({"w": torch.zeros(4)}, checkpoint_id=cid, storage_writer=S3Writer(overwrite=True))
    out = {"w": torch.zeros(4)}
    distckpt.load(out, checkpoint_id=cid)
    assert torch.equal(out["w"], torch.ones(4))
    assert all(k == "metadata.json" or first.storage_meta.save_id in k for k in keys(client, bucket, "over/ckpt"))

    second = distckpt.save({"w": torch.full((4,), 2.0)}, checkpoint_id=cid, storage_writer=S3Writer(overwrite=True))
    distckpt.load(out, checkpoint_id=cid)
    assert torch.equal(out["w"], torch.full((4,), 2.0))
    assert keys(client, bucket, "over/ckpt") == ["metadata.json", f"saves/{second.storage_meta.save_id}/data-00000.safetensors"]


def test_of_two_racing_saves_exactly_one_commits(client, bucket):
    cid = f"s3://{bucket}/race/ckpt"
    fired = []

    def other_save_commits_first(kind, where):
        if not fired:
            fired.append(where)
            distckpt.save({"w": torch.full((3,), 5.0)}, checkpoint_id=cid)

    with pytest.raises(CheckpointError, match="committed by another save"):
        with inject(Fault("call", kinds=("rename",), callback=other_save_commits_first)):
            distckpt.save({"w": torch.full((3,), 9.0)}, checkpoint_id=cid)
    assert fired
    out = {"w": torch.zeros(3)}
    distckpt.load(out, checkpoint_id=cid)
    assert torch.equal(out["w"], torch.full((3,), 5.0))
    saves = {k.split("/")[1] for k in keys(client, bucket, "race/ckpt") if k.startswith("saves/")}
    assert len(saves) == 1  # the loser's objects were discarded
    assert S3Store(bucket, "race/ckpt").incomplete_saves() == []


def test_failed_upload_leaves_no_objects_and_no_open_uploads(client, bucket):
    cid = f"s3://{bucket}/failed/ckpt"
    writes = []

    def fail_after_a_part_went_up(kind, where):
        writes.append(where)
        if pending_uploads(client, bucket, "failed/ckpt"):  # a multipart upload is open: its first part went up
            raise OSError(5, "Input/output error (injected)")

    with pytest.raises(StorageIOError, match="failed/ckpt/saves/"):
        with inject(Fault("call", kinds=("write",), callback=fail_after_a_part_went_up)):
            distckpt.save(_state(), checkpoint_id=cid,
                          storage_writer=S3Writer(part_size=5 << 20, thread_count=1))
    assert len(writes) >= 3  # the header and some of the big tensor went out before the failure
    assert keys(client, bucket, "failed/ckpt") == []
    assert pending_uploads(client, bucket, "failed/ckpt") == []
    with pytest.raises(CheckpointNotFoundError):
        _load(cid)


def test_uncommitted_save_is_reported_as_incomplete(bucket):
    cid = f"s3://{bucket}/incomplete/ckpt"
    store = S3Store(bucket, "incomplete/ckpt")
    staging = store.staging("abc123")
    w = staging.create("data-00000.safetensors")
    w.pwrite(memoryview(b"partial"), 0)
    w.close(True)
    assert store.incomplete_saves() == [f"s3://{bucket}/incomplete/ckpt/saves/abc123/"]
    with pytest.raises(CheckpointNotFoundError, match="never committed"):
        _load(cid)


def test_damaged_object_is_detected_by_load_and_verify(client, bucket):
    cid = f"s3://{bucket}/damaged/ckpt"
    md = distckpt.save(_state(), checkpoint_id=cid)
    key = f"damaged/ckpt/saves/{md.storage_meta.save_id}/data-00000.safetensors"
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x40
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    with pytest.raises(CorruptCheckpointError, match="big"):
        _load(cid)
    report = distckpt.verify(cid, raise_on_error=False)
    assert not report.ok and any("big" in p for p in report.problems)
    result = CliRunner().invoke(cli, ["verify", cid])
    assert result.exit_code != 0 and "big" in result.output


def test_object_replaced_while_open_is_an_error(client, bucket):
    store = S3Store(bucket, "replaced")
    w = store.create("blob")
    w.pwrite(memoryview(b"a" * 100), 0)
    w.close(True)
    blob = store.open("blob")
    assert blob.pread(10, 5) == b"a" * 10
    client.put_object(Bucket=bucket, Key="replaced/blob", Body=b"b" * 100)
    with pytest.raises(CorruptCheckpointError, match="changed while it was being read"):
        blob.pread(10, 5)


class _MeanwhilePlanner(distckpt.DefaultLoadPlanner):
    """Runs ``meanwhile`` after the load has read the metadata, before it reads any data."""

    def __init__(self, meanwhile):
        super().__init__()
        self.meanwhile = meanwhile

    def create_local_plan(self):
        plan = super().create_local_plan()
        self.meanwhile()
        return plan


def test_checkpoint_overwritten_or_removed_during_a_load_is_named_as_such(bucket):
    cid = f"s3://{bucket}/during/ckpt"
    distckpt.save({"w": torch.ones(4)}, checkpoint_id=cid)
    new = []

    def overwrite():
        md = distckpt.save({"w": torch.zeros(4)}, checkpoint_id=cid, storage_writer=S3Writer(overwrite=True))
        new.append(md.storage_meta.save_id)

    with pytest.raises(CorruptCheckpointError, match="was overwritten by save") as info:
        distckpt.load({"w": torch.zeros(4)}, checkpoint_id=cid, planner=_MeanwhilePlanner(overwrite))
    assert new[0] in str(info.value) and "Load again" in str(info.value)
    out = {"w": torch.full((4,), 9.0)}
    distckpt.load(out, checkpoint_id=cid)  # loading again reads the new checkpoint
    assert torch.equal(out["w"], torch.zeros(4))

    gone = f"s3://{bucket}/during/gone"
    distckpt.save({"w": torch.ones(4)}, checkpoint_id=gone)
    with pytest.raises(CheckpointNotFoundError, match="was removed while this load read it"):  # as retention does
        distckpt.load({"w": torch.zeros(4)}, checkpoint_id=gone, planner=_MeanwhilePlanner(S3Store(bucket, "during/gone").remove))


def test_writes_must_come_in_order(bucket):
    w = S3Store(bucket, "order").create("blob")
    w.pwrite(memoryview(b"x" * 10), 0)
    w.pwrite(memoryview(b"y" * 10), 20)  # a gap is zero-filled
    with pytest.raises(CheckpointError, match="in order"):
        w.pwrite(memoryview(b"z"), 5)
    w.close(True)
    assert S3Store(bucket, "order").open("blob").pread(30, 0) == b"x" * 10 + bytes(10) + b"y" * 10


def test_bad_locations_are_clear_errors(endpoint):
    for bad in ("s3://", "s3://bucket-only", "s3://bucket-only/"):
        with pytest.raises(CheckpointError, match="needs a bucket and a prefix"):
            distckpt.save({"w": torch.ones(1)}, checkpoint_id=bad)
    with pytest.raises(StorageIOError, match="does not exist; create it"):
        distckpt.save({"w": torch.ones(1)}, checkpoint_id="s3://no-such-bucket-here/x")
    with pytest.raises(StorageIOError, match="(?i)endpoint"):
        distckpt.save({"w": torch.ones(1)}, storage_writer=S3Writer("s3://b/x", endpoint_url="http://127.0.0.1:9"))


def test_cli_inspects_an_s3_checkpoint(bucket):
    cid = f"s3://{bucket}/cli/ckpt"
    distckpt.save(_state(), checkpoint_id=cid)
    result = CliRunner().invoke(cli, ["inspect", cid])
    assert result.exit_code == 0, result.output
    assert "big" in result.output and "small" in result.output
    assert CliRunner().invoke(cli, ["verify", cid]).exit_code == 0
    run = f"s3://{bucket}/cli/run"
    mgr = distckpt.CheckpointManager(run)
    mgr.save(3, {"w": torch.ones(8)})
    mgr.save(5, {"w": torch.ones(8)})
    result = CliRunner().invoke(cli, ["steps", run])
    assert result.exit_code == 0, result.output
    assert [line.split()[1] for line in result.output.splitlines()] == ["3", "5"] and mgr.path(5) in result.output


def test_two_ranks_save_and_three_load_resharded(bucket):
    cid = f"s3://{bucket}/ranks/ckpt"
    run_ranks(workers.save_all_layouts, 2, cid, timeout_s=180)
    for world in (1, 3):
        results = run_ranks(workers.load_all_layouts, world, [cid], timeout_s=180)
        assert all(r == {} for r in results), results


# ---- CheckpointManager on S3: the run model of tests/crash/test_manager.py, with crashes and restarts

_RUN: dict = {}


@pytest.fixture(autouse=True, scope="module")
def _run_bucket(client, bucket):
    _RUN.update(client=client, bucket=bucket)


def stray_objects(root, mgr):
    """Objects under the run ``root`` that are not part of a committed checkpoint, and open uploads."""
    client, bucket = _RUN["client"], _RUN["bucket"]
    prefix = root.split("/", 3)[3]
    live = {f"step-{s:010d}": distckpt.read_metadata(mgr.path(s)).storage_meta.save_id for s in mgr.all_steps()}
    stray = []
    for key in keys(client, bucket, prefix):
        step, _, rest = key.partition("/")
        if step not in live or not (rest == "metadata.json" or rest.startswith(f"saves/{live[step]}/")):
            stray.append(key)
    return stray + [u["Key"] for u in pending_uploads(client, bucket, prefix)]


class S3ManagerMachine(ManagerMachine):
    def new_root(self):
        return f"s3://{_RUN['bucket']}/run-{uuid.uuid4().hex[:10]}"

    def leftovers(self):
        return stray_objects(self.root, self.mgr)

    def remove_root(self):
        pass


TestS3ManagerMachine = S3ManagerMachine.TestCase
TestS3ManagerMachine.settings = settings(settings.get_profile("machines"), stateful_step_count=12, deadline=None)


def test_manager_keeps_a_run_in_memory():
    root = f"memory://run-{uuid.uuid4().hex}"
    mgr = distckpt.CheckpointManager(root, keep_last=2)
    for step in (1, 2, 3):
        mgr.save(step, {"w": torch.full((2,), float(step))})
    assert mgr.all_steps() == [2, 3]
    out = {"w": torch.zeros(2)}
    assert mgr.load(out) == 3 and torch.equal(out["w"], torch.full((2,), 3.0))


def test_parts_upload_in_parallel_and_large_reads_come_back_in_pieces(bucket):
    store = S3Store(bucket, "pieces", part_size=5 << 20, upload_concurrency=3)
    data = torch.randint(0, 256, (40 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    raw = memoryview(data.numpy())
    w = store.create("blob")
    for start in range(0, len(raw), 3 << 20):  # writes that straddle part boundaries
        w.pwrite(raw[start: start + (3 << 20)], start)
    w.close(True)
    blob = store.open("blob")
    assert blob.size == len(raw) and blob.etag.strip('"').endswith("-8")  # eight parts
    back = bytearray(len(raw))
    assert blob.readinto(memoryview(back), 0) == len(raw)  # 40 MiB: three ranged GETs at once
    assert back == raw.tobytes()
    tail = bytearray(100)
    assert blob.readinto(memoryview(tail), len(raw) - 50) == 50 and tail[:50] == raw[-50:].tobytes()
    gets = []  # the engine reads through readv: several views, read in pieces at once too
    real_get = type(blob)._get
    blob._get = lambda views, offset: gets.append(offset) or real_get(blob, views, offset)
    parts = [bytearray(10 << 20), bytearray(20 << 20), bytearray(10 << 20)]
    assert blob.readv([memoryview(p) for p in parts], 0) == len(raw)
    assert b"".join(parts) == raw.tobytes() and sorted(gets) == [0, 16 << 20, 32 << 20]


def test_parts_in_flight_fit_the_writers_share_of_the_memory_budget(client, bucket, monkeypatch):
    """A data file's upload holds the part that fills plus those in flight, within its share of the budget."""
    store = S3Store(bucket, "parts", part_size=5 << 20, upload_concurrency=4)
    assert store.write_buffer_bytes() == 5 * (5 << 20)  # four uploading, one filling
    assert store.write_buffer_bytes(12 << 20) == 2 * (5 << 20)
    assert store.write_buffer_bytes(1) == 2 * (5 << 20)  # never fewer than one part in flight
    writers = []
    real = S3Store.create
    monkeypatch.setattr(S3Store, "create", lambda self, name, share=None: writers.append(real(self, name, share)) or writers[-1])
    monkeypatch.setenv("DISTCKPT_MEMORY_BUDGET_BYTES", str(24 << 20))  # one file: a share of 12 MiB
    cid = f"s3://{bucket}/budget/ckpt"
    sd = _state()
    distckpt.save(sd, checkpoint_id=cid, storage_writer=S3Writer(part_size=5 << 20, thread_count=1))
    assert [w.concurrency for w in writers] == [1]
    head = client.head_object(Bucket=bucket, Key=f"budget/ckpt/{keys(client, bucket, 'budget/ckpt')[1]}")
    assert "-" in head["ETag"]  # still a multipart upload
    out = _load(cid)
    assert torch.equal(out["big"], sd["big"]) and torch.equal(out["small"], sd["small"])


def test_async_save_to_s3_writes_the_staged_state(bucket):
    cid = f"s3://{bucket}/async/ckpt"
    sd = _state()
    staged = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    handle = distckpt.async_save(sd, checkpoint_id=cid)
    sd["big"].fill_(-1.0)  # training goes on while the upload runs
    handle.result(timeout=120)
    out = _load(cid)
    assert torch.equal(out["big"], staged["big"]) and torch.equal(out["small"], staged["small"])



# ---- real SIGKILLs at every boundary of a 2-rank save to S3 (the sweep of tests/crash, on S3)

@pytest.mark.slow  # guards that stay: TestS3ManagerMachine (crashes and restarts on S3), tests/crash (every boundary class)
def test_kill_a_rank_at_chosen_boundaries_of_an_s3_save(bucket):
    """The shipped crash model (distckpt.testing.crash_model) against the object store, at the first boundary of
    each kind on each object of each rank, each rank's last, and the commit (a rename and the boundary after it: on
    S3 the step turns committed two boundaries past the rename): 14 of the 24 today; every boundary under --run-slow (the
    next test)."""
    from distckpt.testing import crash_model, run_ranks

    run = f"s3://{bucket}/kill-{uuid.uuid4().hex[:8]}"
    points = run_ranks(crash_model.record_points, 2, f"{run}/record", env=crash_model.ENV)
    outcomes = {}
    for rank, rank_points in enumerate(points):
        firsts = {point: i for i, point in reversed(list(enumerate(rank_points)))}
        chosen = set(firsts.values()) | {len(rank_points) - 1}
        chosen |= {j for i, (kind, _) in enumerate(rank_points) if kind == "rename" for j in (i, i + 1) if j < len(rank_points)}
        for index in sorted(chosen):
            root = f"{run}/k{rank}-{index}"
            results = run_ranks(crash_model.killed_save, 2, root, rank, index, env=crash_model.ENV, allow_failures=True,
                                timeout_s=120)
            assert results[rank].exitcode == -9, results[rank]
            outcomes[(rank, index, rank_points[index])] = crash_model.check_consistent(root, results, rank, stray_objects)
    kinds = {k for rank_points in points for k, _ in rank_points}
    assert {"write", "fsync", "rename", "collective"} <= kinds, kinds
    assert "invisible" in outcomes.values() and "committed" in outcomes.values()


@pytest.mark.slow
def test_kill_a_rank_at_every_boundary_of_an_s3_save(bucket):
    from distckpt.testing import crash_model

    run = f"s3://{bucket}/kill-{uuid.uuid4().hex[:8]}"
    points, outcomes = crash_model.sweep(lambda name: f"{run}/{name}", 2, leftovers=stray_objects)
    kinds = {k for rank_points in points for k, _ in rank_points}
    assert {"write", "fsync", "rename", "collective"} <= kinds, kinds
    assert "invisible" in outcomes.values() and "committed" in outcomes.values()


@pytest.mark.parametrize("save_id", ["../../elsewhere", "a/b", "", "x" * 65])
def test_hostile_save_id_in_metadata_is_refused(client, bucket, save_id):
    import json

    from distckpt.format.checksum import crc32c

    cid = f"s3://{bucket}/hostile-{uuid.uuid4().hex[:8]}"
    prefix = cid.split("/", 3)[3]
    distckpt.save({"w": torch.ones(3)}, checkpoint_id=cid)
    raw = client.get_object(Bucket=bucket, Key=f"{prefix}/metadata.json")["Body"].read()
    body = json.loads(raw[: raw.rindex(b',"crc32c":')] + b"}")
    body["storage_data"]["$files"]["save_id"] = save_id
    text = json.dumps(body, separators=(",", ":")).encode()[:-1]
    client.put_object(Bucket=bucket, Key=f"{prefix}/metadata.json",
                      Body=text + b',"crc32c":"' + f"{crc32c(text):08x}".encode() + b'"}\n')
    with pytest.raises(CorruptCheckpointError, match="save id"):
        distckpt.load({"w": torch.zeros(3)}, checkpoint_id=cid)


def _client_in_child() -> bool:
    return s3_objects.client_for("http://127.0.0.1:9", "us-east-1") is not None


@pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="no fork here")
def test_a_process_forked_while_another_thread_makes_a_client_can_make_its_own():
    """The client cache's lock, held by a parent's thread at the fork, must not hang the child."""
    with s3_objects._CLIENTS_LOCK:  # as if another thread were creating a client right now
        assert run_in_fork(_client_in_child, timeout_s=60,
                           hang="the forked child hung on the client cache's lock its parent held") is True


@pytest.mark.slow  # guard that stays: crash/test_shared_root.py's twin on disk (the same lease rules)
def test_a_manager_opened_during_an_s3_save_leaves_the_save_alone(bucket, tmp_path):
    from ..crash.test_shared_root import manager_opened_during_a_save

    manager_opened_during_a_save(f"s3://{bucket}/shared-{uuid.uuid4().hex[:8]}", tmp_path)


def test_a_lease_renewed_after_its_release_does_not_come_back(bucket):
    from distckpt.backends.leases import Lease

    store = S3Store(bucket, f"lease-{uuid.uuid4().hex[:8]}")
    lease = Lease(store, "abc123")
    first = store.read_lease("abc123")
    assert first is not None
    lease.renew()  # while held: refreshed
    lease.release()
    assert store.read_lease("abc123") is None
    with pytest.raises(CheckpointNotFoundError):
        store.renew_lease("abc123")  # a renewal racing the release fails instead of writing the lease again
    assert store.read_lease("abc123") is None


@pytest.mark.parametrize("at", range(8, 16))
def test_a_deletion_cut_short_on_s3_is_cleaned_at_restart(bucket, at):
    # hypothesis found it: step 2 commits, retention deletes step 1 and is cut short; the restart must tidy up
    machine = S3ManagerMachine()
    try:
        machine.start(keep_last=None, keep_every=2)
        machine.save_ok()
        machine.save_crashes(at=at)
        machine.restart()  # asserts that nothing is left behind
    finally:
        machine.teardown()


def test_the_commit_records_its_save_on_the_metadata_object_and_cleanup_never_parses_the_document(client, bucket):
    cid = f"s3://{bucket}/tagged/ckpt"
    md = distckpt.save({"w": torch.ones(4)}, checkpoint_id=cid)
    save_id = md.storage_meta.save_id
    head = client.head_object(Bucket=bucket, Key="tagged/ckpt/metadata.json")
    assert head["Metadata"] == {"distckpt-save-id": save_id}
    store = S3Store(bucket, "tagged/ckpt")
    document = client.get_object(Bucket=bucket, Key="tagged/ckpt/metadata.json")["Body"].read()
    # a document no parser accepts: the store still knows which save is committed, and leaves its data alone
    client.put_object(Bucket=bucket, Key="tagged/ckpt/metadata.json", Body=b"not a metadata document",
                      Metadata={"distckpt-save-id": save_id})
    assert store._committed_save_id() == save_id and store.incomplete_saves() == []
    # committed by an earlier distckpt (no record on the object): the document's file table names the save
    client.put_object(Bucket=bucket, Key="tagged/ckpt/metadata.json", Body=document)
    assert store._committed_save_id() == save_id and store.incomplete_saves() == []
    distckpt.verify(cid)
