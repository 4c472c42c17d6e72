import os
import subprocess

import pytest


def _mount(path, options):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip(f"cannot mount a tmpfs with {options} here")
    return str(path)


@pytest.fixture
def huge_tmpfs(tmp_path):
    """A tmpfs of huge pages (what docs/tiers.md advises for a node's tier), removed after the test."""
    path = _mount(tmp_path / "huge tier", "size=256m,huge=within_size")
    yield path
    subprocess.run(["umount", path], check=False)


@pytest.fixture
def small_page_tmpfs(tmp_path):
    path = _mount(tmp_path / "plain", "size=64m,huge=never")
    yield path
    subprocess.run(["umount", path], check=False)
