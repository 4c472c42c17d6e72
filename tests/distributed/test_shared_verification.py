"""Ranks that read parts of one stored chunk share its verification: one reads it whole and checks it."""

import os

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from distckpt.engine.shared_verification import assign_verifiers
from distckpt.testing import run_ranks

from . import workers


def test_a_chunk_read_partly_by_several_ranks_is_verified_by_exactly_one(tmp_path):
    path = str(tmp_path / "ck")
    run_ranks(workers.save_rows, 2, path)  # chunks of rows 0-5 and 6-11
    results = run_ranks(workers.load_rows_sharing_verification, 3, path)  # ranks need rows 0-3, 4-7, 8-11
    assert all(r.get("ok") for r in results), results
    # rank 0 reads part of chunk 0, rank 1 parts of both, rank 2 part of chunk 1: each chunk has two
    # partial readers, and exactly one of them verifies it
    elsewhere = [set(r["elsewhere"]) for r in results]
    for chunk, readers in (((0, 0), (0, 1)), ((6, 0), (1, 2))):
        assert sum(chunk not in elsewhere[r] for r in readers) == 1, (chunk, elsewhere)


def test_damage_seen_only_by_the_verifier_fails_the_load_on_every_rank(tmp_path):
    path = str(tmp_path / "ck")
    run_ranks(workers.save_rows, 2, path)
    results = run_ranks(workers.load_rows_sharing_verification, 3, path)
    verifiers = {chunk: [r for r in range(3) if tuple(chunk) not in set(results[r]["elsewhere"])] for chunk in ((0, 0),)}
    # damage row 5 of chunk 0: rank 1 (rows 4-7) reads it; whichever of ranks 0 and 1 verifies chunk 0 sees it
    name = next(f for f in sorted(os.listdir(path)) if f.startswith("data-00000"))
    with open(os.path.join(path, name), "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(size - 6 * 1024 * 4 + 5 * 1024 * 4 + 8)  # the file ends with this rank's chunk of 6 rows
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert verifiers[(0, 0)]
    results = run_ranks(workers.load_rows_sharing_verification, 3, path)
    assert all(r.get("error") in ("RankFailuresError", "CorruptCheckpointError") for r in results), results
    assert all("checksum mismatch" in r["text"] for r in results), results


@settings(deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 6)), max_size=8, unique=True), min_size=1, max_size=5))
def test_every_listed_chunk_gets_exactly_one_verifier_among_its_readers(listed):
    tables = [np.array([[f for f, _ in chunks], [o * 100 for _, o in chunks], [(o + 1) * 10 for _, o in chunks]],
                       dtype="<i8").reshape(3, len(chunks)) for chunks in listed]
    masks = [np.frombuffer(m, dtype=np.uint8) for m in assign_verifiers(tables)]
    assert [len(m) for m in masks] == [len(c) for c in listed]
    for chunk in {c for chunks in listed for c in chunks}:
        assert sum(int(masks[r][chunks.index(chunk)]) for r, chunks in enumerate(listed) if chunk in chunks) == 1
