"""Fast paths follow what classes declare (distckpt.capabilities), not which methods a subclass left alone."""

import distckpt
from distckpt.capabilities import COLUMNAR_COMMIT, SHARED_VERIFICATION, declares, keeps_plans, plans_on_columns, supports
from distckpt.testing import run_ranks

from . import capability_workers as cw
from . import workers


def test_declarations_are_inherited_by_storage_and_follow_the_method_for_planners(tmp_path):
    assert supports(cw.LoggingWriter(str(tmp_path)), COLUMNAR_COMMIT)
    assert not supports(cw.PlainWriter(str(tmp_path)), COLUMNAR_COMMIT)
    assert supports(cw.LoggingReader(str(tmp_path)), SHARED_VERIFICATION)
    assert declares(distckpt.DefaultSavePlanner(), "create_global_plan", plans_on_columns)
    assert declares(cw.LoggingPlanner(), "create_global_plan", plans_on_columns)
    assert not declares(workers._ObjectPathPlanner(), "create_global_plan", plans_on_columns)
    assert declares(distckpt.DefaultLoadPlanner(), "create_global_plan", keeps_plans)
    assert not declares(cw.ChangingReader(str(tmp_path)), "prepare_global_plan", keeps_plans)
    assert declares(cw.DeclaredReader(str(tmp_path)), "prepare_global_plan", keeps_plans)


def _where(md):
    return {ix: (si.file, si.offset, si.length, si.crc32c) for ix, si in md.storage_data.items.items()}


def test_wrapping_subclasses_keep_the_columnar_save_and_a_withdrawn_capability_gives_the_same_checkpoint(tmp_path):
    res = run_ranks(cw.save_through_wrappers, 3, str(tmp_path))
    coordinator = res[0]
    for name in ("default", "logging_writer", "logging_planner"):
        assert coordinator[name]["columns"] == 1, (name, coordinator[name])
    assert coordinator["plain_writer"]["columns"] == 0
    # the wrapper saw its calls on every rank, and the commit went through its finish on the coordinator only
    assert coordinator["logging_writer"]["calls"] == ["write_data", "finish"]
    assert all(r["logging_writer"]["calls"] == ["write_data"] for r in res[1:])
    for r in res:
        assert r["default"]["planning_bytes"] < r["plain_writer"]["planning_bytes"], r
    want = distckpt.read_metadata(str(tmp_path / "default"))
    for name in ("logging_writer", "logging_planner", "plain_writer"):
        md = distckpt.read_metadata(str(tmp_path / name))
        assert md.state_dict_metadata == want.state_dict_metadata and md.planner_data == want.planner_data, name
        assert _where(md) == _where(want), name
        distckpt.verify(str(tmp_path / name))
    assert run_ranks(workers.load_all_layouts, 2, [str(tmp_path / n) for n in coordinator]) == [{}, {}]


def test_wrapping_readers_keep_plans_local_and_an_undeclared_global_step_moves_them(tmp_path):
    path = str(tmp_path / "ck")
    run_ranks(workers.save_all_layouts, 2, path)
    for r in run_ranks(cw.load_through_wrappers, 3, path):
        assert all(way["ok"] for way in r.values()), r
        assert r["logging"]["reads"] == 1
        assert r["default"]["whole"] > 0, r  # whole chunks went straight from the planner's columns, with shared verification on
        assert r["logging"]["moved"] == r["default"]["moved"] == r["declared"]["moved"], r
        # plans moved against the lists of chunks read that shared reads exchange (48 bytes a chunk and its plan back)
        assert r["changing"]["moved"] > 2 * r["default"]["moved"], r


def test_a_save_through_zstd_plans_travels_and_commits_on_columns_at_three_ranks(tmp_path):
    path = str(tmp_path / "ck")
    res = run_ranks(cw.save_through_zstd_on_columns, 3, path)
    assert res[0]["columns"] == 1
    assert all(r["wrong"] == [] and r["step"] == 5 for r in res), res
    md = distckpt.read_metadata(path)
    assert md.version == "2.1" and {si.codec for si in md.storage_data.items.values()} == {"stream.zstd/1"}
    distckpt.verify(path)
