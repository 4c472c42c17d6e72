"""How much an incremental save of an embedding table writes, by rows per chunk (issue 49; docs/performance.md,
"Incremental saves"). Pure arithmetic and a numpy simulation, no checkpoint is written.

    python -m bench.embedding_chunks            # a 2**20 x 1024 bf16 table (2 GiB)

A chunk of k rows is written again when any of its rows changed since the previous save. With a fraction p of
rows touched uniformly at random, a chunk is untouched with probability (1-p)^k, so the fraction written is
1-(1-p)^k. The simulation checks that formula and adds skewed (Zipf) touches, with the row ids hashed (hot rows
anywhere) or sorted by popularity (hot rows side by side). The cost side: the chunk entries of the metadata
document (47 bytes of JSON each, docs/format.md 3.1, offsets near 2**31) and a per-chunk planning cost.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

ROWS_PER_CHUNK = (1, 4, 16, 32, 64, 256, 1024, 16384, 131072)
ENTRY = [[1048560, 0], [16, 1024], 3, 2147450880, 4294967295]  # one chunk: offsets, sizes, file, offset, crc32c


def written_fraction(p: float, k: int) -> float:
    return 1.0 - (1.0 - p) ** k


def touched_chunks(rows: np.ndarray, total_rows: int, k: int) -> float:
    hit = np.zeros(-(-total_rows // k), dtype=bool)
    hit[rows // k] = True
    return float(hit.mean())


def zipf_touches(total_rows: int, share: float, s: float, rng: np.random.Generator) -> np.ndarray:
    """Distinct rows hit by as many Zipf(s) lookups as make ``share`` of the rows distinct (by popularity rank)."""
    w = np.arange(1, total_rows + 1, dtype=np.float64) ** -s
    w /= w.sum()
    lo, hi = 1, 1 << 40
    while lo < hi:  # the lookups whose expected distinct rows reach the share
        n = (lo + hi) // 2
        lo, hi = (n + 1, hi) if (1 - np.exp(-n * w)).sum() < share * total_rows else (lo, n)
    return np.unique(rng.choice(total_rows, size=lo, p=w))


def held_tables(chunks: int, f: float, saves: int, full_every: int, rng: np.random.Generator) -> float:
    """Most bytes stored, in tables, over ``saves`` incremental saves that each rewrite a chunk with probability
    ``f``: retention keeps a file while any chunk of a kept step lies in it (a file is deleted whole), and a
    save every ``full_every`` (0: never) rewrites every chunk; keep_last=2."""
    latest = np.zeros(chunks, dtype=np.int64)  # the save whose file holds each chunk's current bytes
    size = {0: chunks}
    previous = latest.copy()
    most = 0.0
    for s in range(1, saves):
        changed = np.ones(chunks, dtype=bool) if full_every and s % full_every == 0 else rng.random(chunks) < f
        previous, latest = latest, np.where(changed, s, latest)
        size[s] = int(changed.sum())
        alive = set(np.unique(latest).tolist()) | set(np.unique(previous).tolist())  # the newest 2 steps' files
        size = {k: v for k, v in size.items() if k in alive}
        most = max(most, sum(size.values()) / chunks)
    return most


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1 << 20)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--itemsize", type=int, default=2, help="bytes per element (bf16: 2)")
    p.add_argument("--touched", type=float, default=0.01, help="fraction of rows changed between two saves")
    p.add_argument("--us-per-chunk", type=float, default=20.0, help="planning CPU per chunk (docs/performance.md)")
    p.add_argument("--gbps", type=float, default=1.0, help="write bandwidth for the time model, GB/s")
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    row_bytes, table = a.dim * a.itemsize, a.rows * a.dim * a.itemsize
    entry = len(json.dumps(ENTRY, separators=(",", ":")))
    ks = [k for k in ROWS_PER_CHUNK if k <= a.rows]
    uniform = rng.choice(a.rows, size=int(a.touched * a.rows), replace=False)
    skewed = {s: zipf_touches(a.rows, a.touched, s, rng) for s in (1.05, 1.2)}
    perm = rng.permutation(a.rows)
    out = {"table_bytes": table, "row_bytes": row_bytes, "entry_bytes": entry, "rows": []}
    print(f"table {a.rows} x {a.dim} x {a.itemsize} B = {table / (1 << 30):.2f} GiB, rows of {row_bytes} B; "
          f"{100 * a.touched:g}% of rows touched between saves")
    print(f"{'rows/chunk':>10s} {'chunk KiB':>9s} {'p=0.1%':>7s} {'p=1%':>7s} {'p=10%':>7s} {'sim 1%':>7s} "
          f"{'zipf hashed':>11s} {'zipf sorted':>11s} {'chunks':>8s} {'meta MB':>8s} {'meta/data':>9s} {'model s':>8s}")
    for k in ks:
        f = written_fraction(a.touched, k)
        chunks = -(-a.rows // k)
        meta = chunks * entry
        row = {"k": k, "chunk_bytes": k * row_bytes, "written": {q: written_fraction(q, k) for q in (0.001, 0.01, 0.1)},
               "simulated": touched_chunks(uniform, a.rows, k),
               "zipf_hashed": {s: touched_chunks(perm[t], a.rows, k) for s, t in skewed.items()},
               "zipf_sorted": {s: touched_chunks(t, a.rows, k) for s, t in skewed.items()},
               "chunks": chunks, "metadata_bytes": meta, "metadata_over_data": meta / (f * table),
               "model_s": f * table / (a.gbps * 1e9) + chunks * a.us_per_chunk * 1e-6}
        out["rows"].append(row)
        w = row["written"]
        print(f"{k:10d} {k * row_bytes / 1024:9.0f} {w[0.001]:7.4f} {w[0.01]:7.4f} {w[0.1]:7.4f} {row['simulated']:7.4f} "
              f"{row['zipf_hashed'][1.05]:11.4f} {row['zipf_sorted'][1.05]:11.4f} {chunks:8d} {meta / 1e6:8.2f} "
              f"{row['metadata_over_data']:9.4f} {row['model_s']:8.2f}")
    print(f"written: fraction of the table's bytes per save (1-(1-p)^k); sim: uniform touches simulated; zipf s=1.05 "
          f"touches with ids hashed or sorted by popularity; meta: {entry} B of JSON per chunk entry; model: bytes at "
          f"{a.gbps:g} GB/s + {a.us_per_chunk:g} us of planning per chunk")
    print("stored (most, in tables) over 100 saves, keep_last=2; full saves keep 2 tables:")
    for r in out["rows"]:
        if r["k"] in (16, 32, 64):
            f = r["written"][a.touched]
            chunks = r["chunks"]
            r["held"] = {K: held_tables(chunks, f, 100, K, rng) for K in (0, 10)}
            r["mean_written_full_every_10"] = (1 + 9 * f) / 10
            print(f"  k={r['k']}: incremental only {r['held'][0]:.2f}, full_every=10 {r['held'][10]:.2f} "
                  f"(written per save, mean over 10: {r['mean_written_full_every_10']:.3f} of the table)")
    for s in skewed:
        print(f"zipf s={s}: " + ", ".join(f"k={r['k']}: hashed {r['zipf_hashed'][s]:.3f} sorted {r['zipf_sorted'][s]:.3f}"
                                          for r in out["rows"] if r["k"] in (16, 64, 256)))
    return out


if __name__ == "__main__":
    main()
