"""The Cluster kit cleans up after a test process that is killed: its namespaces, links, mounts (with the node
keepers that hold them) and job processes are gone within seconds, by its janitor; and when the janitor was killed
too, the next cluster removes what the dead run left before it starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

from distckpt.testing.cluster import Cluster
from distckpt.testing.cluster_cleanup import records_dir

_OWNER = textwrap.dedent("""
    import json, os, sys, time
    from distckpt.testing.cluster import Cluster
    cluster = Cluster(sys.argv[1], nodes=2, ranks_per_node=1, tmpfs_bytes=16 << 20)
    job = cluster.launch("tests.cluster.workers:sleep_forever")
    print(json.dumps({"tag": cluster.tag, "janitor": cluster._janitor.pid,
                      "keepers": [n.keeper.pid for n in cluster.nodes.values() if n.keeper is not None],
                      "jobs": [p.pid for p in job.procs.values()], "mode": cluster.mode}), flush=True)
    time.sleep(600)
""")


def _start_owner(root):
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, root], stdout=subprocess.PIPE, text=True, cwd=os.getcwd(),
                             start_new_session=True)
    made = json.loads(owner.stdout.readline())
    return owner, made


def _left(made) -> list[str]:
    """What of the cluster ``made`` still exists."""
    left = []
    tag = made["tag"]
    if made["mode"] == "netns":
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        left += [line.split()[0] for line in names.splitlines() if line.startswith(tag)]
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        left += [line.split(":")[1].strip().split("@")[0] for line in links.splitlines() if f" {tag}" in line]
    for pid in made["keepers"] + made["jobs"]:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] != "Z":
                    left.append(f"process {pid}")
        except OSError:
            pass
    if os.path.exists(os.path.join(records_dir(), f"{tag}.json")):
        left.append("its record")
    return left


def _wait_gone(made, timeout_s=30.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := _left(made)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_a_killed_test_process_leaves_nothing_behind(tmp_path):
    owner, made = _start_owner(str(tmp_path / "c"))
    try:
        assert _left(made), "the cluster was not running"
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        assert _wait_gone(made) == []
    finally:
        owner.kill()


def test_a_new_cluster_removes_what_a_killed_run_and_its_janitor_left(tmp_path):
    owner, made = _start_owner(str(tmp_path / "c"))
    try:
        os.kill(made["janitor"], signal.SIGKILL)
        time.sleep(0.5)
        # checked before the owner dies: once it is dead, a cluster that another test worker starts may sweep it first
        assert _left(made), "nothing was left to clean"
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        with Cluster(str(tmp_path / "next"), nodes=1, ranks_per_node=1, tmpfs_bytes=16 << 20) as cluster:
            assert _left(made) == []
            assert os.path.exists(os.path.join(records_dir(), f"{cluster.tag}.json"))
        assert not os.path.exists(os.path.join(records_dir(), f"{cluster.tag}.json"))
    finally:
        owner.kill()


def test_a_name_the_cluster_could_not_make_is_struck_from_its_record_and_a_malformed_record_is_skipped():
    import uuid

    import pytest

    from distckpt.testing.cluster_cleanup import Record, sweep_stale

    tag = f"t{uuid.uuid4().hex[:8]}"
    record = Record.create(tag)
    try:
        with pytest.raises(subprocess.CalledProcessError):
            record.made("links", f"{tag}x", sys.executable, "-c", "raise SystemExit(2)")  # as `ip link add` of a taken name
        assert json.load(open(record.path))["links"] == [] and record.data["links"] == []
        record.made("links", f"{tag}y", sys.executable, "-c", "pass")
        assert json.load(open(record.path))["links"] == [f"{tag}y"]
    finally:
        record.remove()
    forged = os.path.join(records_dir(), f"{tag}-forged.json")
    with open(forged, "w") as f:  # an owner of three fields, a process named by a string: not a record the kit wrote
        json.dump({"tag": tag, "owner": [1, "x", 3], "netns": [], "links": ["-lo"], "processes": [["1", None]]}, f)
    try:
        sweep_stale()  # skips it, and goes on with the others
        assert os.path.exists(forged)
        assert Record.read(forged) is None
    finally:
        os.unlink(forged)
