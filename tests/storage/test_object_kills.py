"""Real SIGKILLs at the boundaries of a 2-rank save and of the retention after it, on gs:// and az:// (the sweep of
tests/crash, as tests/storage/test_s3.py runs it on S3): every step left committed loads bit-exact and verifies,
nothing half-committed is listed, and a restarted manager leaves nothing but its committed steps' objects."""

from __future__ import annotations

import uuid

import pytest

import distckpt
from distckpt import backends
from distckpt.testing import crash_model, run_ranks


def stray_objects(root: str, mgr) -> list:
    """Objects under the run ``root`` that are not part of a committed checkpoint, and uploads left open."""
    store = backends.store_for(root)
    prefix = store.prefix + "/"
    live = {f"step-{s:010d}": distckpt.read_metadata(mgr.path(s)).storage_meta.save_id for s in mgr.all_steps()}
    stray = []
    for info in store.objects.list(prefix):
        step, _, rest = info.key[len(prefix):].partition("/")
        if step not in live or not (rest == "metadata.json" or rest.startswith(f"saves/{live[step]}/")):
            stray.append(info.key)
    uploads = store.objects.uploads(prefix)
    return stray + [u.key for u in uploads]


@pytest.fixture(params=["gs", "az"])
def run_root(request):
    if request.param == "gs":
        bucket = request.getfixturevalue("gcs_bucket")
        return f"gs://{bucket}/kill-{uuid.uuid4().hex[:8]}"
    container = request.getfixturevalue("azure_container")
    return f"az://{container}/kill-{uuid.uuid4().hex[:8]}"


@pytest.mark.slow  # the guard in the default run: tests/storage/test_s3.py's machine and tests/crash, on the same lifecycle
def test_kill_a_rank_at_chosen_boundaries_of_a_save_and_its_retention(run_root):
    """The first boundary of each kind on each object of each rank, each rank's last, and the commit's."""
    points = run_ranks(crash_model.record_points, 2, f"{run_root}/record", env=crash_model.ENV)
    outcomes = {}
    for rank, rank_points in enumerate(points):
        firsts = {point: i for i, point in reversed(list(enumerate(rank_points)))}
        chosen = set(firsts.values()) | {len(rank_points) - 1}
        chosen |= {j for i, (kind, _) in enumerate(rank_points) if kind == "rename" for j in (i, i + 1) if j < len(rank_points)}
        for index in sorted(chosen):
            root = f"{run_root}/k{rank}-{index}"
            results = run_ranks(crash_model.killed_save, 2, root, rank, index, env=crash_model.ENV, allow_failures=True,
                                timeout_s=120)
            assert results[rank].exitcode == -9, results[rank]
            outcomes[(rank, index, rank_points[index])] = crash_model.check_consistent(root, results, rank, stray_objects)
    assert "invisible" in outcomes.values() and "committed" in outcomes.values(), outcomes
