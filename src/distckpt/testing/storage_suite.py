"""The storage test suite: every backend subclasses :class:`StorageSuite` and passes it.

A backend's test module provides how to name a fresh checkpoint and, for
backends outside distckpt, which writer and reader to use::

    class TestMyStore(StorageSuite):
        def checkpoint_id(self, tmp_path, name):
            return f"mystore://bucket/{tmp_path.name}/{name}"

The tests use only the public API and the protocol's StorageWriter/StorageReader.
"""

from __future__ import annotations

import pytest
import torch

from .. import CheckpointError, CheckpointNotFoundError, DefaultLoadPlanner, load, read_metadata, save, verify
from ..backends import reader_for, writer_for
from ..faults import Fault, inject
from ..storage import StorageReader, StorageWriter

__all__ = ["StorageSuite"]


class StorageSuite:
    """Behaviour every storage backend must have. Subclass and implement ``checkpoint_id``."""

    def checkpoint_id(self, tmp_path, name: str):
        raise NotImplementedError

    def writer(self, checkpoint_id) -> StorageWriter:
        return writer_for(checkpoint_id)

    def reader(self, checkpoint_id) -> StorageReader:
        return reader_for(checkpoint_id)

    def _state(self):
        g = torch.Generator().manual_seed(7)
        return {
            "f32": torch.randn(33, 17, generator=g),
            "bf16": torch.randn(5, generator=g).to(torch.bfloat16),
            "i64": torch.arange(-3, 40),
            "mask": torch.randn(4, 4, generator=g) > 0,
            "zerod": torch.tensor(1.5),
            "empty": torch.empty(0, 3),
            "nested": {"step": 12, "name": "run", "blob": b"\x00\x01", "xs": [1.0, None]},
        }

    def test_round_trip_is_bit_exact(self, tmp_path):
        cid = self.checkpoint_id(tmp_path, "a")
        sd = self._state()
        save(sd, storage_writer=self.writer(cid), checkpoint_id=cid)
        out = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else {kk: None for kk in v}) for k, v in sd.items()}
        load(out, storage_reader=self.reader(cid), checkpoint_id=cid)
        for k, v in sd.items():
            if isinstance(v, torch.Tensor):
                assert out[k].dtype == v.dtype and (v.numel() == 0 or torch.equal(out[k], v)), k
            else:
                assert out[k] == v

    def test_metadata_and_verify(self, tmp_path):
        cid = self.checkpoint_id(tmp_path, "b")
        save(self._state(), storage_writer=self.writer(cid), checkpoint_id=cid)
        md = read_metadata(cid, storage_reader=self.reader(cid))
        assert md.state_dict_metadata["f32"].size == torch.Size([33, 17])
        report = verify(cid, storage_reader=self.reader(cid))
        assert report.ok and report.items == len(md.state_dict_metadata)

    def test_missing_checkpoint_is_a_clear_error(self, tmp_path):
        cid = self.checkpoint_id(tmp_path, "never-saved")
        with pytest.raises(CheckpointNotFoundError):
            load({"f32": torch.zeros(1)}, storage_reader=self.reader(cid), checkpoint_id=cid)

    def test_committed_checkpoint_is_never_replaced_silently(self, tmp_path):
        cid = self.checkpoint_id(tmp_path, "c")
        save({"w": torch.ones(3)}, storage_writer=self.writer(cid), checkpoint_id=cid)
        with pytest.raises(CheckpointError, match="already exists"):
            save({"w": torch.zeros(3)}, storage_writer=self.writer(cid), checkpoint_id=cid)
        out = {"w": torch.zeros(3)}
        load(out, storage_reader=self.reader(cid), checkpoint_id=cid)
        assert torch.equal(out["w"], torch.ones(3))

    def test_failed_save_leaves_nothing_visible(self, tmp_path):
        cid = self.checkpoint_id(tmp_path, "d")
        with pytest.raises(CheckpointError):
            with inject(Fault("eio", kinds=("write",))):
                save({"w": torch.ones(3)}, storage_writer=self.writer(cid), checkpoint_id=cid)
        with pytest.raises(CheckpointNotFoundError):
            load({"w": torch.zeros(3)}, storage_reader=self.reader(cid), checkpoint_id=cid)

    def test_partial_load_and_key_errors(self, tmp_path):
        cid = self.checkpoint_id(tmp_path, "e")
        save(self._state(), storage_writer=self.writer(cid), checkpoint_id=cid)
        with pytest.raises(CheckpointError, match="'absent'"):
            load({"absent": torch.zeros(1)}, storage_reader=self.reader(cid), checkpoint_id=cid)
        out = {"i64": torch.zeros(43, dtype=torch.int64), "absent": torch.zeros(1)}
        load(out, storage_reader=self.reader(cid), checkpoint_id=cid, planner=DefaultLoadPlanner(allow_partial_load=True))
        assert torch.equal(out["i64"], torch.arange(-3, 40))
