"""Storage backends: blob stores registered by the scheme of a checkpoint id, and the storage layer over any of them.

``memory://name`` selects the in-memory store, ``s3://bucket/prefix`` an S3-compatible object store, a plain
path (or ``file://``) the filesystem. A new object store is one :class:`ObjectClient` (a dozen primitives: put,
conditional create, get, head, list, delete, touch, a streaming writer and a reader) and one registration; the
commit, overwrite, retention, references, leases and cleanup of dead saves come from :class:`ObjectStore`::

    register_store("gs", lambda checkpoint_id: ObjectStore(GcsObjects(bucket_of(checkpoint_id)), prefix_of(checkpoint_id)))
    distckpt.save(state_dict, checkpoint_id="gs://bucket/run/step-100")

A store of another kind (the disk's directories and renames) implements :class:`BlobStore` itself.

:class:`BlobStorageWriter` and :class:`BlobStorageReader` write and read any store, given whole or by
checkpoint id; ``FileSystemWriter``, ``S3Writer``, ``MemoryWriter`` and their readers are the same with
their stores' options. A store passes the contract suite ``distckpt.testing.blob_store_suite.BlobStoreSuite``
(subclass it with ``make_store``; what the store does not declare in ``capabilities`` is skipped: :data:`RUNS`,
:data:`LEASES`, :data:`MAPS`), and the storage suite ``distckpt.testing.storage_suite.StorageSuite`` through
save and load.
"""

from __future__ import annotations

from ..capabilities import COLUMNAR_COMMIT, OVERWRITE, SHARED_VERIFICATION
from ..engine.blobs import LEASES, MAPS, RUNS, BlobReader, BlobStore, BlobWriter, BufferedWriter, BytesReader
from .azure import AzureStore  # noqa: F401 (registers az://, abfs://)
from .blob_storage import BlobStorageReader, BlobStorageWriter
from .dcp_reader import DCPReader
from .filesystem import FileSystemReader, FileSystemWriter
from .fsspec_store import FsspecReader, FsspecWriter
from .gcs import GcsStore  # noqa: F401 (registers gs://)
from .hf_reader import HuggingFaceReader
from .hf_writer import HuggingFaceWriter
from .memory import MemoryReader, MemoryWriter, clear_memory_store
from .objects import ObjectClient, ObjectInfo, ObjectStore, Upload
from .registry import check_options, pick_storage, reader_for, writer_for
from .s3 import S3Reader, S3Writer
from .schemes import StoreFactory, register_store, scheme_of, store_for, unregister_store
from .torch_save_file import TorchSaveReader

__all__ = [
    "BlobStore", "BlobWriter", "BlobReader", "BufferedWriter", "BytesReader", "RUNS", "LEASES", "MAPS",
    "COLUMNAR_COMMIT", "SHARED_VERIFICATION", "OVERWRITE",
    "register_store", "unregister_store", "store_for", "scheme_of", "StoreFactory",
    "BlobStorageWriter", "BlobStorageReader", "ObjectClient", "ObjectStore", "ObjectInfo", "Upload",
    "FileSystemWriter", "FileSystemReader", "DCPReader", "HuggingFaceReader", "HuggingFaceWriter", "TorchSaveReader",
    "MemoryWriter", "MemoryReader",
    "S3Writer", "S3Reader", "FsspecWriter", "FsspecReader",
    "clear_memory_store",
    "writer_for", "reader_for", "check_options", "pick_storage",
]
