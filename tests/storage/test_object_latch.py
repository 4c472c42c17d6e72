"""A CheckpointManager on gs:// or az:// keeps one store for its life: after an outage that exhausted a request's
attempts, the requests that follow at once are skipped (the failed operation's cleanup), but once the endpoint is
back, later operations work again: retention keeps its policy (the manager was disabled for good: steps piled up)."""

import time
import uuid

import pytest
import torch

import distckpt
from distckpt.testing.fault_proxy import FaultProxy, Rule


def test_manager_recovers_after_outage(gcs_endpoint, gcs_bucket, monkeypatch):
    monkeypatch.setenv("DISTCKPT_S3_READ_TIMEOUT_S", "1")
    monkeypatch.setenv("DISTCKPT_S3_CONNECT_TIMEOUT_S", "1")
    monkeypatch.setenv("DISTCKPT_S3_MAX_ATTEMPTS", "2")
    with FaultProxy(gcs_endpoint, timeout_s=30) as p:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", p.url)
        root = f"gs://{gcs_bucket}/{uuid.uuid4().hex[:8]}/run"
        m = distckpt.CheckpointManager(root, keep_last=1, no_dist=True)
        m.save(1, {"w": torch.ones(4)})
        assert m.all_steps() == [1]
        p.add(Rule("hang"))          # a short outage: the endpoint hangs for a while
        with pytest.raises(distckpt.CheckpointError):
            m.all_steps()
        p.clear()                            # the endpoint is back
        time.sleep(2.1)                      # past one request's bound
        m.save(2, {"w": torch.ones(4)})
        m.save(3, {"w": torch.ones(4)})
        assert m.all_steps() == [3]


@pytest.mark.slow  # the same latch as gs://'s (object_requests.Requests); one guard in the default run
def test_azure_manager_recovers_after_outage(azure_endpoint, azure_container, monkeypatch):
    from tests.storage.azurite_server import connection_string
    monkeypatch.setenv("DISTCKPT_S3_READ_TIMEOUT_S", "1")
    monkeypatch.setenv("DISTCKPT_S3_CONNECT_TIMEOUT_S", "1")
    monkeypatch.setenv("DISTCKPT_S3_MAX_ATTEMPTS", "2")
    with FaultProxy(azure_endpoint, timeout_s=30) as p:
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", connection_string(p.url))
        root = f"az://{azure_container}/{uuid.uuid4().hex[:8]}/run"
        m = distckpt.CheckpointManager(root, keep_last=1, no_dist=True)
        m.save(1, {"w": torch.ones(4)})
        p.add(Rule("hang"))
        with pytest.raises(distckpt.CheckpointError):
            m.all_steps()
        p.clear()
        time.sleep(2.1)
        m.save(2, {"w": torch.ones(4)})
        m.save(3, {"w": torch.ones(4)})
        assert m.all_steps() == [3]
