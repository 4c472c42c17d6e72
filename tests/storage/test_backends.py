"""Every shipped backend passes the storage suite from distckpt.testing."""

import uuid

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
