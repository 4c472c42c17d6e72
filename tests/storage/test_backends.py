"""Every shipped backend passes the storage suite from distckpt.testing."""

import uuid

from distckpt.backends.filesystem import FsStore
from distckpt.backends.memory import MemoryStore
from distckpt.testing.blob_store_suite import BlobStoreSuite
from distckpt.testing.storage_suite import StorageSuite


class TestFileSystem(StorageSuite):
    def checkpoint_id(self, tmp_path, name):
        return str(tmp_path / name)


class TestFileURL(StorageSuite):
    def checkpoint_id(self, tmp_path, name):
        return f"file://{tmp_path / name}"


class TestMemory(StorageSuite):
    def checkpoint_id(self, tmp_path, name):
        return f"memory://{uuid.uuid4().hex}-{name}"


def test_a_registered_backend_is_picked_by_its_checkpoint_ids():
    """register_backend: save and load choose the pair whose validate_checkpoint_id accepts the id."""
    import torch

    import distckpt
    from distckpt import backends
    from distckpt.backends import MemoryReader, MemoryWriter

    used = []

    def team_name(checkpoint_id):
        return "team-" + str(checkpoint_id)[len("team://"):]

    class TeamWriter(MemoryWriter):
        def reset(self, checkpoint_id=None):
            used.append("writer")
            super().reset(None if checkpoint_id is None else team_name(checkpoint_id))

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id):
            return str(checkpoint_id).startswith("team://")

    class TeamReader(MemoryReader):
        def reset(self, checkpoint_id=None):
            used.append("reader")
            super().reset(None if checkpoint_id is None else team_name(checkpoint_id))

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id):
            return str(checkpoint_id).startswith("team://")

    backends.register_backend(TeamWriter, TeamReader)
    try:
        distckpt.save({"w": torch.arange(3.0)}, checkpoint_id="team://run")
        out = {"w": torch.zeros(3)}
        distckpt.load(out, checkpoint_id="team://run")
        assert out["w"].tolist() == [0.0, 1.0, 2.0]
        assert "writer" in used and "reader" in used
        plain = {"w": torch.zeros(3)}
        distckpt.load(plain, checkpoint_id="memory://team-run")  # the pair stored it where its reset said
        assert plain["w"].tolist() == [0.0, 1.0, 2.0]
    finally:
        backends._BACKENDS.remove((TeamWriter, TeamReader))
        backends.clear_memory_store()


class TestFsBlobStore(BlobStoreSuite):
    def make_store(self, tmp_path, name):
        return FsStore(str(tmp_path / name))


class TestMemoryBlobStore(BlobStoreSuite):
    def make_store(self, tmp_path, name):
        return MemoryStore(f"{tmp_path.name}/{name}")
