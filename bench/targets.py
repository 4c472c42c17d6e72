"""The speed targets of issues 5, 22 and 45, checked against one run of ``bench.run``.

    python -m bench.targets results.json    # a run saved with bench.run --json

Each target is a ratio taken within that run. Where the same table has a
``raw`` row (the bytes moved with no format, checksum or metadata), the
ratio the raw row reaches is shown beside it as the floor: a target the
floor misses cannot be met on that machine by any checkpoint format.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Optional

_MIB = 1 << 20


@dataclass(frozen=True)
class Target:
    name: str
    measured: float
    goal: float
    higher_is_better: bool
    floor: Optional[float] = None  # what the raw row reaches on the same measure
    floor_label: str = "raw floor"
    reference: bool = False  # shown for comparison, not one of the issue's targets


    @property
    def met(self) -> bool:
        return self.measured >= self.goal if self.higher_is_better else self.measured <= self.goal

    def line(self) -> str:
        sign = ">=" if self.higher_is_better else "<="
        floor = f"   {self.floor_label} {self.floor:.2f}" if self.floor is not None else ""
        mark = "ref   " if self.reference else ("met   " if self.met else "MISSED")
        return f"  {mark} {self.name:<44} {self.measured:7.2f}  (goal {sign} {self.goal:.3g}){floor}"


def _time_ratio(rows: dict, op: str, peer: str, base: str) -> Optional[float]:
    a, b = rows.get(f"{peer}|{op}"), rows.get(f"{base}|{op}")
    return a["wall_s"] / b["wall_s"] if a and b else None


def _cpu_ratio(rows: dict, op: str, peer: str, base: str) -> Optional[float]:
    a, b = rows.get(f"{peer}|{op}"), rows.get(f"{base}|{op}")
    return a["cpu_s_per_gb"] / b["cpu_s_per_gb"] if a and b else None


def evaluate(results: dict) -> list[Target]:
    """Every target the run has the figures for, in the issue's order."""
    out: list[Target] = []
    base = results.get("baselines", {})
    disk = results.get("disk/1")
    if disk and (base or "seq|save" in disk):
        for op, key, what in (("save", "write_fsync_gbps", "raw write+fsync"), ("load", "read_cold_gbps", "raw cold read")):
            # the sequential bandwidth taken between the peers' rounds; the one taken before them otherwise
            seq = disk.get(f"seq|{op}")
            bandwidth = seq["gbps"] if seq else base[key]
            raw = disk.get(f"raw|{op}")
            out.append(Target(f"disk 1 rank {op} vs {what} bandwidth", disk[f"distckpt|{op}"]["gbps"] / bandwidth, 0.95, True,
                              raw["gbps"] / bandwidth if raw else None))
            direct = disk.get(f"direct|{op}")
            if direct:  # the same, against the disk's bandwidth around the page cache (O_DIRECT)
                out.append(Target(f"  same vs O_DIRECT sequential {op}", disk[f"distckpt|{op}"]["gbps"] / direct["gbps"], 0.95, True,
                                  raw["gbps"] / direct["gbps"] if raw else None, reference=True))
    for ranks in (1, 2):
        rows = results.get(f"tmpfs/{ranks}")
        if not rows:
            continue
        for op in ("save", "load"):
            out.append(Target(f"tmpfs {ranks} rank(s) {op}: DCP time / distckpt", _time_ratio(rows, op, "dcp", "distckpt"), 3.0, True,
                              _time_ratio(rows, op, "dcp", "raw")))
        for op in ("save", "load"):
            out.append(Target(f"tmpfs {ranks} rank(s) {op}: CPU s/GB vs DCP's", _cpu_ratio(rows, op, "distckpt", "dcp"), 1 / 3, False,
                              _cpu_ratio(rows, op, "raw", "dcp")))
    small = results.get("small")
    if small:
        for op in ("save", "load"):
            out.append(Target(f"small tensors {op}: DCP time / distckpt", _time_ratio(small, op, "dcp", "distckpt"), 5.0, True))
    # issue 22: the per-item cost, against the floor of the same bytes
    if small and "raw|save" in small:
        for op in ("save", "load"):
            out.append(Target(f"small tensors {op}: raw time / distckpt", _time_ratio(small, op, "raw", "distckpt"), 0.6, True, 1.0))
            out.append(Target(f"small tensors {op}: DCP time / distckpt (22)", _time_ratio(small, op, "dcp", "distckpt"), 10.0, True,
                              _time_ratio(small, op, "dcp", "raw")))
    for ranks in (1, 2):
        rows = results.get(f"tmpfs/{ranks}")
        if rows and "raw|load" in rows:
            verified = _time_ratio(rows, "load", "raw", "raw+crc")
            # with checksums verified, the floor is raw+crc: the same reads, each window CRC-32C'd as it arrives
            out.append(Target(f"tmpfs {ranks} rank(s) warm load: raw time / distckpt", _time_ratio(rows, "load", "raw", "distckpt"),
                              0.9, True, 1.0 if verified is None else verified, "raw floor" if verified is None else "verified floor"))
            if verified is not None:
                out.append(Target(f"tmpfs {ranks} rank(s) warm load: raw+crc / distckpt", _time_ratio(rows, "load", "raw+crc", "distckpt"),
                                  0.9, True, 1.0, reference=True))
            if "unverified|load" in rows:  # the same load without checksums: what the format costs besides them
                out.append(Target(f"tmpfs {ranks} rank(s) warm load: raw / unverified", _time_ratio(rows, "load", "raw", "unverified"),
                                  0.9, True, 1.0, reference=True))
    for ranks in (1, 2):
        rows = results.get(f"reshard/{ranks}")
        if rows:
            out.append(Target(f"reshard 2 -> {ranks} load: DCP time / distckpt", _time_ratio(rows, "load", "dcp", "distckpt"), 3.0, True,
                              _time_ratio(rows, "load", "dcp", "raw")))
    out += _issue_45(results)
    a = results.get("async")
    if a:
        copy, sync = a["memcpy|copy"]["wall_s"], a["distckpt|save"]["wall_s"]
        out.append(Target("async_save blocking / one memcpy", a["async|blocking"]["wall_s"] / copy, 1.2, False))
        # without overlapping the copy with the write the total is copy + save: that bound is the floor
        out.append(Target("async_save total / sync save", a["async|total"]["wall_s"] / sync, 1.1, False, 1 + copy / sync, "bound"))
    worst = None
    for key, rows in results.items():
        if key.split("/")[0] in ("disk", "tmpfs") and isinstance(rows, dict):
            for op in ("save", "load"):
                r = rows.get(f"distckpt|{op}")
                if r:  # peak RSS above the baseline, as a fraction of the allowance S + 256 MiB
                    share = r["peak_rss_delta_mb"] / (r["nbytes"] / _MIB + 256)
                    worst = share if worst is None else max(worst, share)
    if worst is not None:
        out.append(Target("peak RSS / (state + 256 MiB), worst table", worst, 1.0, False))
    plans = results.get("planning") or []
    for ranks in sorted({r["ranks"] for r in plans}):
        ours = next((r for r in plans if r["ranks"] == ranks and r["peer"] == "distckpt"), None)
        dcp = next((r for r in plans if r["ranks"] == ranks and r["peer"] == "dcp"), None)
        if ours and dcp:
            out.append(Target(f"planning {ranks} ranks: DCP time / distckpt", dcp["total_s"] / ours["total_s"], 10.0, True))
            out.append(Target(f"planning {ranks} ranks: gathered bytes vs DCP's", ours["gathered_bytes"] / dcp["gathered_bytes"],
                              0.5, False))
            out.append(Target(f"planning {ranks} ranks: metadata bytes vs DCP's", ours["metadata_bytes"] / dcp["metadata_bytes"],
                              0.5, False))
    return out


def _issue_45(results: dict) -> list[Target]:
    """Multi-rank I/O: the 2-rank tmpfs save against per-rank safetensors files, the 2-rank warm load against the
    verified floor, the 2 -> 2 reshard against its floors and DCP, disk saves (throttled too) against raw write+fsync."""
    out: list[Target] = []
    rows = results.get("tmpfs/2")
    if rows and "safetensors|save" in rows:
        out.append(Target("tmpfs 2 ranks save: per-rank safetensors / distckpt", _time_ratio(rows, "save", "safetensors", "distckpt"),
                          1.0, True, _time_ratio(rows, "save", "safetensors", "raw"), "raw"))
    if rows and "raw+crc|load" in rows:
        out.append(Target("tmpfs 2 ranks warm load: raw+crc / distckpt", _time_ratio(rows, "load", "raw+crc", "distckpt"), 0.95, True,
                          1.0))
    rows = results.get("reshard/2")
    if rows and "raw|load" in rows:
        # the raw row copies out of a mapping of the file; raw-read reads distckpt's own files with preadv, as a
        # reader must that may not die of SIGBUS when another process truncates a file under it
        out.append(Target("reshard 2 -> 2: raw time / distckpt", _time_ratio(rows, "load", "raw", "distckpt"), 0.8, True,
                          _time_ratio(rows, "load", "raw", "raw-read"), "raw-read reaches"))
        out.append(Target("reshard 2 -> 2: DCP time / distckpt (45)", _time_ratio(rows, "load", "dcp", "distckpt"), 2.0, True,
                          _time_ratio(rows, "load", "dcp", "raw-read"), "raw-read reaches"))
    for key in sorted(k for k in results if k.startswith("disk")):
        rows = results[key]
        if isinstance(rows, dict) and "raw|save" in rows and "distckpt|save" in rows:
            where, ranks = key.split("/")
            out.append(Target(f"{where} {ranks} rank(s) save: raw write+fsync / distckpt", _time_ratio(rows, "save", "raw", "distckpt"),
                              0.95, True, 1.0))
    return out


def report(targets: list[Target]) -> list[str]:
    counted = [t for t in targets if not t.reference]
    met = sum(t.met for t in counted)
    return [f"\ntargets (issues 5, 22, 45), this run: {met} of {len(counted)} met"] + [t.line() for t in targets]


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    with open(args[0]) as f:
        print("\n".join(report(evaluate(json.load(f)))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
