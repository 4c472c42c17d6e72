"""A disk that writes at a chosen speed, so that the slow-device tables exist on any machine.

    with throttled_writes(500, "/work/main", 2 << 30) as location:
        ...  # files written under location, by this process and every other, go at most 500 MB/s

Two ways, the first that this machine has:

* cgroup v2 ``io.max`` (``wbps=``) on the device holding ``directory``, in a child cgroup that this
  process and its descendants (a forkserver already started among them) move into, and out of
  afterwards. Buffered writes are charged to it through writeback, which needs the io and memory
  controllers both on the cgroup v2 hierarchy.
* a loop device over a sparse file in ``directory``, formatted ext4 and mounted there, throttled with
  cgroup v1 ``blkio.throttle.write_bps_device`` in the root blkio cgroup. The limit belongs to the loop
  device, so it holds for every process and for the kernel's writeback threads alike; nothing else
  on the disk is slowed. Needs root, ``losetup`` and ``mkfs.ext4``. This is the way on hosts that
  mount cgroup v1 controllers beside an empty cgroup v2 hierarchy (the development VM).

A throttle limits bandwidth only: each write still completes at the real device's latency, so a
device whose speed comes from queue depth (a cloud volume, a RAID) is not modelled.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from typing import Iterator, Optional

CGROUP_V1_BLKIO = "/sys/fs/cgroup/blkio"


class ThrottleUnavailable(RuntimeError):
    """No way to limit disk writes here; the message names what each way lacks."""


@contextlib.contextmanager
def throttled_writes(mbps: float, directory: str, size_bytes: int) -> Iterator[str]:
    """Yield a directory whose files are written at most ``mbps`` MB/s (10**6 bytes), with room for
    ``size_bytes`` and more; the throttle and anything made for it are gone afterwards."""
    bps = int(mbps * 1e6)
    if bps <= 0:
        raise ValueError(f"throttle speed must be positive, not {mbps} MB/s")
    missing = []
    v2 = _cgroup_v2_with_io()
    if isinstance(v2, str):
        missing.append(v2)
    else:
        with _cgroup_v2_limit(v2, directory, bps) as location:
            yield location
        return
    why = _loop_unavailable()
    if why:
        missing.append(why)
        raise ThrottleUnavailable("cannot throttle disk writes here: " + "; ".join(missing))
    with _loop_device_limit(directory, bps, size_bytes) as location:
        yield location


@contextlib.contextmanager
def throttled_reads(mbps: float, directory: str, size_bytes: int) -> Iterator[str]:
    """Yield a directory whose files are read from its device at most ``mbps`` MB/s (10**6 bytes) in all, by every
    process together: a store whose bandwidth the ranks share. Only reads that reach the device are limited:
    evict a file's pages (``measure.drop_cache``) before each read of it. A loop device, as for writes."""
    bps = int(mbps * 1e6)
    if bps <= 0:
        raise ValueError(f"throttle speed must be positive, not {mbps} MB/s")
    why = _loop_unavailable()
    if why:
        raise ThrottleUnavailable("cannot throttle disk reads here: " + why)
    with _loop_device_limit(directory, bps, size_bytes, "read") as location:
        yield location


# cgroup v2


def _cgroup_v2_mount() -> Optional[str]:
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if fields[2] == "cgroup2":
                return fields[1]
    return None


def _cgroup_v2_with_io():
    """The cgroup v2 mount point where io and memory control can be had, or why not (a str)."""
    mount = _cgroup_v2_mount()
    if mount is None:
        return "no cgroup v2 hierarchy is mounted"
    with open(os.path.join(mount, "cgroup.controllers")) as f:
        controllers = f.read().split()
    lacking = [c for c in ("io", "memory") if c not in controllers]
    if lacking:
        return (f"the cgroup v2 hierarchy at {mount} has no {' or '.join(lacking)} controller "
                f"(held by cgroup v1 mounts, or not built)")
    return mount


def _whole_disk(dev: int) -> str:
    """MAJ:MIN of the disk holding ``dev`` (io.max takes whole disks, not partitions)."""
    sys_dev = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    if os.path.exists(os.path.join(sys_dev, "partition")):
        with open(os.path.join(sys_dev, "..", "dev")) as f:
            return f.read().strip()
    return f"{os.major(dev)}:{os.minor(dev)}"


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _move(pids: list[int], cgroup: str) -> None:
    for pid in pids:
        try:
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                f.write(str(pid))
        except ProcessLookupError:
            pass


def _own_cgroup_v2(mount: str) -> str:
    with open("/proc/self/cgroup") as f:
        for line in f:
            if line.startswith("0::"):
                return os.path.join(mount, line.strip()[3:].lstrip("/"))
    return mount


@contextlib.contextmanager
def _cgroup_v2_limit(mount: str, directory: str, bps: int) -> Iterator[str]:
    device = _whole_disk(os.stat(directory).st_dev)
    home = _own_cgroup_v2(mount)
    parent = mount  # controllers can be handed down from the root whatever processes it holds
    with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
        f.write("+io +memory")
    group = os.path.join(parent, f"distckpt-bench-throttle-{os.getpid()}")
    os.mkdir(group)
    try:
        with open(os.path.join(group, "io.max"), "w") as f:
            f.write(f"{device} wbps={bps}")
        # the whole tree: run_ranks' forkserver may be running already, and forks rank processes from itself
        _move(_descendants(os.getpid()), group)
        try:
            yield directory
        finally:
            with open(os.path.join(group, "cgroup.procs")) as f:
                inside = [int(p) for p in f.read().split()]
            _move(inside, home)
    finally:
        os.rmdir(group)


# a loop device and cgroup v1


def _loop_unavailable() -> Optional[str]:
    """Why a throttled loop device cannot be had, or None."""
    if os.geteuid() != 0:
        return "a throttled loop device needs root"
    if not os.path.exists("/dev/loop-control"):
        return "no loop devices (/dev/loop-control is missing)"
    if not os.path.exists(os.path.join(CGROUP_V1_BLKIO, "blkio.throttle.write_bps_device")):
        return f"no cgroup v1 blkio throttling ({CGROUP_V1_BLKIO}/blkio.throttle.write_bps_device is missing)"
    path = os.environ.get("PATH", "") + os.pathsep + "/sbin" + os.pathsep + "/usr/sbin"
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool, path=path) is None:
            return f"{tool} is not installed"
    return None


def _run(*cmd: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise ThrottleUnavailable(f"{' '.join(cmd)} failed: {done.stderr.strip()}")
    return done.stdout.strip()


def _set_write_bps(device: str, bps: int, kind: str = "write") -> None:
    with open(os.path.join(CGROUP_V1_BLKIO, f"blkio.throttle.{kind}_bps_device"), "w") as f:
        f.write(f"{device} {bps}")  # 0 removes the limit


@contextlib.contextmanager
def _loop_device_limit(directory: str, bps: int, size_bytes: int, kind: str = "write") -> Iterator[str]:
    image = os.path.join(directory, f".throttle-{os.getpid()}.img")
    mountpoint = os.path.join(directory, f"throttled-{os.getpid()}")
    with open(image, "wb") as f:
        f.truncate(3 * size_bytes + (1 << 30))  # sparse: two checkpoints and their neighbours, plus ext4's own
    try:
        # direct I/O to the image: the bytes are not cached twice, and the loop device's writes are the disk's
        loop = _run("losetup", "--find", "--show", "--direct-io=on", image)
        try:
            # no lazy initialisation: it would write in the background, against the limit
            _run("mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", loop)
            os.mkdir(mountpoint)
            try:
                _run("mount", loop, mountpoint)
                try:
                    device = f"{os.major(os.stat(loop).st_rdev)}:{os.minor(os.stat(loop).st_rdev)}"
                    _set_write_bps(device, bps, kind)
                    try:
                        yield mountpoint
                    finally:
                        _set_write_bps(device, 0, kind)
                finally:
                    _run("umount", mountpoint)
            finally:
                os.rmdir(mountpoint)
        finally:
            _run("losetup", "--detach", loop)
    finally:
        os.remove(image)
