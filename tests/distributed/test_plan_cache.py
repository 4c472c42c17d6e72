import pytest

from distckpt.testing import run_ranks

from . import workers


@pytest.mark.parametrize("object_path", [False, True], ids=["columns", "objects"])
def test_repeated_saves_send_under_1kib_per_rank_and_changes_invalidate(tmp_path, object_path):
    results = run_ranks(workers.cached_plan_saves, 3, str(tmp_path), object_path)
    # on columns, the coordinator planned for the first save and the changed one, and reused that plan between
    assert results[0][1] == ([] if object_path else [0, 3]) and all(planned == [] for _, planned in results[1:])
    for rank, (sizes, _) in enumerate(results):
        first, second, third, changed = sizes
        assert first > 4096, sizes
        assert second <= 1024 and third <= 1024, f"rank {rank}: {sizes}"
        assert changed > 4096, f"rank {rank}: a changed state dict must re-plan: {sizes}"
