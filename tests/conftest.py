import os

import pytest
from hypothesis import settings

os.environ.setdefault("DISTCKPT_FSYNC", "0")  # tests check semantics, not durability; crash tests turn it back on


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False, help="run the larger sweeps marked slow")


def pytest_configure(config):
    """Hypothesis example counts, by profile (never per test): ``default`` for property tests, ``machines`` for the
    state machines, whose every example is a run of saves, crashes and restarts. ``--run-slow`` multiplies both."""
    slow = config.getoption("--run-slow")
    settings.register_profile("default", max_examples=400 if slow else 50, deadline=None)
    settings.register_profile("machines", max_examples=40 if slow else 6, deadline=None)
    settings.load_profile("default")
    import importlib.util

    if importlib.util.find_spec("lightning") is not None:
        from distckpt.testing import multiprocess

        # Lightning's rank jobs would each import it (3 s of CPU a rank); the fork server imports it once per worker
        multiprocess.preload("lightning")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="larger sweep: pass --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config):
    from distckpt.testing.cluster import cluster_mode

    mode = cluster_mode()
    how = "network namespaces, a private tmpfs per node" if mode == "netns" else "loopback, a folder per node (not root)"
    return f"simulated multi-node tests (tests/cluster): {mode} mode: {how}"


@pytest.fixture
def run_slow(request) -> bool:
    """Whether --run-slow was given: a sweep takes its chosen points by default and every point under it."""
    return request.config.getoption("--run-slow")
