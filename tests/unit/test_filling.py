"""The write engine waits for staging that another process is still filling (engine/filling.py), given to it by the
storage writer (``staging_fill``, WRITES_WHILE_STAGING): a save started before the buffers are full writes the
bytes they end up holding, starts on the ones already filled, waits for the whole fill where its planner resolves
items one by one, and fails typed when the filling fails or stalls, even where this rank wrote nothing from it."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import distckpt
from distckpt.engine import filling


def _save_in_thread(state: dict, path: str, waits: filling.Filling, planner=None) -> dict:
    out: dict = {}
    writer = distckpt.FileSystemWriter(path)
    writer.staging_fill = waits

    def run() -> None:
        try:
            distckpt.save(state, storage_writer=writer, planner=planner, no_dist=True)
            out["done"] = time.monotonic()
        except BaseException as exc:  # noqa: BLE001 - looked at by the test
            out["error"] = exc

    out["thread"] = threading.Thread(target=run)
    out["thread"].start()
    return out


def test_a_save_writes_what_the_buffers_hold_once_filled(tmp_path):
    buffers = [torch.zeros(1 << 16), torch.zeros(1 << 16), torch.zeros(7, dtype=torch.int32)]
    state = {"a": buffers[0], "b": buffers[1][: 1 << 15], "c": buffers[2], "step": 3}
    counter = filling.new_counter()
    save = _save_in_thread(state, str(tmp_path / "ck"), filling.Filling(counter, buffers, timeout_s=60))
    time.sleep(0.3)
    assert save["thread"].is_alive() and not (tmp_path / "ck" / "metadata.json").exists()  # waiting for "a"
    buffers[0].fill_(1.0)
    filling.count(counter, 1)
    time.sleep(0.2)
    assert save["thread"].is_alive()
    buffers[1].fill_(2.0)
    buffers[2].fill_(3)
    filling.count(counter, 3)
    save["thread"].join(30)
    assert "error" not in save, save.get("error")
    out = {"a": torch.empty(1 << 16), "b": torch.empty(1 << 15), "c": torch.empty(7, dtype=torch.int32), "step": 0}
    distckpt.load(out, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert bool((out["a"] == 1).all()) and bool((out["b"] == 2).all()) and bool((out["c"] == 3).all())
    assert out["step"] == 3


class _Doubling(distckpt.DefaultSavePlanner):
    """Stores every tensor doubled (DCP's transform_object hook): the items are made from the staged tensors."""

    def transform_object(self, write_item, object):
        return object * 2 if isinstance(object, torch.Tensor) else object


def test_a_planner_that_transforms_tensors_waits_for_the_whole_fill(tmp_path):
    buffers = [torch.zeros(256), torch.zeros(256)]
    counter = filling.new_counter()
    save = _save_in_thread({"a": buffers[0], "b": buffers[1]}, str(tmp_path / "ck"),
                           filling.Filling(counter, buffers, timeout_s=60), planner=_Doubling())
    buffers[0].fill_(1.0)
    filling.count(counter, 1)
    time.sleep(0.3)
    assert save["thread"].is_alive()  # "a" is filled, but the transform of any item may read any buffer
    buffers[1].fill_(3.0)
    filling.count(counter, 2)
    save["thread"].join(30)
    assert "error" not in save, save.get("error")
    out = {"a": torch.empty(256), "b": torch.empty(256)}
    distckpt.load(out, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert bool((out["a"] == 2).all()) and bool((out["b"] == 6).all())


def test_a_copy_that_fails_where_this_rank_wrote_nothing_staged_still_fails_the_save(tmp_path):
    counter = filling.new_counter()
    elsewhere = [torch.zeros(64)]  # staging this rank's plan does not write from
    save = _save_in_thread({"step": 3}, str(tmp_path / "ck"), filling.Filling(counter, elsewhere, timeout_s=60))
    time.sleep(0.3)
    assert save["thread"].is_alive()
    filling.fail(counter)
    save["thread"].join(30)
    assert isinstance(save.get("error"), distckpt.CheckpointError) and not (tmp_path / "ck" / "metadata.json").exists()


def test_a_failed_filling_fails_the_save_typed_and_commits_nothing(tmp_path):
    buffers = [torch.zeros(1024), torch.zeros(1024)]
    counter = filling.new_counter()
    save = _save_in_thread({"a": buffers[0], "b": buffers[1]}, str(tmp_path / "ck"),
                           filling.Filling(counter, buffers, timeout_s=60))
    filling.count(counter, 1)
    filling.fail(counter)
    save["thread"].join(30)
    assert isinstance(save.get("error"), distckpt.CheckpointError), save
    assert "could not copy" in str(save["error"]) and not (tmp_path / "ck" / "metadata.json").exists()


def test_a_filling_that_stalls_fails_after_the_timeout(tmp_path):
    buffers = [torch.zeros(1024)]
    save = _save_in_thread({"a": buffers[0]}, str(tmp_path / "ck"),
                           filling.Filling(filling.new_counter(), buffers, timeout_s=0.5))
    save["thread"].join(30)
    assert isinstance(save.get("error"), distckpt.CheckpointError) and "DISTCKPT_TIMEOUT_S" in str(save["error"])


@pytest.mark.parametrize("n", [0, 1])
def test_tensors_outside_the_buffers_and_empty_ones_never_wait(tmp_path, n):
    buffers = [torch.zeros(16), torch.zeros(0)]
    counter = filling.new_counter()
    filling.count(counter, n)
    waits = filling.Filling(counter, buffers, timeout_s=0.2)
    waits.wait(torch.ones(4))  # not staged memory
    waits.wait(buffers[1])  # no bytes
    if n:
        waits.wait(buffers[0][3:])
    else:
        with pytest.raises(distckpt.CheckpointError):
            waits.wait(buffers[0][3:])
