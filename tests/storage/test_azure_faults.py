"""The az:// store under faults injected between client and Azurite (distckpt.testing.fault_proxy): one test per class
of failure (a hung endpoint, 503s, a body cut short, a lost answer to the commit)."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

import distckpt
from distckpt import StorageIOError
from distckpt.testing.fault_proxy import FaultProxy, Rule
from distckpt.testing.states import blank_like, seeded

from .azurite_server import connection_string


@pytest.fixture
def proxy(azure_endpoint, monkeypatch):
    """The Azure environment pointed at a fault proxy in front of Azurite."""
    with FaultProxy(azure_endpoint, timeout_s=30) as p:
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", connection_string(p.url))
        yield p


def _cid(container, name):
    return f"az://{container}/{uuid.uuid4().hex[:8]}/{name}"


def _state(n=3 << 20):
    return seeded({"big": torch.arange(n, dtype=torch.float32)}, values={"step": 7})


def _load(cid):
    out = blank_like(_state())
    distckpt.load(out, checkpoint_id=cid)
    return out


def test_a_hung_endpoint_fails_a_save_within_the_request_bounds(azure_container, proxy, monkeypatch):
    """Every request hangs: the save fails typed after about attempts x read timeout, and its cleanup does not wait
    on the endpoint again."""
    monkeypatch.setenv("DISTCKPT_S3_READ_TIMEOUT_S", "1")
    monkeypatch.setenv("DISTCKPT_S3_CONNECT_TIMEOUT_S", "1")
    monkeypatch.setenv("DISTCKPT_S3_MAX_ATTEMPTS", "2")
    distckpt.save({"w": torch.ones(4)}, checkpoint_id=_cid(azure_container, "hung"))  # the endpoint works, then hangs
    proxy.add(Rule("hang"))
    t0 = time.monotonic()
    with pytest.raises(distckpt.CheckpointError) as info:
        distckpt.save(_state(), checkpoint_id=_cid(azure_container, "hung2"))
    took = time.monotonic() - t0
    assert isinstance(info.value, StorageIOError) or isinstance(info.value.__cause__, StorageIOError), info.value
    assert "did not answer" in str(info.value) and "az://" in str(info.value), info.value
    assert took < 10, took
    assert proxy.hits("hang") <= 4, proxy.log


def test_503s_are_retried_and_a_lasting_503_fails_typed(azure_container, proxy, monkeypatch):
    rule = proxy.add(Rule("status", status=503, method="PUT", times=2))
    cid = _cid(azure_container, "throttled")
    got: list = []
    with distckpt.observe(got.append):
        distckpt.save(_state(), checkpoint_id=cid)
    assert rule.fired == 2
    assert next(e for e in got if e.operation == "save" and e.phase == "total").retries == 2  # in the save's events
    assert torch.equal(_load(cid)["big"], _state()["big"])
    monkeypatch.setenv("DISTCKPT_S3_MAX_ATTEMPTS", "2")
    proxy.add(Rule("status", status=503, method="PUT"))
    with pytest.raises(distckpt.CheckpointError, match="503") as info:
        distckpt.save(_state(), checkpoint_id=_cid(azure_container, "unavailable"))
    assert "az://" in str(info.value)


def test_a_ranged_read_cut_short_is_tried_again(azure_container, proxy, monkeypatch):
    cid = _cid(azure_container, "reset")
    distckpt.save(_state(), checkpoint_id=cid)
    monkeypatch.setenv("DISTCKPT_S3_READ_PIECE_BYTES", str(1 << 20))
    rule = proxy.add(Rule("reset_body", method="GET", header="x-ms-range", path=r"data-", times=2))
    assert torch.equal(_load(cid)["big"], _state()["big"])
    assert rule.fired == 2


def test_a_lost_answer_to_the_conditional_puts_is_recognised_as_ours(azure_container, proxy):
    """The lease's and the commit's Put Blob (If-None-Match: *) land, their answers are lost, each retry gets 409: the
    lease and the commit are this save's, and the run goes on."""
    rule = proxy.add(Rule("drop_response", method="PUT", header="If-None-Match", times=2))
    root = f"az://{azure_container}/{uuid.uuid4().hex[:8]}"
    manager = distckpt.CheckpointManager(root, keep_last=1)
    manager.save(1, _state())
    assert rule.fired == 2
    manager.save(2, _state())
    assert manager.all_steps() == [2]
    out = {"big": torch.zeros(3 << 20), "step": 0}
    assert manager.load(out) == 2 and torch.equal(out["big"], _state()["big"])


def test_a_service_the_user_gave_is_bounded_by_the_knobs_too(azure_endpoint, azure_container, monkeypatch):
    """A BlobServiceClient made as users make one (the SDK's own timeouts and retries) still gives up on a hung
    endpoint within the knobs' timeouts and attempts: every request carries its bounds."""
    import threading

    from azure.storage.blob import BlobServiceClient

    from distckpt.backends.azure import AzureWriter

    monkeypatch.setenv("DISTCKPT_S3_READ_TIMEOUT_S", "1")
    monkeypatch.setenv("DISTCKPT_S3_CONNECT_TIMEOUT_S", "1")
    monkeypatch.setenv("DISTCKPT_S3_MAX_ATTEMPTS", "2")
    with FaultProxy(azure_endpoint, timeout_s=300) as proxy:
        service = BlobServiceClient.from_connection_string(connection_string(proxy.url))
        cid = f"az://{azure_container}/{uuid.uuid4().hex[:8]}/step-1"
        proxy.add(Rule("hang"))
        done: dict = {}

        def save():
            began = time.monotonic()
            try:
                distckpt.save({"w": torch.ones(4)}, storage_writer=AzureWriter(cid, service=service), no_dist=True)
            except Exception as exc:  # noqa: BLE001 - looked at below
                done["exc"] = exc
            done["took"] = time.monotonic() - began

        thread = threading.Thread(target=save, daemon=True)
        thread.start()
        thread.join(30)
        assert "took" in done and done["took"] < 15, done
        assert isinstance(done.get("exc"), distckpt.CheckpointError), done
