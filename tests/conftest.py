import os

import pytest

os.environ.setdefault("DISTCKPT_FSYNC", "0")  # tests check semantics, not durability; crash tests turn it back on


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False, help="run the larger sweeps marked slow")


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
