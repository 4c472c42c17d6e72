"""Every shipped backend passes the storage suite from distckpt.testing."""

import uuid

import torch

import distckpt
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


def test_a_registered_store_is_picked_by_its_checkpoint_ids():
    """register_store: save and load resolve ids of the scheme through its factory, and reset re-targets."""
    import torch

    import distckpt
    from distckpt import backends

    used = []

    def team_store(checkpoint_id):
        used.append(checkpoint_id)
        return MemoryStore("team-" + checkpoint_id[len("team://"):])

    backends.register_store("team", team_store)
    try:
        distckpt.save({"w": torch.arange(3.0)}, checkpoint_id="team://run")
        out = {"w": torch.zeros(3)}
        distckpt.load(out, checkpoint_id="team://run")
        assert out["w"].tolist() == [0.0, 1.0, 2.0]
        assert used and set(used) == {"team://run"}
        plain = {"w": torch.zeros(3)}
        distckpt.load(plain, checkpoint_id="memory://team-run")  # the factory stored it where it said
        assert plain["w"].tolist() == [0.0, 1.0, 2.0]
        writer = backends.writer_for("team://run")
        assert type(writer) is backends.BlobStorageWriter
        writer.reset("team://other")
        assert writer.blob_store().name == "team-other"
    finally:
        backends.unregister_store("team")
        backends.clear_memory_store()


class TestFsBlobStore(BlobStoreSuite):
    def make_store(self, tmp_path, name):
        return FsStore(str(tmp_path / name))


class TestMemoryBlobStore(BlobStoreSuite):
    def make_store(self, tmp_path, name):
        return MemoryStore(f"{tmp_path.name}/{name}")


def test_an_object_store_writes_several_data_files_a_rank_where_a_disk_writes_its_threads(tmp_path, monkeypatch):
    """Writes to an object store wait on the network: a rank writes DISTCKPT_OBJECT_WRITE_STREAMS files at once (4 by
    default) whatever its CPU share; a disk writes as many as its I/O threads."""
    monkeypatch.setenv("DISTCKPT_MIN_FILE_BYTES", str(1 << 20))
    monkeypatch.setenv("DISTCKPT_IO_THREADS", "1")
    sd = {f"t{i}": torch.randn(1 << 18) for i in range(8)}  # 8 MiB

    def files(cid: str) -> int:
        distckpt.save(sd, checkpoint_id=cid, no_dist=True)
        out = {k: torch.empty_like(v) for k, v in sd.items()}
        distckpt.load(out, checkpoint_id=cid, no_dist=True)
        assert all(torch.equal(out[k], v) for k, v in sd.items())
        return len(distckpt.read_metadata(cid).storage_data.files)

    assert files(f"memory://streams-{uuid.uuid4().hex}") == 4
    assert files(str(tmp_path / "disk")) == 1
    monkeypatch.setenv("DISTCKPT_OBJECT_WRITE_STREAMS", "2")
    assert files(f"memory://streams-{uuid.uuid4().hex}") == 2
