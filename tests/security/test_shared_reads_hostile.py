"""Hostile review of shared reads (issue 48): a load over a process group reads each chunk several ranks need on
one of them and sends it to the others (engine/shared_reads.py, engine/shared_delivery.py, engine/read.py).

Attacks that held are listed in the review's report; the tests here are the defects it found, each failing before
its fix, and a few cheap checks of what held."""

from __future__ import annotations

import os
import shutil
import struct
import time

import numpy as np
import pytest

import distckpt
from distckpt.engine.shared_reads import Peers, Shares, decode_table, plan_shares
from distckpt.errors import CorruptCheckpointError
from distckpt.testing import run_ranks as _run_ranks

from . import shared_reads_hostile_workers as workers


def run_ranks(fn, world_size, *args, env=None, **kwargs):
    """distckpt.testing.run_ranks with shared reads on wherever several ranks need a chunk (the default, "auto",
    leaves out ranks of one node reading a file through its page cache)."""
    return _run_ranks(fn, world_size, *args, env={"DISTCKPT_SHARED_READS": "1", **(env or {})}, **kwargs)


def _flip(path, key, where=0.5):
    md = distckpt.read_metadata(path)
    info = next(v for k, v in md.storage_data.items.items() if k.fqn == key)
    with open(os.path.join(path, info.file), "r+b") as f:
        f.seek(info.offset + int(info.length * where))
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))


# ------------------------------------------------------------ identity: what a rank is sent is what it would read


def test_tied_weights_of_a_torch_save_file_load_on_every_rank(tmp_path):
    """A torch.save file whose keys view one storage (GPT-2's wte and lm_head) has two items at one offset: both
    keys are filled, on the rank that reads the bytes and on the ranks it sends them to (one of them stayed zeros,
    silently)."""
    path = str(tmp_path / "tied.pt")
    workers.torch_save_tied(0, 1, path)
    results = run_ranks(workers.load_torch_save_tied, 2, path)
    assert all(r["error"] is None and r["bad"] == [] and r["messages"] for r in results), results


def test_views_of_one_storage_at_one_offset_with_other_lengths_load_on_different_ranks(tmp_path):
    """Rank 0 holds ``head`` (w[:20]), rank 1 ``wte`` (w): one offset, two lengths. Each rank gets its own key (rank 0
    refused the coordinator's plan as malformed, and rank 1 waited for it)."""
    path = str(tmp_path / "tied.pt")
    workers.torch_save_tied(0, 1, path)
    results = run_ranks(workers.load_torch_save_tied, 2, path, None, [["head", "other"], ["wte.weight", "other"]],
                        env={"DISTCKPT_TIMEOUT_S": "20"}, allow_failures=True)
    assert all(isinstance(r, dict) and r["error"] is None and r["bad"] == [] for r in results), results


def test_views_of_one_storage_in_two_shapes_load_whatever_row_each_rank_cuts_them_by(tmp_path):
    """``x`` (50 x 16) and ``y`` (25 x 32) view one storage: one offset, one length, rows of 64 and 128 bytes. Rank 0
    holds y, rank 1 both; in a small bucket the chunk travels whole, not cut by one rank's rows (rank 0 failed:
    "shape '[1, 32]' is invalid for input of size 48"; rank 1's x stayed zeros)."""
    path = str(tmp_path / "reshaped.pt")
    workers.torch_save_reshaped(0, 1, path)
    results = run_ranks(workers.load_torch_save_reshaped, 2, path, [["y"], ["x", "y"]],
                        env={"DISTCKPT_SHARED_READ_BUCKET_BYTES": "200"})
    assert all(r["error"] is None and r["bad"] == [] and r["messages"] for r in results), results


def test_ranks_loading_different_saves_each_get_their_own_bytes(tmp_path):
    """Node-local copies: each rank loads its own path. Two different saves of the same shapes name the same files
    and offsets; a rank must never be sent the other save's bytes (each got the other's tensor, silently)."""
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    for seed, path in enumerate(paths):
        workers.save_seeded(0, 1, path, seed)
    results = run_ranks(workers.load_own_path, 2, paths, [0, 1])
    assert all(r["error"] is None and r["bad"] == [] for r in results), results
    shutil.rmtree(paths[1])
    shutil.copytree(paths[0], paths[1])  # copies of one save still share their reads
    results = run_ranks(workers.load_own_path, 2, paths, [0, 0])
    assert all(r["error"] is None and r["bad"] == [] and r["messages"] for r in results), results


def test_a_rank_that_verifies_checksums_is_never_sent_unverified_bytes(tmp_path):
    """Rank 0 reads without checksums (verify_checksums=False), rank 1 with: a corrupted chunk both need is read by a
    rank that verifies it, so rank 1 fails naming it (it loaded the corrupted bytes rank 0 read, silently)."""
    path = str(tmp_path / "ck")
    workers.save_one(0, 1, path)
    _flip(path, "a")
    results = run_ranks(workers.load_one, 2, path, [False, True])
    r = results[1]
    assert r["error"] and "'a'" in r["text"] and "checksum mismatch" in r["text"], r
    assert not r["mixed"], r  # no corrupted byte stays


def test_parameters_that_require_grad_and_inference_tensors_load_as_direct_reads_fill_them(tmp_path):
    """``{"a": nn.Parameter(...)}`` and a tensor made under inference_mode: a load without shared reads fills them
    (direct reads write their memory); with shared reads the copy raised in autograd's checks, the zeroing after it
    raised again out of the read-ahead thread, and the ranks, out of step, waited out the timeout."""
    path = str(tmp_path / "ck")
    workers.save_plain(0, 1, path)
    started = time.monotonic()
    results = run_ranks(workers.load_plain, 2, path, "requires_grad", timeout_s=60,
                        env={"DISTCKPT_TIMEOUT_S": "10", "DISTCKPT_SHARED_READ_MIN_BYTES": "1"})  # both ranks read
    assert time.monotonic() - started < 9
    assert all(r["error"] is None and r["bad"] == [] for r in results), results
    assert {"send", "receive"} <= set(results[0]["roles"].values()), results  # each rank sends and receives


def test_ranks_with_shared_reads_off_on_one_rank_are_told_so_not_that_the_checkpoint_is_corrupt(tmp_path):
    """One rank's reader has shared_reads=False: its table is another protocol's. Every rank raises at once, naming
    the setting (it was a CorruptCheckpointError: 'chunk table from a rank has the wrong length')."""
    path = str(tmp_path / "ck")
    workers.save_plain(0, 1, path)
    for odd in (1, 0):  # the coordinator shares reads, or it is the odd one
        results = run_ranks(workers.load_plain, 2, path, "shared_off_on", {"rank": odd})
        for r in results:
            assert r["error"] and "DISTCKPT_SHARED_READS" in r["text"] and "Corrupt" not in r["text"], r


# ------------------------------------------------------------ ranks that fail or hang


def test_a_rank_whose_finish_plan_fails_still_answers_every_peer(tmp_path):
    """A rank fails after planning, before its reads (a planner's finish_plan): it still walks its messages, sending
    its failure, so that every rank raises at once naming it (every rank waited out DISTCKPT_TIMEOUT_S, and the
    cause was lost)."""
    path = str(tmp_path / "ck")
    workers.save_plain(0, 1, path)
    started = time.monotonic()
    results = run_ranks(workers.load_plain, 2, path, "finish_plan_raises", env={"DISTCKPT_TIMEOUT_S": "12"},
                        timeout_s=60)
    assert time.monotonic() - started < 10
    for r in results:
        assert r["error"] and "finish_plan of this rank fails" in r["text"], r


def test_a_sender_that_dies_mid_chunk_leaves_no_unchecked_bytes_in_any_destination(tmp_path):
    """A chunk sent in pieces (small bucket), its sender SIGKILLed after two: the receivers raise, and the pieces they
    had copied, whose checksum was never checked, are zeroed (they stayed in the caller's tensor)."""
    path = str(tmp_path / "ck")
    workers.save_one(0, 1, path, 640)
    results = run_ranks(workers.load_one_dying, 3, path, 640, 2, "kill", allow_failures=True, timeout_s=60,
                        env={"DISTCKPT_SHARED_READ_BUCKET_BYTES": "4096", "DISTCKPT_TIMEOUT_S": "20"})
    survivors = [r for r in results if isinstance(r, dict)]
    assert len(survivors) == 2, results
    for r in survivors:
        assert r["error"] and r["zero"], r


def test_a_sender_that_hangs_mid_exchange_makes_every_survivor_raise_within_the_timeout(tmp_path):
    """The sender stops answering after two messages: each receiver raises once DISTCKPT_TIMEOUT_S has passed, with
    the shared read's own error (it then waited a second timeout in the next collective, whose 'Operation timed out'
    replaced the cause)."""
    path = str(tmp_path / "ck")
    workers.save_one(0, 1, path, 640)
    timeout = 4
    results = run_ranks(workers.load_one_dying, 3, path, 640, 2, "hang", allow_failures=True, timeout_s=60,
                        env={"DISTCKPT_SHARED_READ_BUCKET_BYTES": "4096", "DISTCKPT_TIMEOUT_S": str(timeout)})
    survivors = [r for r in results if isinstance(r, dict)]
    assert len(survivors) == 2, results
    for r in survivors:
        assert r["error"] and "shared read" in r["text"] and r["since_first_receive"] < 1.5 * timeout, r
        assert r["zero"], r


# ------------------------------------------------------------ the coordinator's messages


def _table(*rows):
    return np.array(rows, dtype="<i8").reshape(len(rows), 6).T.copy()


def test_ranks_that_disagree_on_a_chunks_length_do_not_share_it():
    """Two ranks list one (file, offset) with different lengths (two views of one storage, or forged metadata): the
    chunk is not shared, each rank reads its own (one rank was planned a piece past its chunk, or sent bytes it
    never checked)."""
    tables = [_table((0, 4096, 48, 12, 0, 48)), _table((0, 4096, 32, 8, 0, 32))]
    payloads = plan_shares(tables, 1 << 20, True)
    for rank, payload in enumerate(payloads):
        chunks = [("f0",) + tuple(int(x) for x in c[1:]) for c in tables[rank].T]
        shares = Shares.decode(payload, chunks, Peers(None, rank, 2, None, 1.0))
        assert shares.messages == [], shares.messages


def test_a_forged_coordinator_payload_is_a_typed_error():
    """A plan naming a chunk number below zero (Python read it from the end of the list) or a message this rank
    takes no part in (it would wait for it) is refused."""
    chunks = [("f0", 4096, 48, 12, 0, 48), ("f0", 8192, 48, 12, 0, 48)]
    peers = Peers(None, 0, 3, None, 1.0)

    def payload(*row):
        return struct.pack("<QQ", 1 << 20, 1) + np.array(row, dtype="<i8").tobytes()
    Shares.decode(payload(1, 1, 1, 0, 0, 0, 48), chunks, peers)  # well formed: rank 1 sends chunk 0 to rank 0
    for bad in [payload(1, 1, 1, 0, -1, 0, 48),  # chunk -1
                payload(1, 1, 1, 2, 0, 0, 48),  # rank 1 to rank 2: not this rank's message
                payload(0, 1, 1, 0, 0, 0, 48),  # rank 0 to itself
                payload(1, 2, 1, 0, 0, 0, 0, 48)]:  # rank 0 twice
        with pytest.raises(CorruptCheckpointError):
            Shares.decode(bad, chunks, peers)
    for raw in [b"", b"\0" * 23, struct.pack("<QQQQ", 2 ** 60, 1, 1, 0), struct.pack("<QQQQ", 1, 0, 1, 0) + b"\0" * 48]:
        with pytest.raises(CorruptCheckpointError):
            decode_table(raw)


# ------------------------------------------------------------ memory


def test_rows_larger_than_the_bucket_keep_the_exchange_within_the_memory_budget(tmp_path):
    """Rows of 40 kB under a 100 kB budget (the bucket, a quarter of it, holds no row): each message is one row, and
    a rank holds the one it receives and one it reads ahead, within the budget (it held two ahead: 121 kB)."""
    path = str(tmp_path / "ck")
    workers.save_wide(0, 1, path)
    results = run_ranks(workers.load_wide_counting, 2, path, env={"DISTCKPT_MEMORY_BUDGET_BYTES": "100000"})
    for r in results:
        assert r["error"] is None and r["exact"] and 0 < r["held"] <= 100_000, r
