"""distckpt's stores as a storage backend of torch_checkpointing (``pip install torch-checkpointing``).

torch_checkpointing reads and writes through a small filesystem-like ``Storage`` interface. This package
implements it on the stores distckpt registers by scheme (:func:`distckpt.backends.store_for`)::

    from torch_checkpointing import CheckpointManager
    from distckpt.integrations.torch_checkpointing import DistckptStorageConfig

    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = DistckptStorageConfig()
    manager = config.build()
    manager.save("s3://bucket/run/step_100", state)     # or a path, or memory://run/step_100

What a checkpoint gains over torch_checkpointing's own local-filesystem backend:

- every file written (``stream_write``/``write``) carries a CRC-32C per block of ``block_bytes``, kept beside
  it in a small JSON sidecar (``.<name>.distckpt-crc``); every read (``stream_read``/``read``, whole or ranged,
  torch_checkpointing's parallel fills included) checks the blocks it touches and raises
  :class:`~distckpt.errors.CorruptCheckpointError` naming the file and byte range of a block that fails;
- ``metadata.pkl`` holds distckpt's tagged JSON, not a pickle (torch_checkpointing still calls
  ``pickle.loads``: on bytes this backend made from that JSON, never on bytes from storage);
- the stores beyond local disk: ``memory://`` (one process) and ``s3://`` (and any store registered with
  :func:`distckpt.backends.register_store`). On an object store a directory rename, torch_checkpointing's
  commit, copies the temporary directory into a save area of the destination and commits it with one
  conditional PUT, so of two racing saves exactly one commits and a reader never sees half a checkpoint;
- on local disk: files are created exclusively under a hidden name and renamed into place, opened without
  following links, read only when regular, and directories are removed through descriptors (never through
  a link); every directory is reached one component at a time, a link on the way followed only where root or
  this user owns it (one another user planted is refused); a rename follows the table of ``Storage.rename``
  exactly, atomically (``renameat2``). A stream used after close or abort raises ValueError; a close after a
  failed write, or one that fails, commits nothing and leaves no hidden file.

Paths are torch_checkpointing's: a local path, or ``scheme://...`` (``pathlib.Path`` turns ``s3://b/x`` into
``s3:/b/x``; both spellings name the same place).
"""

from .storage import DistckptStorage, DistckptStorageConfig

__all__ = ["DistckptStorageConfig", "DistckptStorage"]
