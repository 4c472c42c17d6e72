"""The object-store lifecycle (backends/objects.py) tried as a stranger would: a metadata object whose tag is not a
save id, an empty name, a deletion or a tidy-up after a commit that the store refuses half-way, and a metadata
object far larger than the loader accepts. A client whose objects all look old makes every dead save's leftovers
removable at once, as on a bucket after a crash."""

from __future__ import annotations

import uuid

import pytest
import torch

import distckpt
from distckpt.backends import ObjectInfo, ObjectStore, register_store, unregister_store
from distckpt.backends.memory import MemoryObjects
from distckpt.errors import CheckpointError, StorageIOError
from tests.storage.test_toy_store import OBJECTS, ToyObjects


class OldObjects(ToyObjects):
    """The toy client, with every object written long ago, deletes that may fail, and the bytes it was asked for."""

    fail_delete = None  # keys -> whether to refuse this delete
    fetched = 0

    def url(self, key):
        return f"old://{key}"

    def head(self, key):
        info = super().head(key)
        return None if info is None else ObjectInfo(info.key, info.size, 1e6, info.tag)

    def list(self, prefix, delimiter=False):
        return [ObjectInfo(o.key, o.size, None if o.key.endswith("/") else 1e6, o.tag) for o in super().list(prefix, delimiter)]

    def get(self, key, limit=None):
        data = super().get(key, limit)
        type(self).fetched += len(data or b"")
        return data

    def delete(self, keys):
        if type(self).fail_delete is not None and type(self).fail_delete(keys):
            type(self).fail_delete = None
            raise StorageIOError(f"deleting {self.url(keys[0])} failed: refused (injected)")
        super().delete(keys)


@pytest.fixture(autouse=True)
def old_scheme():
    register_store("old", lambda cid: ObjectStore(OldObjects(), str(cid)[len("old://"):]))
    OldObjects.fail_delete = None
    yield
    unregister_store("old")


def _state(step):
    return {"w": torch.arange(16.0) + step, "step": step}


def _loads(path, step):
    out = {"w": torch.zeros(16), "step": -1}
    distckpt.load(out, checkpoint_id=path, no_dist=True)
    return torch.equal(out["w"], _state(step)["w"]) and out["step"] == step


def test_a_tag_that_is_no_save_id_is_read_from_the_document_and_cleanup_keeps_the_save():
    root = f"old://tag-{uuid.uuid4().hex[:8]}"
    mgr = distckpt.CheckpointManager(root, no_dist=True)
    mgr.save(1, _state(1))
    key = f"{root[len('old://'):]}/step-0000000001/metadata.json"
    data, _, version = OBJECTS[key]
    for tag in ("../../x", "", "a" * 65):
        OBJECTS[key] = (data, tag, version)
        distckpt.CheckpointManager(root, no_dist=True).remove_stale_temporaries()
        assert _loads(mgr.path(1), 1), tag


def test_an_empty_name_is_refused_with_an_example():
    with pytest.raises(CheckpointError, match="names no checkpoint"):
        distckpt.save(_state(1), checkpoint_id="memory://", no_dist=True)
    with pytest.raises(CheckpointError, match="names no checkpoint"):
        distckpt.CheckpointManager("memory://", no_dist=True).save(1, _state(1))
    assert MemoryObjects().list("saves/") == [] and MemoryObjects().head("/metadata.json") is None


def test_a_deletion_refused_half_way_leaves_what_the_next_cleanup_removes():
    root = f"old://rm-{uuid.uuid4().hex[:8]}"
    mgr = distckpt.CheckpointManager(root, keep_last=1, no_dist=True)
    mgr.save(1, _state(1))
    OldObjects.fail_delete = lambda keys: any("/data-" in k for k in keys)
    try:
        mgr.save(2, _state(2))  # retention removes step 1; the store refuses its data's delete
    except CheckpointError:
        pass
    assert mgr.all_steps() == [2] and _loads(mgr.path(2), 2)
    mgr.remove_stale_temporaries()  # the deletion's lease was given up: its leftovers are a dead holder's
    prefix = f"{root[len('old://'):]}/step-0000000001/"
    assert [k for k in OBJECTS if k.startswith(prefix)] == []


def test_a_tidy_up_refused_after_the_commit_fails_no_save():
    root = f"old://tidy-{uuid.uuid4().hex[:8]}"
    OldObjects.fail_delete = lambda keys: any(k.endswith("/metadata.json") and "/saves/" in k for k in keys)
    md = distckpt.save(_state(3), checkpoint_id=f"{root}/ckpt", no_dist=True)  # committed: the save stands
    assert OldObjects.fail_delete is None and _loads(f"{root}/ckpt", 3)
    assert distckpt.read_metadata(f"{root}/ckpt").storage_meta.save_id == md.storage_meta.save_id


def test_metadata_far_larger_than_the_loader_accepts_is_not_read_whole(monkeypatch):
    monkeypatch.setenv("DISTCKPT_MAX_METADATA_BYTES", str(1 << 20))
    root = f"old://big-{uuid.uuid4().hex[:8]}"
    big = b"{" + b" " * (50 << 20) + b"}"
    OBJECTS[f"{root[len('old://'):]}/step-0000000001/metadata.json"] = (big, None, 1)  # untagged: another tool wrote it
    OldObjects.fetched = 0
    mgr = distckpt.CheckpointManager(root, no_dist=True)
    with pytest.raises(CheckpointError):
        mgr.save(1, _state(1), storage_writer=distckpt.backends.writer_for(mgr.path(1), overwrite=True))
    assert OldObjects.fetched <= 4 << 20


def test_a_checkpoint_inside_another_checkpoints_layout_is_refused():
    root = f"old://inside-{uuid.uuid4().hex[:8]}"
    distckpt.save(_state(1), checkpoint_id=f"{root}/step-1", no_dist=True)
    for reserved in ("saves", "leases", "retired"):
        with pytest.raises(CheckpointError, match="inside the layout of checkpoint"):
            distckpt.save(_state(2), checkpoint_id=f"{root}/step-1/{reserved}/v1", no_dist=True)
    distckpt.save(_state(2), checkpoint_id=f"{root}/step-1/notes/v1", no_dist=True)  # any other name is the user's
    distckpt.CheckpointManager(root, no_dist=True).remove_stale_temporaries()
    assert _loads(f"{root}/step-1", 1) and _loads(f"{root}/step-1/notes/v1", 2)
