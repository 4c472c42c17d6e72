"""Each stored byte is read once per load: a chunk several ranks need is read by one and sent to the others."""

import os
import time

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import distckpt
from distckpt.engine.shared_reads import Message, Peers, Shares, plan_shares
from distckpt.testing import run_ranks

from . import shared_read_workers as workers


def _load(path, kind, ranks, shared=None, env=None, one_node=False):
    results = run_ranks(workers.load_state, ranks, path, kind, shared, one_node, env=env)
    assert all(r["exact"] for r in results), results
    return sum(r["read"] for r in results), results[0]["data"], results


def test_a_replicated_state_at_four_ranks_is_read_once(tmp_path):
    path = str(tmp_path / "ck")
    run_ranks(workers.save_state, 4, path, "replicated")
    read, data, results = _load(path, "replicated", 4, env={"DISTCKPT_SHARED_READ_MIN_BYTES": "65536"})
    assert read <= 1.02 * data, (read, data)
    assert all(r["read"] < 0.6 * data for r in results), [r["read"] for r in results]  # the reads are spread
    # under DISTCKPT_SHARED_READ_MIN_BYTES (4 MiB) a rank, the state (2.5 MB) is read by one rank, sent in one message
    read, data, results = _load(path, "replicated", 4)
    assert read <= 1.02 * data and sum(r["read"] > 0.9 * data for r in results) == 1, [r["read"] for r in results]
    assert all(r["messages"] == 1 for r in results), results
    alone, _, _ = _load(path, "replicated", 4, shared=False)  # the switch: every rank reads what it needs
    assert alone >= 3.9 * data, (alone, data)


def test_ranks_of_one_node_leave_a_file_to_the_page_cache_unless_told_to_share(tmp_path):
    """On one node, ranks reading one file on disk fetch it from the device once between them (the page cache):
    "auto" sends nothing between them; DISTCKPT_SHARED_READS=1 shares anyway (the store's count then drops)."""
    path = str(tmp_path / "ck")
    run_ranks(workers.save_state, 2, path, "replicated")
    read, data, results = _load(path, "replicated", 3, one_node=True)
    assert all(r["messages"] == 0 for r in results) and read >= 2.9 * data, (read, data, results)
    read, data, results = _load(path, "replicated", 3, one_node=True, env={"DISTCKPT_SHARED_READS": "1"})
    assert all(r["messages"] > 0 for r in results) and read <= 1.02 * data, (read, data, results)


def test_an_fsdp_sharded_state_stays_within_two_percent(tmp_path):
    """(A mixed state, resharded, is the next test's.)"""
    path = str(tmp_path / "ck")
    run_ranks(workers.save_state, 4, path, "sharded")
    read, data, results = _load(path, "sharded", 4)
    assert read <= 1.02 * data, (read, data)
    assert all(r["messages"] == 0 for r in results), results  # every chunk is one rank's: nothing to send


def test_hsdp_replicas_share_their_shards_pairwise(tmp_path):
    """Replicated across mesh rows, sharded along columns (2 x 2): each shard is read once and goes only to its
    replica, never to the ranks of the other shard."""
    path = str(tmp_path / "ck")
    run_ranks(workers.save_state, 4, path, "hsdp")
    read, data, results = _load(path, "hsdp", 4)
    assert read <= 1.02 * data, (read, data)
    # ranks (0, 2) hold shard 0, (1, 3) shard 1: each rank exchanges with its replica only
    assert [r["peers"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]], results


def test_overlapping_reshard_reads_are_shared_at_three_ranks_from_two(tmp_path):
    path = str(tmp_path / "ck")
    run_ranks(workers.save_state, 2, path, "mixed")
    read, data, results = _load(path, "mixed", 3)
    assert read <= 1.02 * data, (read, data)
    # small buckets: large chunks travel in pieces of whole rows, still bit-exact
    read, data, results = _load(path, "mixed", 3, env={"DISTCKPT_SHARED_READ_BUCKET_BYTES": "5000"})
    assert read <= 1.02 * data and results[0]["messages"] > 10, (read, data, results[0])


def test_a_corrupted_chunk_fails_every_rank_that_needed_it_naming_the_chunk(tmp_path):
    path = str(tmp_path / "ck")
    run_ranks(workers.save_state, 2, path, "replicated")
    md = distckpt.read_metadata(path)
    info = md.storage_data.items[next(i for i in md.storage_data.items if i.fqn == "layer5.w")]
    with open(os.path.join(path, info.file), "r+b") as f:  # flip a byte in the middle of layer5.w's rows
        f.seek(info.offset + info.length // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    results = run_ranks(workers.load_corrupted, 4, path, env={"DISTCKPT_SHARED_READ_BUCKET_BYTES": "4096"})
    for r in results:
        assert r["error"] in ("RankFailuresError", "CorruptCheckpointError"), r
        assert "layer5.w" in r["text"] and "checksum mismatch" in r["text"], r["text"][:600]
        assert r["zeroed"], r  # what was copied of the failed chunk before its checksum failed is zeroed


def test_a_sender_that_fails_before_reading_still_answers_every_receiver(tmp_path):
    """A data file gone: the ranks that read from it fail opening it, before any read; they still send their
    failure for every chunk they owe, so the ranks waiting for those chunks raise too instead of waiting."""
    path = str(tmp_path / "ck")
    run_ranks(workers.save_state, 2, path, "replicated")
    victim = sorted(f for f in os.listdir(path) if f.startswith("data-"))[-1]
    os.remove(os.path.join(path, victim))
    started = time.monotonic()
    results = run_ranks(workers.load_expecting_failure, 3, path, timeout_s=90, collective_timeout_s=60)
    assert time.monotonic() - started < 45  # failures travel; nobody waits for the timeout
    for r in results:
        assert r["error"] and victim in r["text"], r


def test_a_reader_rank_that_dies_mid_exchange_makes_every_rank_raise_without_hanging(tmp_path):
    path = str(tmp_path / "ck")
    run_ranks(workers.save_big_replicated, 1, path)
    started = time.monotonic()
    results = run_ranks(workers.load_with_dying_reader, 3, path, 1, allow_failures=True, timeout_s=90,
                        collective_timeout_s=20, env={"DISTCKPT_SHARED_READ_BUCKET_BYTES": "65536"})
    assert time.monotonic() - started < 80
    assert getattr(results[1], "exitcode", None) == -9, results[1]
    for rank in (0, 2):
        assert isinstance(results[rank], dict) and results[rank]["error"], results[rank]


@settings(deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5), st.sampled_from([1, 7, 64]), st.booleans()),
                         max_size=7, unique_by=lambda t: t[:2]), min_size=1, max_size=5),
       st.sampled_from([8, 100, 1000]), st.booleans())
def test_every_shared_chunk_has_one_sender_among_its_needers_and_travels_whole(listed, bucket, verify):
    rows = {}  # a chunk's length and row size are its own: every rank lists the same
    for chunks in listed:
        for f, o, r, _ in chunks:
            rows.setdefault((f, o), (r * (o + 1) * 3, r))
    tables, spans = [], {}
    for rank, chunks in enumerate(listed):
        cols = []
        for f, o, _, part in chunks:
            n, row = rows[(f, o)]
            first, end = ((rank % 3) * row, (rank % 3 + 1) * row) if part else (0, n)  # one row of three, or whole
            cols.append((f, o * 1000, n, row, first, end))
            spans.setdefault((f, o * 1000), []).append((first, end))
        tables.append(np.array(cols, dtype="<i8").reshape(len(cols), 6).T.copy())
    payloads = plan_shares(tables, bucket, verify)
    needers = {}
    for rank, t in enumerate(tables):
        for j in range(t.shape[1]):
            needers.setdefault((int(t[0, j]), int(t[1, j])), []).append(rank)
    seen = {}  # (chunk) -> [(sender, receivers, b0, b1)]
    for rank, raw in enumerate(payloads):
        chunks = [(f"f{int(c[0])}",) + tuple(int(x) for x in c[1:]) for c in tables[rank].T]
        shares = Shares.decode(raw, chunks, Peers(None, rank, len(tables), None, 1.0))
        for m in shares.messages:
            assert isinstance(m, Message) and rank in (m.src,) + m.receivers
            size = sum(b1 - b0 for _, b0, b1 in m.pieces)
            assert size <= bucket or len(m.pieces) == 1
            for (name, offset), b0, b1 in m.pieces:
                seen.setdefault((int(name[1:]), offset), set()).add((m.src, m.receivers, b0, b1))
    for key, ranks in needers.items():
        ordered = sorted(spans[key])
        overlap = any(b[0] < a[1] for a, b in zip(ordered, ordered[1:]))
        if len(ranks) == 1 or not (verify or overlap):  # read by each rank that needs it, its own part
            assert key not in seen
            continue
        pieces = sorted(seen[key], key=lambda p: p[2])
        senders = {p[0] for p in pieces}
        assert len(senders) == 1 and senders <= set(ranks)
        assert all(set(p[1]) == set(ranks) - senders for p in pieces)
        n, row = rows[(key[0], key[1] // 1000)]
        assert pieces[0][2] == 0 and pieces[-1][3] == n and all(a[3] == b[2] for a, b in zip(pieces, pieces[1:]))
        assert all((p[3] - p[2]) % row == 0 or p[3] == n for p in pieces)


def test_chunks_no_other_rank_can_need_stay_out_of_the_tables(tmp_path):
    """A chunk read whole into a rank's shard of a sharded key (FSDP at the world size it was saved at) is that
    rank's alone: its table lists only what another rank may need (the replicated keys). Resharded to three ranks,
    the shards' chunks are read in parts, and are listed."""
    path = str(tmp_path / "ck")
    run_ranks(workers.save_state, 2, path, "mixed")
    results = run_ranks(workers.load_listing_chunks, 2, path)
    assert all(r["exact"] for r in results), results
    for r in results:
        assert r["listed"] and not any(k.startswith("fsdp.") for k in r["listed"]), r
    results = run_ranks(workers.load_listing_chunks, 3, path)
    assert all(r["exact"] for r in results), results
    assert any("fsdp.w" in r["listed"] for r in results), results


def test_ranks_with_one_table_send_it_once_and_a_collision_of_digests_fails_every_rank(tmp_path):
    """A replicated state: every rank's chunk table is the same, and only the first rank sends it to the
    coordinator (the others' digests travel in the vote). Where two different tables claimed one digest, the answer's
    check tells, and every rank raises at once."""
    path = str(tmp_path / "ck")
    run_ranks(workers.save_many_replicated, 1, path)
    results = run_ranks(workers.load_many_replicated, 3, path)
    assert all(r["error"] is None and r["exact"] for r in results), results
    table = 48 * 300  # six columns of 8 bytes a chunk
    assert results[0]["planning"] > results[1]["planning"] + table == results[2]["planning"] + table, results
    results = run_ranks(workers.load_many_replicated, 3, path, True, timeout_s=60)
    assert all(r["error"] and "digests collided" in r["error"] for r in results), results


def test_a_rank_that_may_share_nothing_joins_the_exchange_another_rank_asks_for(tmp_path):
    path = str(tmp_path / "ck")
    run_ranks(workers.save_state, 2, path, "mixed")
    results = run_ranks(workers.load_where_one_rank_may_share, 2, path)
    assert all(r["exact"] and r["shares"] for r in results), results
