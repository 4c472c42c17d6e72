"""Incremental saves on a real S3-compatible server: the run model with crashes and restarts (the state machine of
tests/crash/test_incremental_machine.py), and a retired step's referenced objects kept until nothing references them."""

from __future__ import annotations

import uuid

import pytest
import torch
from hypothesis import settings

import distckpt

from ..crash.test_incremental_machine import IncrementalMachine, incremental_state, stray_keys
from .test_s3 import keys, pending_uploads

_RUN: dict = {}


@pytest.fixture(autouse=True, scope="module")
def _run_bucket(client, bucket):
    _RUN.update(client=client, bucket=bucket)


def stray_objects(root: str, mgr) -> list:
    """Objects under ``root`` that are neither a committed checkpoint's nor a retired step's that a kept step
    references (with its marker), and open uploads."""
    client, bucket = _RUN["client"], _RUN["bucket"]
    prefix = root.split("/", 3)[3]
    return stray_keys(keys(client, bucket, prefix), mgr) + [u["Key"] for u in pending_uploads(client, bucket, prefix)]


class S3IncrementalMachine(IncrementalMachine):
    def new_root(self):
        return f"s3://{_RUN['bucket']}/inc-{uuid.uuid4().hex[:10]}"

    def leftovers(self):
        return stray_objects(self.root, self.mgr)

    def remove_root(self):
        pass


# a larger sweep: tests/crash/test_incremental_machine.py runs the same machine on disk and memory in every run, and
# tests/storage/test_s3.py's manager machine the S3 store
TestS3IncrementalMachine = pytest.mark.slow(S3IncrementalMachine.TestCase)
TestS3IncrementalMachine.settings = settings(settings.get_profile("machines"), stateful_step_count=12, deadline=None)


def test_a_retired_steps_objects_stay_while_referenced_then_go(bucket):
    root = f"s3://{bucket}/inc-retire-{uuid.uuid4().hex[:8]}"
    mgr = distckpt.CheckpointManager(root, keep_last=1, incremental=True)
    for step in (1, 2, 3):
        mgr.save(step, incremental_state(step))
    assert mgr.all_steps() == [3]
    assert stray_objects(root, mgr) == []
    assert any(name.startswith("step-0000000001/") for name in distckpt.read_metadata(mgr.path(3)).storage_data.files)
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in incremental_state(3).items()}
    mgr.load(out, step=3)
    assert all(torch.equal(out[k], v) if isinstance(v, torch.Tensor) else out[k] == v for k, v in incremental_state(3).items())
    full = distckpt.CheckpointManager(root, keep_last=1)  # a manager that is not incremental: a full save, then retention
    full.save(4, incremental_state(4))
    assert full.all_steps() == [4]
    assert [k for k in keys(_RUN["client"], bucket, root.split("/", 3)[3]) if not k.startswith("step-0000000004/")] == []


def test_overwriting_a_referenced_step_on_s3_keeps_what_later_steps_reference(bucket):
    root = f"s3://{bucket}/inc-over-{uuid.uuid4().hex[:8]}"
    mgr = distckpt.CheckpointManager(root, incremental=True)
    mgr.save(1, incremental_state(1))
    mgr.save(2, incremental_state(2))
    replaced = {k: v + 1 if isinstance(v, torch.Tensor) else v for k, v in incremental_state(1).items()}
    distckpt.save(replaced, checkpoint_id=mgr.path(1), overwrite=True)
    for step, want in ((1, replaced), (2, incremental_state(2))):
        out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in want.items()}
        distckpt.load(out, checkpoint_id=mgr.path(step))
        assert all(torch.equal(out[k], v) if isinstance(v, torch.Tensor) else out[k] == v for k, v in want.items()), step
    assert stray_objects(root, mgr) == []


@pytest.mark.slow  # guard that stays: tests/security/test_run_lifecycle_hostile.py (disk and memory: the same ObjectStore)
def test_the_lifecycle_reads_documents_and_headers_as_parsed_on_s3(bucket):
    """tests/security/test_run_lifecycle_hostile.py's checks, on S3: an overwrite in an incremental run, retention after
    each way of writing a document again, and a referenced file whose header was written again."""
    from distckpt.testing import rewritten

    from ..security import test_run_lifecycle_hostile as lifecycle

    lifecycle.overwrite_a_step_of_an_incremental_run(f"s3://{bucket}/life-over-{uuid.uuid4().hex[:8]}")
    for name, rewrite in sorted(rewritten.REWRITES.items()):
        lifecycle.retention_after_a_rewrite(f"s3://{bucket}/life-{name}-{uuid.uuid4().hex[:8]}", rewrite)
    lifecycle.a_reserialised_header_is_still_its_save(f"s3://{bucket}/life-header-{uuid.uuid4().hex[:8]}")
