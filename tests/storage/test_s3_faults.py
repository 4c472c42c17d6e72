"""The S3 backend under faults injected between client and server (distckpt.testing.fault_proxy)."""

from __future__ import annotations

import os
import time
import uuid

import pytest
import torch

import distckpt
from distckpt import StorageIOError
from distckpt.backends import S3Reader, S3Writer, s3_objects
from distckpt.backends.leases import Lease, simulate_process_death
from distckpt.backends.s3 import S3Store
from distckpt.testing.fault_proxy import FaultProxy, Rule
from distckpt.testing.states import blank_like, seeded


@pytest.fixture
def proxy(endpoint, monkeypatch):
    """The AWS environment pointed at a fault proxy in front of the server."""
    with FaultProxy(endpoint, timeout_s=30) as p:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", p.url)
        yield p


def _cid(bucket, name):
    return f"s3://{bucket}/{uuid.uuid4().hex[:8]}/{name}"


def _state(n=3 << 20):
    return seeded({"big": torch.arange(n, dtype=torch.float32)}, values={"step": 7})


def _load(cid):
    out = blank_like(_state())
    distckpt.load(out, checkpoint_id=cid)
    return out


def test_a_hung_endpoint_fails_a_save_within_the_request_bounds(bucket, proxy, monkeypatch):
    """Every request hangs: the save fails typed after about attempts x read timeout, not 6 x 60 s per request,
    and its cleanup does not wait on the endpoint again."""
    monkeypatch.setenv("DISTCKPT_S3_READ_TIMEOUT_S", "1")
    monkeypatch.setenv("DISTCKPT_S3_CONNECT_TIMEOUT_S", "1")
    monkeypatch.setenv("DISTCKPT_S3_MAX_ATTEMPTS", "2")
    cid = _cid(bucket, "hung")
    distckpt.save({"w": torch.ones(4)}, checkpoint_id=cid)  # the endpoint works, then hangs
    proxy.add(Rule("hang"))
    t0 = time.monotonic()
    with pytest.raises(distckpt.CheckpointError) as info:
        distckpt.save(_state(), checkpoint_id=_cid(bucket, "hung2"))
    took = time.monotonic() - t0
    assert isinstance(info.value, StorageIOError) or isinstance(info.value.__cause__, StorageIOError), info.value
    assert "endpoint" in str(info.value) or "timed out" in str(info.value).lower(), info.value
    assert took < 10, took
    assert proxy.hits("hang") <= 2, proxy.log


def test_a_hung_commit_fails_within_bounds_and_skips_the_cleanup_requests(bucket, proxy, monkeypatch):
    monkeypatch.setenv("DISTCKPT_S3_READ_TIMEOUT_S", "1")
    monkeypatch.setenv("DISTCKPT_S3_MAX_ATTEMPTS", "2")
    proxy.add(Rule("hang", method="POST", query=r"uploadId="))  # CompleteMultipartUpload
    t0 = time.monotonic()
    with pytest.raises(distckpt.CheckpointError):
        distckpt.save(_state(6 << 20), checkpoint_id=_cid(bucket, "hung-commit"))
    assert time.monotonic() - t0 < 10
    assert proxy.hits("hang") == 2


def test_the_total_deadline_stops_a_slow_save_and_a_slow_load(bucket, proxy, monkeypatch):
    cid = _cid(bucket, "slow")
    distckpt.save(_state(), checkpoint_id=cid)
    monkeypatch.setenv("DISTCKPT_S3_DEADLINE_S", "2")
    proxy.add(Rule("delay", delay_s=0.7))
    t0 = time.monotonic()
    with pytest.raises(distckpt.CheckpointError, match="DISTCKPT_S3_DEADLINE_S"):
        distckpt.save(_state(), checkpoint_id=_cid(bucket, "slow2"))
    assert time.monotonic() - t0 < 8
    with pytest.raises(distckpt.CheckpointError, match="DISTCKPT_S3_DEADLINE_S"):
        distckpt.load({"big": torch.zeros(3 << 20), "step": 0}, checkpoint_id=cid,
                      storage_reader=S3Reader(thread_count=1))
    proxy.clear()
    monkeypatch.delenv("DISTCKPT_S3_DEADLINE_S")
    assert torch.equal(_load(cid)["big"], _state()["big"])


def test_aws_max_attempts_and_the_knobs_reach_the_client(monkeypatch, endpoint):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "7")
    monkeypatch.setenv("DISTCKPT_S3_READ_TIMEOUT_S", "13")
    config = s3_objects.client_for(None, None).meta.config
    assert config.retries["total_max_attempts"] == 7 and config.read_timeout == 13
    monkeypatch.setenv("DISTCKPT_S3_MAX_ATTEMPTS", "2")
    assert s3_objects.client_for(None, None).meta.config.retries["total_max_attempts"] == 2
    monkeypatch.delenv("AWS_MAX_ATTEMPTS")
    monkeypatch.delenv("DISTCKPT_S3_MAX_ATTEMPTS")
    defaults = s3_objects.client_for(None, None).meta.config
    monkeypatch.delenv("DISTCKPT_S3_READ_TIMEOUT_S")
    defaults = s3_objects.client_for(None, None).meta.config
    # a hung endpoint fails one request within attempts x the longer timeout: about a minute by default
    assert defaults.retries["total_max_attempts"] * max(defaults.read_timeout, defaults.connect_timeout) <= 60


def test_a_changed_endpoint_in_the_environment_reaches_new_saves(bucket, endpoint, monkeypatch):
    with FaultProxy(endpoint) as first, FaultProxy(endpoint) as second:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", first.url)
        distckpt.save({"w": torch.ones(2)}, checkpoint_id=_cid(bucket, "a"))
        seen = first.hits()
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", second.url)
        distckpt.save({"w": torch.ones(2)}, checkpoint_id=_cid(bucket, "b"))
        assert seen > 0 and second.hits() > 0 and first.hits() == seen


def test_a_lost_answer_to_the_commit_put_is_recognised_as_our_commit(bucket, proxy, client):
    """The conditional metadata PUT lands, its answer is lost, the retry gets 412: the save is ours and stands."""
    rule = proxy.add(Rule("drop_response", method="PUT", path=r"/metadata\.json$", header="If-None-Match", times=1))
    root = f"s3://{bucket}/{uuid.uuid4().hex[:8]}"
    manager = distckpt.CheckpointManager(root, keep_last=1)
    manager.save(1, _state())
    assert rule.fired == 1
    manager.save(2, _state())  # retention ran after the first save's commit: nothing blocks the next
    assert manager.all_steps() == [2]
    prefix = root[len("s3://") + len(bucket) + 1:]
    left = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])
            if o["Key"].endswith("metadata.json") and "/saves/" in o["Key"]]
    assert not left, left
    out = {"big": torch.zeros(3 << 20), "step": 0}
    assert manager.load(out) == 2 and torch.equal(out["big"], _state()["big"])


def test_a_lost_answer_to_the_lease_put_is_recognised_as_our_lease(bucket, proxy):
    """The conditional PUT of a save's lease lands, its answer is lost, the retry gets 412: the lease is ours (its
    record is this process's), and the save goes on (a loaded endpoint answering after the read timeout does this)."""
    rule = proxy.add(Rule("drop_response", method="PUT", path=r"/leases/", header="If-None-Match", times=1))
    cid = _cid(bucket, "lease-lost")
    distckpt.save(_state(), checkpoint_id=cid)
    assert rule.fired == 1
    assert torch.equal(_load(cid)["big"], _state()["big"])


def test_a_ranged_get_cut_short_is_resumed(bucket, proxy, monkeypatch):
    cid = _cid(bucket, "reset")
    distckpt.save(_state(), checkpoint_id=cid)
    monkeypatch.setenv("DISTCKPT_S3_READ_PIECE_BYTES", str(1 << 20))
    rule = proxy.add(Rule("reset_body", method="GET", header="Range", path=r"data-", times=2))
    assert torch.equal(_load(cid)["big"], _state()["big"])
    assert rule.fired == 2


def test_a_ranged_get_cut_short_every_time_fails_typed(bucket, proxy, monkeypatch):
    cid = _cid(bucket, "reset-always")
    distckpt.save(_state(), checkpoint_id=cid)
    monkeypatch.setenv("DISTCKPT_S3_MAX_ATTEMPTS", "2")
    proxy.add(Rule("reset_body", method="GET", header="Range", path=r"data-"))
    with pytest.raises(StorageIOError, match="reading"):
        _load(cid)


def _orphan_upload(client, bucket, prefix, save_id, lease: bool):
    store = S3Store(bucket, prefix)
    key = f"{prefix}/saves/{save_id}/data-00000.safetensors"
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"x" * 1024)
    if lease:
        Lease(store, save_id)
        simulate_process_death()  # the saving process is gone; its lease stays, never renewed
    return key


def test_orphaned_multipart_uploads_of_dead_saves_are_aborted_at_start(bucket, client, monkeypatch):
    """A save killed before any of its objects completed leaves only open uploads: the manager's start-up
    cleanup and `distckpt steps --clean` find them, and abort those of dead saves only."""
    root_prefix = uuid.uuid4().hex[:8]
    root = f"s3://{bucket}/{root_prefix}"
    manager = distckpt.CheckpointManager(root)
    manager.save(1, {"w": torch.ones(2)})
    dead = _orphan_upload(client, bucket, f"{root_prefix}/step-0000000002", "a" * 32, lease=True)
    live_store = S3Store(bucket, f"{root_prefix}/step-0000000003")
    live_key = f"{root_prefix}/step-0000000003/saves/{'b' * 32}/data-00000.safetensors"
    live_lease = Lease(live_store, "b" * 32)  # a save in flight in this process
    client.create_multipart_upload(Bucket=bucket, Key=live_key)
    _orphan_upload(client, bucket, f"{root_prefix}/step-0000000004", "c" * 32, lease=False)
    try:
        distckpt.CheckpointManager(root)  # start-up cleanup
        open_keys = {u["Key"] for u in client.list_multipart_uploads(Bucket=bucket, Prefix=root_prefix + "/").get("Uploads", [])}
        # (moto dates every upload in 2010, so the upload without a lease may already count as stale here)
        assert dead not in open_keys and live_key in open_keys, open_keys
        monkeypatch.setenv("DISTCKPT_LEASE_STALE_S", "1")
        time.sleep(2.1)
        from click.testing import CliRunner

        from distckpt.cli import main as cli

        result = CliRunner().invoke(cli, ["steps", root, "--clean"])
        assert result.exit_code == 0, result.output
        open_keys = {u["Key"] for u in client.list_multipart_uploads(Bucket=bucket, Prefix=root_prefix + "/").get("Uploads", [])}
        assert open_keys == {live_key}, open_keys
    finally:
        live_lease.release()
    assert distckpt.CheckpointManager(root).all_steps() == [1]


def test_the_manager_takes_storage_options(bucket, endpoint, monkeypatch):
    """A CheckpointManager on s3:// given a client: every request, listing and retention included, uses it."""
    import boto3

    with FaultProxy(endpoint) as p:
        given = boto3.client("s3", endpoint_url=p.url, region_name="us-east-1")
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")  # nothing listens there
        root = f"s3://{bucket}/{uuid.uuid4().hex[:8]}"
        manager = distckpt.CheckpointManager(root, keep_last=1, storage_options={"client": given, "part_size": 5 << 20})
        manager.save(1, _state())
        manager.save(2, _state())
        assert manager.all_steps() == [2]
        out = {"big": torch.zeros(3 << 20), "step": 0}
        assert manager.load(out) == 2 and torch.equal(out["big"], _state()["big"])
        assert p.hits() > 0
    with pytest.raises(distckpt.CheckpointError, match="not taken"):
        distckpt.CheckpointManager(root, storage_options={"no_such_option": 1})


def test_async_save_to_a_hung_endpoint_fails_on_the_handle_within_bounds(bucket, proxy, monkeypatch):
    monkeypatch.setenv("DISTCKPT_S3_READ_TIMEOUT_S", "1")
    monkeypatch.setenv("DISTCKPT_S3_MAX_ATTEMPTS", "2")
    proxy.add(Rule("hang", method="PUT", times=100))
    t0 = time.monotonic()
    handle = distckpt.async_save(_state(), checkpoint_id=_cid(bucket, "async-hung"))
    assert time.monotonic() - t0 < 2
    with pytest.raises(distckpt.CheckpointError):
        handle.result(timeout=30)
    assert time.monotonic() - t0 < 15
    proxy.clear()
    cid = _cid(bucket, "async-after")
    distckpt.async_save(_state(), checkpoint_id=cid).result(timeout=30)
    assert torch.equal(_load(cid)["big"], _state()["big"])


def test_the_writer_and_reader_keep_their_given_client(bucket, endpoint, proxy):
    import boto3

    given = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    cid = _cid(bucket, "given")
    distckpt.save(_state(), storage_writer=S3Writer(cid, client=given))
    out = {"big": torch.zeros(3 << 20), "step": 0}
    distckpt.load(out, storage_reader=S3Reader(cid, client=given))
    assert proxy.hits() == 0
    assert os.environ["AWS_ENDPOINT_URL_S3"] == proxy.url


def test_retries_botocore_made_are_counted_in_the_save_s_events(bucket, proxy):
    """Two 503s answered to PUTs: botocore retries them on its own, and the save's events count both."""
    proxy.add(Rule("status", status=503, method="PUT", times=2))
    got: list = []
    with distckpt.observe(got.append):
        distckpt.save(_state(1 << 16), checkpoint_id=_cid(bucket, "retried"))
    total = next(e for e in got if e.operation == "save" and e.phase == "total")
    assert total.retries == 2 and total.error is None, total
