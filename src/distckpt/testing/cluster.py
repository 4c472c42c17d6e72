"""Simulated multi-node clusters on one machine, for tests and benchmarks of multi-node behaviour.

``Cluster(root, nodes=2, ranks_per_node=2)`` gives each node its own node-local directory and environment, and
runs jobs with torchrun's multi-node rendezvous (``--nnodes``, ``--node-rank``, one rendezvous endpoint on node
0; each node's agent forks its ranks once it has imported torch and distckpt: :mod:`.cluster_launch`). Where the
process runs as root and ``ip`` is there, each node is a network namespace of its own, joined to the others by a
bridge the cluster creates (its own IP address; gloo bound to its interface), with a private tmpfs as its
node-local directory that no other node can see: killing a node ends every process of it and the tmpfs with
them. That tmpfs is mounted ``huge=within_size`` unless ``huge_pages=False``: what docs/tiers.md advises for a
node's tier. Otherwise (``mode == "loopback"``) the nodes share loopback and their node-local directories are
plain folders, wiped by :meth:`kill_node`.

The function a job runs is named ``"module:function"``; it is called as ``fn(rank, world_size, **kwargs)`` on
every rank after the default (gloo) process group is up, and returns JSON (nothing is pickled between the
test and its ranks). Traffic stays on loopback or on the addresses of the namespaces the cluster made.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from typing import Any, Optional

from .cluster_cleanup import Record, descendants, sweep_stale
from .multiprocess import free_port

__all__ = ["Cluster", "Job", "NodeFailure", "cluster_mode"]


def cluster_mode() -> str:
    """``"netns"`` where nodes can be network namespaces (root, ``ip`` and ``nsenter`` present), else ``"loopback"``."""
    if os.environ.get("DISTCKPT_CLUSTER_MODE") in ("netns", "loopback"):
        return os.environ["DISTCKPT_CLUSTER_MODE"]
    ok = os.geteuid() == 0 and all(shutil.which(t) for t in ("ip", "nsenter", "unshare"))
    return "netns" if ok else "loopback"


class NodeFailure(AssertionError):
    """A job's ranks did not all report: ``results`` has what arrived, ``logs`` each node's output tail."""

    def __init__(self, message: str, results: dict[int, Any], logs: dict[int, str]) -> None:
        self.results, self.logs = results, logs
        tails = "\n".join(f"--- node {n} ---\n{t[-3000:]}" for n, t in sorted(logs.items()))
        super().__init__(f"{message}\n{tails}")


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=30)


class _Node:
    def __init__(self, cluster: "Cluster", index: int) -> None:
        self.cluster, self.index = cluster, index
        self.local = os.path.join(cluster.root, f"node-{index}", "local")
        self.keeper: Optional[subprocess.Popen] = None
        self.ns = f"{cluster.tag}-n{index}"
        self.ip = f"{cluster.subnet}.{10 + index}" if cluster.mode == "netns" else "127.0.0.1"
        self.ifname = f"{cluster.tag}n{index}" if cluster.mode == "netns" else "lo"

    def start(self) -> None:
        os.makedirs(self.local, exist_ok=True)
        if self.cluster.mode == "loopback":
            return
        host_if = f"{self.cluster.tag}h{self.index}"
        self.cluster.record.made("netns", self.ns, "ip", "netns", "add", self.ns)
        self.cluster.record.made("links", host_if, "ip", "link", "add", host_if, "type", "veth", "peer", "name", self.ifname)
        _run("ip", "link", "set", host_if, "master", self.cluster.bridge)
        _run("ip", "link", "set", host_if, "up")
        _run("ip", "link", "set", self.ifname, "netns", self.ns)
        _run("ip", "-n", self.ns, "addr", "add", f"{self.ip}/24", "dev", self.ifname)
        _run("ip", "-n", self.ns, "link", "set", self.ifname, "up")
        _run("ip", "-n", self.ns, "link", "set", "lo", "up")
        if self.cluster.link_mbit:  # the node's link: out of the node, and into it
            _shape(self.ifname, self.cluster.link_mbit, self.ns)
            _shape(host_if, self.cluster.link_mbit)
        # the keeper holds the node's mount namespace, and with it the private tmpfs, until the node is killed
        options = f"size={self.cluster.tmpfs_bytes},mode=0700" + (",huge=within_size" if self.cluster.huge_pages else "")
        script = (f"mount -t tmpfs -o {options} distckpt-node{self.index} {self.local} "
                  "&& echo ready && exec sleep 1000000")
        self.keeper = subprocess.Popen(["ip", "netns", "exec", self.ns, "unshare", "--mount", "--propagation", "private",
                                        "sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       start_new_session=True)
        self.cluster.record.add_process(self.keeper.pid)
        line = self.keeper.stdout.readline().decode().strip() if self.keeper.stdout else ""
        if line != "ready":
            raise RuntimeError(f"node {self.index}: could not mount its tmpfs: {self.keeper.stderr.read().decode()}")

    def command(self, argv: list[str]) -> list[str]:
        if self.cluster.mode == "loopback":
            return argv
        return ["nsenter", f"--target={self.keeper.pid}", "--mount", "--net", "--"] + argv

    def kill(self) -> None:
        if self.keeper is not None:
            try:
                os.killpg(self.keeper.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.keeper.wait(timeout=30)
            self.keeper = None
        if self.cluster.mode == "netns":
            subprocess.run(["ip", "netns", "del", self.ns], stderr=subprocess.DEVNULL, timeout=30)
            subprocess.run(["ip", "link", "del", f"{self.cluster.tag}h{self.index}"], stderr=subprocess.DEVNULL, timeout=30)
        else:
            shutil.rmtree(self.local, ignore_errors=True)


class Job:
    """One torchrun launch per node of a cluster, running one function on every rank."""

    def __init__(self, cluster: "Cluster", name: str, procs: dict[int, subprocess.Popen], results: str, logs: dict[int, str]):
        self.cluster, self.name, self.procs, self.results_dir, self.log_paths = cluster, name, procs, results, logs

    def results(self) -> dict[int, Any]:
        out = {}
        if os.path.isdir(self.results_dir):
            for name in os.listdir(self.results_dir):
                if name.startswith("rank-") and name.endswith(".json"):
                    with open(os.path.join(self.results_dir, name)) as f:
                        out[int(name[5:-5])] = json.load(f)
        return out

    def marks(self, name: str) -> set[int]:
        """The ranks that called ``distckpt.testing.cluster.mark(name)`` in this job."""
        prefix = f"mark-{name}-rank-"
        return {int(f[len(prefix):]) for f in os.listdir(self.results_dir) if f.startswith(prefix)}

    def wait_for_marks(self, name: str, ranks: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.marks(name)) < ranks:
            if time.monotonic() > deadline or all(p.poll() is not None for p in self.procs.values()):
                raise NodeFailure(f"job {self.name}: only ranks {sorted(self.marks(name))} reached {name!r}",
                                  self.results(), self.logs())
            time.sleep(0.05)

    def logs(self) -> dict[int, str]:
        out = {}
        for node, path in self.log_paths.items():
            with open(path, errors="replace") as f:
                out[node] = f.read()
        return out

    def stop(self, node: Optional[int] = None, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to every process of the job (on ``node`` only, if given): torchrun and its workers."""
        for n, p in self.procs.items():
            if node is None or n == node:
                # torchrun starts its workers with setsid, outside its process group: kill the whole tree, listed first
                for pid in [p.pid] + descendants(p.pid):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass

    def signal_workers(self, sig: int, node: Optional[int] = None) -> None:
        """Send ``sig`` to the training processes (not torchrun) of the job, as a scheduler's preemption does."""
        for n, p in self.procs.items():
            if node is not None and n != node:
                continue
            for pid in descendants(p.pid):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    def wait(self, timeout_s: float = 300) -> dict[int, Any]:
        """Wait for every node's torchrun to end; return each rank's result, or raise NodeFailure."""
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.stop()
                p.wait(timeout=30)
        results = self.results()
        if len(results) < self.cluster.world_size:
            raise NodeFailure(f"job {self.name}: ranks {sorted(set(range(self.cluster.world_size)) - set(results))} "
                              f"returned nothing (torchrun exit codes {[p.returncode for p in self.procs.values()]})",
                              results, self.logs())
        return results


class Cluster:
    """``nodes`` simulated nodes of ``ranks_per_node`` ranks each, under ``root`` (see the module text)."""

    def __init__(self, root: str, nodes: int = 2, ranks_per_node: int = 2, mode: Optional[str] = None,
                 tmpfs_bytes: int = 2 << 30, huge_pages: bool = True, link_mbit: Optional[int] = None) -> None:
        self.root = os.path.abspath(root)
        self.nodes_count, self.ranks_per_node = nodes, ranks_per_node
        self.world_size = nodes * ranks_per_node
        self.mode = mode or cluster_mode()
        self.tmpfs_bytes, self.huge_pages = tmpfs_bytes, huge_pages
        if link_mbit and self.mode != "netns":
            raise RuntimeError("link_mbit= shapes the nodes' links: it needs the netns mode (root, ip, tc)")
        self.link_mbit = link_mbit
        self._store: Optional[subprocess.Popen] = None
        self.tag = f"dk{uuid.uuid4().hex[:5]}"
        self.bridge = f"{self.tag}br"
        self.subnet = ""
        self._jobs = 0
        self.nodes: dict[int, _Node] = {}
        sweep_stale()  # what clusters of killed runs left behind
        # every namespace, link and process below is recorded before it is made; the janitor removes them if this
        # process is killed before close()
        self.record = Record.create(self.tag)
        self._janitor = self.record.start_janitor()
        if self.mode == "netns":
            self.subnet = _free_subnet()
            self.record.made("links", self.bridge, "ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
        try:
            for i in range(nodes):
                self.nodes[i] = _Node(self, i)
                self.nodes[i].start()
        except BaseException:
            self.close()
            raise
        print(f"distckpt cluster: {nodes} nodes x {ranks_per_node} ranks, mode {self.mode}"
              + (f" (network namespaces on {self.subnet}.0/24, private tmpfs per node"
                 f"{' of huge pages' if self.huge_pages else ''})" if self.mode == "netns" else
                 " (loopback, a folder per node)"), file=sys.stderr)

    @property
    def host_address(self) -> str:
        """The address every node reaches this (the test's) process at: the bridge's, or loopback."""
        return f"{self.subnet}.1" if self.mode == "netns" else "127.0.0.1"

    def node_local(self, node: int) -> str:
        """The node-local directory of ``node``, as that node's processes see it."""
        return self.nodes[node].local

    def kill_node(self, node: int, job: Optional[Job] = None) -> None:
        """SIGKILL every process of ``node`` (of ``job``, and the node itself) and wipe its node-local storage."""
        if job is not None:
            job.stop(node)
        self.nodes[node].kill()

    def replace_node(self, node: int) -> None:
        """Start a fresh node in place of ``node`` (empty node-local storage), to join the next job."""
        if node in self.nodes and (self.nodes[node].keeper is not None or self.mode == "loopback"):
            self.nodes[node].kill()
        self.nodes[node] = _Node(self, node)
        self.nodes[node].start()

    def launch(self, fn: str, env: Optional[dict[str, str]] = None, **kwargs: Any) -> Job:
        """Start ``fn`` (``"module:function"``) on every rank of every node; returns the running :class:`Job`."""
        self._jobs += 1
        name = f"job-{self._jobs}"
        results = os.path.join(self.root, "results", name)
        os.makedirs(results)
        port = free_port() if self.mode == "loopback" else random.randint(20000, 40000)
        master = self.nodes[0].ip
        procs, logs = {}, {}
        for i, node in self.nodes.items():
            argv = [sys.executable, "-m", "distckpt.testing.cluster_launch", f"--nnodes={self.nodes_count}",
                    f"--nproc-per-node={self.ranks_per_node}", f"--node-rank={i}", f"--master-addr={master}",
                    f"--master-port={port}", "--max-restarts=0", "--monitor-interval=0.2",
                    "--", fn, json.dumps(kwargs), results]
            node_env = {**os.environ, "DISTCKPT_TIER_DIR": node.local, "DISTCKPT_CLUSTER_NODE": str(i),
                        "DISTCKPT_CLUSTER_MODE_RUNNING": self.mode, "GLOO_SOCKET_IFNAME": node.ifname,
                        "PYTHONPATH": os.pathsep.join([os.getcwd()] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
                        "OMP_NUM_THREADS": "1", **(env or {})}
            logs[i] = os.path.join(results, f"node-{i}.log")
            with open(logs[i], "wb") as out:
                procs[i] = subprocess.Popen(node.command(argv), env=node_env, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)
            self.record.add_process(procs[i].pid)
        return Job(self, name, procs, results, logs)

    def run(self, fn: str, timeout_s: float = 300, env: Optional[dict[str, str]] = None, **kwargs: Any) -> dict[int, Any]:
        """Run ``fn`` on every rank to the end; each rank's result."""
        return self.launch(fn, env=env, **kwargs).wait(timeout_s)

    def start_store(self, rate_mbit: Optional[int] = None) -> str:
        """Start an S3-compatible server (moto's) in a network namespace of its own, joined to the bridge by one
        link that every node shares, shaped to ``rate_mbit`` each way (a cluster's shared durable store); return its
        endpoint. netns mode only; the server stops with the cluster."""
        if self.mode != "netns":
            raise RuntimeError("start_store needs the netns mode (root, ip, tc)")
        ns, host_if, inner = f"{self.tag}-s3", f"{self.tag}hs", f"{self.tag}s"
        ip = f"{self.subnet}.9"
        self.record.made("netns", ns, "ip", "netns", "add", ns)
        self.record.made("links", host_if, "ip", "link", "add", host_if, "type", "veth", "peer", "name", inner)
        _run("ip", "link", "set", host_if, "master", self.bridge)
        _run("ip", "link", "set", host_if, "up")
        _run("ip", "link", "set", inner, "netns", ns)
        _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", inner)
        _run("ip", "-n", ns, "link", "set", inner, "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        if rate_mbit:
            _shape(inner, rate_mbit, ns)
            _shape(host_if, rate_mbit)
        script = ("import logging, sys, time\n"
                  "from moto.server import ThreadedMotoServer\n"
                  "logging.getLogger('werkzeug').setLevel(logging.ERROR)\n"
                  f"s = ThreadedMotoServer(ip_address='{ip}', port=9000, verbose=False)\n"
                  "s.start()\nprint('ready', flush=True)\nwhile True: time.sleep(3600)\n")
        self._store = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", script], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, start_new_session=True)
        self.record.add_process(self._store.pid)
        line = self._store.stdout.readline().decode().strip() if self._store.stdout else ""
        if line != "ready":
            raise RuntimeError(f"the store did not start: {self._store.stderr.read().decode()[-2000:]}")
        return f"http://{ip}:9000"

    def close(self) -> None:
        if self._store is not None:
            try:
                os.killpg(self._store.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._store.wait(timeout=30)
            self._store = None
            subprocess.run(["ip", "netns", "del", f"{self.tag}-s3"], stderr=subprocess.DEVNULL, timeout=30)
            subprocess.run(["ip", "link", "del", f"{self.tag}hs"], stderr=subprocess.DEVNULL, timeout=30)
        for node in self.nodes.values():
            node.kill()
        if self.mode == "netns" and self.subnet:
            subprocess.run(["ip", "link", "del", self.bridge], stderr=subprocess.DEVNULL, timeout=30)
        self.record.clean()  # what is left: the processes of jobs never waited for; then the record, which ends the janitor
        try:
            self._janitor.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._janitor.kill()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _shape(ifname: str, rate_mbit: int, ns: Optional[str] = None) -> None:
    """Limit what leaves ``ifname`` (in namespace ``ns``) to ``rate_mbit``: a token bucket with 20 ms of burst."""
    burst = max(64 << 10, rate_mbit * 1_000_000 // 8 // 50)
    cmd = ["tc", "qdisc", "replace", "dev", ifname, "root", "tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst),
           "latency", "100ms"]
    _run(*(["ip", "netns", "exec", ns] + cmd if ns else cmd))


def _free_subnet() -> str:
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, timeout=30).stdout
    for _ in range(100):
        subnet = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}"
        if f" {subnet}." not in used:
            return subnet
    raise RuntimeError("no free 10.x.y.0/24 subnet for the cluster's bridge")


def mark(name: str) -> None:
    """From inside a job's rank: note that this rank reached ``name`` (see :meth:`Job.wait_for_marks`)."""
    path = os.path.join(os.environ["DISTCKPT_CLUSTER_RESULTS"], f"mark-{name}-rank-{os.environ['RANK']}")
    open(path, "w").close()
