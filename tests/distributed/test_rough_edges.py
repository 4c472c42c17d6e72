"""The rough edges a new user meets, each answered by a message that says what happened and what to do."""

import distckpt
from distckpt.testing import run_ranks

from . import rough_edge_workers as w


def test_rank_local_values_loaded_at_a_new_world_size_say_how_many_ranks_saved_them(tmp_path):
    path = str(tmp_path / "ck")
    run_ranks(w.save_rank_local, 2, path)
    texts = run_ranks(w.load_rank_local, 3, path)
    assert all(t is not None for t in texts), texts  # every rank fails the load alike
    text = texts[2]
    assert "'loader.pos@rank2'" in text and "RankLocal" in text, text
    assert "saved by 2 rank(s)" in text and "world size it was saved with" in text, text
    assert isinstance(distckpt.MissingKeyError("x"), distckpt.CheckpointError)
