"""Measuring one operation: wall time, CPU time, and peak RSS above the level before it."""

from __future__ import annotations

import os
import resource
import time
from dataclasses import asdict, dataclass
from typing import Callable


@dataclass
class Sample:
    wall_s: float
    cpu_s: float
    peak_rss_delta_mb: float
    nbytes: int

    @property
    def gbps(self) -> float:
        return self.nbytes / self.wall_s / 1e9 if self.wall_s else float("inf")

    @property
    def cpu_s_per_gb(self) -> float:
        return self.cpu_s / (self.nbytes / 1e9) if self.nbytes else 0.0

    def as_dict(self) -> dict:
        return asdict(self) | {"gbps": self.gbps, "cpu_s_per_gb": self.cpu_s_per_gb}


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (peak RSS) to the current RSS
    except OSError:
        pass


def measure(fn: Callable[[], object], nbytes: int) -> Sample:
    """Run ``fn`` once; CPU time counts every thread of this process."""
    _reset_peak()
    base = _rss_kb("VmRSS")
    c0 = time.process_time()
    t0 = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    peak = _rss_kb("VmHWM")
    return Sample(wall, cpu, max(0, peak - base) / 1024, nbytes)


def best(samples: list) -> Sample:
    """The fastest of repeated runs.

    On this kind of machine the noise is one-sided: a virtual machine whose host
    backs guest memory lazily makes whichever run first touches fresh pages (page
    cache, buffers) pay several times the CPU in the kernel, at random. The fastest
    run is the one closest to the code's own cost; every peer is treated alike.
    """
    return min(samples, key=lambda s: s.wall_s)


def drop_cache(path: str) -> None:
    """Evict a directory's files from the page cache (they must be clean: fsynced)."""
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def usage_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def warm_memory(gib: float) -> None:
    """Touch memory once before measuring. On a virtual machine the host may back guest memory
    lazily; the first touch of a page is then many times slower than any later one, and whichever
    peer ran first would pay for it (seen here: tmpfs writes at 0.6 GB/s cold, 2.2 GB/s warm).

    The host also takes back memory the guest has freed for a while, so a cold load, which fills
    the page cache, would pay again unless the save before it had filled the page cache itself:
    2 GiB read with dd after a save written around the page cache took 1.5-3.3 s (1-3 s of system
    time), and 0.83 s after touching 3 GiB first. ``peers_round`` touches the state's size before
    every cold load, of every peer alike."""
    if gib <= 0:
        return
    import torch

    block = torch.ones(int(gib * (1 << 30)), dtype=torch.uint8)
    del block



def machine_state(*paths: str) -> dict:
    """What the figures of a run depend on beyond the code: the load, free memory, and how full each of ``paths``'
    file systems is (a tmpfs nearly full places its pages worse), taken when the run starts and when it ends."""
    with open("/proc/meminfo") as f:
        meminfo = {line.split(":")[0]: int(line.split()[1]) for line in f if ":" in line}
    out = {"loadavg": os.getloadavg(), "cpus": os.cpu_count(), "mem_available_mib": meminfo.get("MemAvailable", 0) // 1024,
           "mem_total_mib": meminfo.get("MemTotal", 0) // 1024, "filled": {}}
    for path in paths:
        st = os.statvfs(path)
        out["filled"][path] = round(1 - st.f_bavail / st.f_blocks, 3) if st.f_blocks else None
    return out


def describe_machine(state: dict) -> str:
    filled = ", ".join(f"{p} {v:.0%} full" for p, v in state["filled"].items() if v is not None)
    return (f"machine: load {state['loadavg'][0]:.2f}/{state['loadavg'][1]:.2f}/{state['loadavg'][2]:.2f} on "
            f"{state['cpus']} CPUs, {state['mem_available_mib']} of {state['mem_total_mib']} MiB available"
            + (f"; {filled}" if filled else ""))
