"""What a :class:`~distckpt.testing.cluster.Cluster` made, recorded so that it is removed even when the process that
made it is killed.

Every cluster keeps a record (``/run/distckpt-cluster/<tag>.json`` as root, else under the temporary directory):
the process that owns it (pid and start time, so a reused pid is not mistaken for it), its network namespaces,
its links and the processes it started. A janitor process (``python -m distckpt.testing.cluster_cleanup RECORD``,
in a session of its own) watches the owner, and when the owner is gone without closing the cluster, kills the
recorded processes (and every process still inside the namespaces: the node keepers, whose private tmpfs mounts
go with them), deletes the namespaces and the links, and removes the record. A new cluster also sweeps the records
of owners that are gone, for a janitor that was itself killed. Only what a record names is touched, and a record
is only ever written by the cluster that made those things: nothing else on the machine is removed.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Optional

__all__ = ["Record", "sweep_stale", "records_dir", "descendants"]

_POLL_S = 0.5


def records_dir() -> str:
    """The directory of the records: one owned by this user, not writable by others, reached without links."""
    base = "/run" if os.geteuid() == 0 and os.path.isdir("/run") else tempfile.gettempdir()
    path = os.path.join(base, f"distckpt-cluster-{os.geteuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise RuntimeError(f"{path}: not a directory of this user's that only it can write; remove it and run again")
    return path


def start_time(pid: int) -> Optional[str]:
    """The start time of process ``pid`` (clock ticks since boot), or None when no such process runs."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


def alive(pid: int, started: Optional[str]) -> bool:
    return started is not None and start_time(pid) == started


class Record:
    """The record of one cluster's things; every change is written at once (atomically), before the thing exists."""

    def __init__(self, path: str, data: dict) -> None:
        self.path, self.data = path, data

    @classmethod
    def create(cls, tag: str) -> "Record":
        pid = os.getpid()
        record = cls(os.path.join(records_dir(), f"{tag}.json"),
                     {"tag": tag, "owner": [pid, start_time(pid)], "netns": [], "links": [], "processes": []})
        record._write()
        return record

    @classmethod
    def read(cls, path: str) -> Optional["Record"]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        with os.fdopen(fd) as f:
            try:
                data = json.load(f)
            except ValueError:
                return None
        if not _well_formed(data):
            return None  # not a record this module wrote: nothing it names is removed
        return cls(path, data)

    def add(self, kind: str, item) -> None:
        self.data[kind].append(item)
        self._write()

    def made(self, kind: str, item: str, *cmd: str) -> None:
        """Record ``item`` (a namespace or link), then make it by running ``cmd``; where that fails (the name was taken
        by someone else's, for one), it is not this cluster's: struck from the record before the error goes on."""
        self.add(kind, item)
        try:
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=30)
        except BaseException:
            self.data[kind].remove(item)
            self._write()
            raise

    def add_process(self, pid: int) -> None:
        self.add("processes", [pid, start_time(pid)])

    def _write(self) -> None:
        tmp = f"{self.path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"  # never one a killed writer left
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self.data, f)
        os.replace(tmp, self.path)

    def owner_alive(self) -> bool:
        pid, started = self.data["owner"]
        return alive(pid, started)

    def clean(self) -> None:
        """Remove everything recorded: processes first (a namespace's mounts go with its last process), then the
        namespaces and links, then the record."""
        for pid, started in self.data["processes"]:
            if alive(pid, started):
                _kill(pid)
        for ns in self.data["netns"]:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout.split()
            for pid in pids:
                _kill(int(pid))
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        for link in self.data["links"]:
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=30)
        self.remove()

    def remove(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def start_janitor(self) -> subprocess.Popen:
        """The process that cleans up after this one if it is killed (it ends once the record is removed)."""
        return subprocess.Popen([sys.executable, "-m", "distckpt.testing.cluster_cleanup", self.path], start_new_session=True,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def descendants(pid: int) -> list[int]:
    """The processes under ``pid``, children before their own children."""
    out = []
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(x) for x in f.read().split()]
    except OSError:
        return out
    for kid in kids:
        out += [kid] + descendants(kid)
    return out


def _kill(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants, listed first (torchrun starts its workers in sessions of their own)."""
    for each in [pid] + descendants(pid):
        try:
            os.kill(each, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _well_formed(data: object) -> bool:
    """Whether ``data`` has the shape :class:`Record` writes: an owner [pid, start], names, [pid, start] pairs."""
    if not isinstance(data, dict):
        return False
    pairs = [data.get("owner")] + list(data.get("processes") or [])
    names = list(data.get("netns") or []) + list(data.get("links") or [])
    return (all(isinstance(data.get(k), list) for k in ("owner", "netns", "links", "processes"))
            and all(isinstance(p, list) and len(p) == 2 and type(p[0]) is int and p[0] > 0
                    and (p[1] is None or isinstance(p[1], str)) for p in pairs)
            and all(isinstance(n, str) and n and not n.startswith("-") for n in names))


def sweep_stale() -> list[str]:
    """Clean up after every cluster whose owner is gone (a killed test run); the tags cleaned. A record that cannot be
    cleaned is left for the next sweep, and the others are cleaned all the same."""
    cleaned = []
    directory = records_dir()
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".json"):
            continue
        record = Record.read(os.path.join(directory, name))
        if record is not None and not record.owner_alive():
            try:
                record.clean()
            except (OSError, subprocess.SubprocessError):
                continue
            cleaned.append(str(record.data.get("tag")))
    return cleaned


def watch(path: str) -> None:
    """Until the record is gone (its cluster closed): when its owner is gone, clean up what it names."""
    while True:
        record = Record.read(path)
        if record is None:
            return
        if not record.owner_alive():
            record.clean()
            return
        time.sleep(_POLL_S)


if __name__ == "__main__":
    watch(sys.argv[1])
