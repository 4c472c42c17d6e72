from distckpt.testing import run_ranks

from . import workers


def test_repeated_saves_send_under_1kib_per_rank_and_changes_invalidate(tmp_path):
    results = run_ranks(workers.cached_plan_saves, 3, str(tmp_path))
    for rank, sizes in enumerate(results):
        first, second, third, changed = sizes
        assert first > 4096, sizes
        assert second <= 1024 and third <= 1024, f"rank {rank}: {sizes}"
        assert changed > 4096, f"rank {rank}: a changed state dict must re-plan: {sizes}"
