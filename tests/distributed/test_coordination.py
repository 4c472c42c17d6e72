"""Replicated items are written once; a failure on any rank fails every rank, with no commit."""

import os

import pytest

import distckpt
from distckpt.testing import run_ranks

from . import workers


def test_each_replicated_tensor_written_once_and_balanced(tmp_path):
    path = str(tmp_path / "ck")
    run_ranks(workers.save_replicated, 3, path)
    md = distckpt.read_metadata(path)
    items = md.storage_data.items
    for i in range(8):
        assert sum(1 for ix in items if ix.fqn == f"w{i}") == 1
    assert sum(1 for ix in items if ix.fqn == "dt") == 1
    assert sum(1 for ix in items if ix.fqn == "step") == 1
    assert len(md.state_dict_metadata["dt"].chunks) == 1
    # the bytes on disk hold each tensor once
    stored = sum(si.length for si in items.values())
    assert stored == sum(64 * (i + 1) * 4 for i in range(8)) + 12 * 4 + items[distckpt.metadata.MetadataIndex("step")].length
    # balancing: every rank wrote a share
    per_rank = {}
    for si in items.values():
        per_rank[si.file] = per_rank.get(si.file, 0) + si.length
    assert len(per_rank) == 3
    assert max(per_rank.values()) - min(per_rank.values()) <= 64 * 8 * 4
    # and it loads back
    sd = {f"w{i}": __import__("torch").zeros(64 * (i + 1)) for i in range(8)}
    distckpt.load(sd, checkpoint_id=path, planner=distckpt.DefaultLoadPlanner(allow_partial_load=True))
    assert all(float(sd[f"w{i}"][0]) == i for i in range(8))


@pytest.mark.parametrize("phase", ["plan", "write"])
@pytest.mark.parametrize("world_size,fail_rank", [(2, 1), (3, 0)])
def test_failure_on_one_rank_fails_all_and_commits_nothing(tmp_path, phase, world_size, fail_rank):
    path = str(tmp_path / "ck")
    results = run_ranks(workers.failing_save, world_size, path, fail_rank, phase, timeout_s=120)
    for rank, res in enumerate(results):
        assert res is not None, f"rank {rank} did not raise"
        assert res["type"] == "RankFailuresError"
        assert res["failures"] == [fail_rank]
        assert f"rank {fail_rank}" in res["text"]
        assert ("planned failure" in res["text"]) if phase == "plan" else ("No space left" in res["text"])
    assert not os.path.exists(path)
    assert not [n for n in os.listdir(tmp_path) if "distckpt-tmp" in n], "the failed save left its files behind"
    with pytest.raises(distckpt.CheckpointNotFoundError, match="does not exist"):
        distckpt.load({}, checkpoint_id=path)


def test_read_failure_on_one_rank_fails_all(tmp_path):
    import torch

    path = str(tmp_path / "ck")
    distckpt.save({"w": torch.ones(4, 4)}, checkpoint_id=path)
    results = run_ranks(workers.failing_load, 2, path, 0)
    for res in results:
        assert res is not None and res["failures"] == [0] and "injected read failure" in res["text"]


def test_missing_key_on_one_rank_names_key_and_rank(tmp_path):
    import torch

    path = str(tmp_path / "ck")
    distckpt.save({"w": torch.ones(4, 4)}, checkpoint_id=path)
    results = run_ranks(workers.missing_key_load, 2, path)
    for res in results:
        assert res["failures"] == [1]
        assert "'nope'" in res["text"] and "allow_partial_load" in res["text"] and path in res["text"]


@pytest.mark.parametrize("world_size", [2, 4])
def test_column_planning_runs_and_matches_the_object_path(tmp_path, world_size):
    """The default planner with distckpt's writer plans on columns; the checkpoint is the one the object path writes."""
    res = run_ranks(workers.save_by_both_paths, world_size, str(tmp_path))
    assert res[0]["calls"] == 1 and all(r["calls"] == 0 for r in res[1:])
    assert all(r["planning_bytes"] < r["object_bytes"] for r in res)
    fast = distckpt.read_metadata(str(tmp_path / "columns"))
    slow = distckpt.read_metadata(str(tmp_path / "objects"))
    assert fast.state_dict_metadata == slow.state_dict_metadata and fast.planner_data == slow.planner_data
    where = lambda md: {ix: (si.file, si.offset, si.length, si.crc32c) for ix, si in md.storage_data.items.items()}
    assert where(fast) == where(slow)
    files = lambda md: {n: (f.size, f.rank) for n, f in md.storage_data.files.items()}  # noqa: E731
    assert files(fast) == files(slow)
    for path in ("columns", "objects"):
        distckpt.verify(str(tmp_path / path))
    assert run_ranks(workers.load_all_layouts, world_size, [str(tmp_path / "columns")]) == [{}] * world_size


def test_column_planning_with_write_results_in_the_general_form(tmp_path):
    """A planner whose finish_plan returns a new plan: planning stays on columns, the metadata is built from objects."""
    path = str(tmp_path / "ck")
    assert run_ranks(workers.save_with_general_results, 3, path) == [1, 0, 0]
    distckpt.verify(path)
    assert run_ranks(workers.load_all_layouts, 2, [path]) == [{}, {}]


def test_default_load_planning_moves_no_plan_bytes(tmp_path):
    """The default global load step is the identity: plans stay on their ranks, failures are still shared.

    With shared reads off, what travels is each rank's list of partly read chunks (8 + 24 bytes a chunk) and,
    back, one byte a chunk saying whether this rank verifies it, for shared verification. With shared reads on
    (the default), each rank's list of the chunks it reads (24 + 48 bytes a chunk) and, back, the messages it
    sends and receives: still less than the plans."""
    path = str(tmp_path / "ck")
    run_ranks(workers.save_all_layouts, 2, path)
    for moved in run_ranks(workers.load_with_and_without_plan_transport, 3, path, env={"DISTCKPT_SHARED_READS": "0"}):
        partly_read, rest = divmod(moved["default"] - 10, 25)  # a status byte each way
        assert rest == 0 and partly_read >= 1 and moved["object"] > 4 * moved["default"], moved
    for moved in run_ranks(workers.load_with_and_without_plan_transport, 3, path):
        assert moved["object"] > 1.5 * moved["default"], moved


def test_stateful_objects_are_asked_in_one_order_on_every_rank(tmp_path):
    # their state_dict / load_state_dict may run collectives (an optimizer's get_state_dict): asked in each rank's own
    # key order, rank 0's "model" would meet rank 1's "sched" (DCP's test_different_ordered_state_dict_keys hangs)
    results = run_ranks(workers.stateful_in_rank_order, 2, str(tmp_path / "ck"), timeout_s=60)
    for met in results:
        for name, meetings in met.items():
            assert len(meetings) == 3 and all(m == [name, name] for m in meetings), (name, meetings)  # save; load: template, load


def test_a_load_where_every_rank_reads_whole_chunks_takes_three_fixed_size_exchanges(tmp_path):
    """Arrival, one vote after planning, one after reading: where no rank reads a chunk partly, no list of
    chunks travels and no variable-size message is framed. A resharded load still exchanges its lists."""
    results = run_ranks(workers.collectives_of_a_load, 2, str(tmp_path / "ck"))
    for r in results:
        assert r["same"] == {"collectives": 3, "moved": 0, "general": 0}, r  # its shard is one column item
        assert r["reshard"]["moved"] > 0 and r["reshard"]["collectives"] > 3 and r["reshard"]["general"] > 0, r
