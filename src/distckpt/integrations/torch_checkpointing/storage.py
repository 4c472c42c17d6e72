"""torch_checkpointing's ``StorageConfig`` and ``Storage`` for distckpt's stores: each call turns its path into
a URL and hands it to the local-disk side or the object-store side by scheme; ``metadata.pkl`` goes through
its JSON form on the way. The first file a storage writes logs one line (INFO, logger ``distckpt``): distckpt's
stores hold the checkpoints, where, and in which form (torch_checkpointing's log names its own backend only)."""

from __future__ import annotations

import errno
import io
import os
from dataclasses import dataclass
from typing import Optional

from ...extras import import_or_explain

import_or_explain("torch_checkpointing", "distckpt.integrations.torch_checkpointing", "torch-checkpointing")

from torch_checkpointing.storage.base_storage import ReadArgs, Storage, StorageConfig

from ...backends.schemes import scheme_of
from ...errors import CheckpointError, CorruptCheckpointError
from ..announce import announce
from .checksums import BlockCrcs, VerifyingReader
from .local import LocalNamespace
from .metadata_json import metadata_to_json, metadata_to_pickle
from .objects import ObjectNamespace
from .paths import CRC_SUFFIX, METADATA_PKL, is_local, split_url, to_url


@dataclass
class DistckptStorageConfig(StorageConfig):
    """torch_checkpointing's ``storage_config`` for distckpt's stores.

    ``block_bytes``: bytes per CRC-32C block (a power of two; torch_checkpointing's parallel fills read 64 MiB
    ranges, so blocks up to that size are never read twice). ``verify``: check CRCs on read. ``sync``: make
    files and renames durable (fsync) before returning. ``pickled_metadata``: store ``metadata.pkl`` as the
    pickle torch_checkpointing made (only for metadata holding objects other than plain data: trusted
    checkpoints only), and read a pickled one written by another backend.
    """

    block_bytes: int = 1 << 20
    verify: bool = True
    sync: bool = True
    pickled_metadata: bool = False

    def __post_init__(self) -> None:
        if self.block_bytes < 4096 or self.block_bytes & (self.block_bytes - 1):
            raise CheckpointError(f"block_bytes={self.block_bytes}: a power of two of at least 4096 bytes")

    def create_storage(self) -> "DistckptStorage":
        return DistckptStorage(self)

class DistckptStorage(Storage):
    """torch_checkpointing's ``Storage`` on distckpt's stores; see the package's docstring."""

    def __init__(self, config: Optional[DistckptStorageConfig] = None):
        self.config = config or DistckptStorageConfig()
        self._local = LocalNamespace(self.config)
        self._objects = ObjectNamespace(self.config)
        self._announced = False

    def _ns(self, url: str):
        return self._local if is_local(url) else self._objects

    # -- writes

    def _announce(self, url: str) -> None:
        if self._announced:
            return
        self._announced = True  # a second thread's write racing past this logs the line twice, at worst
        metadata = "pickled, as torch_checkpointing made it" if self.config.pickled_metadata else "as JSON, never a pickle"
        announce("torch_checkpointing", f"{split_url(url)[0]} (the first checkpoint's directory, before its commit)",
                 f"torch_checkpointing's layout through distckpt's stores: each file with a CRC-32C per "
                 f"{self.config.block_bytes} bytes in a .<name>{CRC_SUFFIX} sidecar, {METADATA_PKL} {metadata}")

    def stream_write(self, path) -> io.IOBase:
        url = to_url(path)
        self._announce(url)
        return self._ns(url).create(url)

    def write(self, path, data) -> None:
        url = to_url(path)
        self._announce(url)
        view = memoryview(data).cast("B") if memoryview(data).c_contiguous else memoryview(bytes(memoryview(data)))
        if split_url(url)[1] == METADATA_PKL and not self.config.pickled_metadata:
            view = memoryview(metadata_to_json(bytes(view), url))
        with self._ns(url).create(url) as stream:
            stream.write(view)

    # -- reads

    def _reader(self, url: str) -> VerifyingReader:
        blob, side = self._ns(url).open(url)
        try:
            crcs = None
            if self.config.verify:
                if side is None:
                    raise CorruptCheckpointError(
                        f"{url} has no checksums (.{split_url(url)[1]}{CRC_SUFFIX} is missing): it was not written through "
                        "distckpt's storage, or its checksum file was lost; DistckptStorageConfig(verify=False) reads it unchecked")
                crcs = BlockCrcs.decode(side, url + " (its checksums)")
            return VerifyingReader(blob, crcs, url)
        except BaseException:
            blob.close()
            raise

    def stream_read(self, path, read_args: Optional[ReadArgs] = None) -> io.RawIOBase:
        url = to_url(path)
        if split_url(url)[1] == METADATA_PKL:
            return io.BytesIO(self.read(path, read_args))
        reader = self._reader(url)
        if read_args is not None and read_args.known_size_bytes is not None and read_args.known_size_bytes != reader.size:
            reader.close()
            raise CorruptCheckpointError(f"{url} holds {reader.size} bytes, not the {read_args.known_size_bytes} expected")
        return reader

    def read(self, path, read_args: Optional[ReadArgs] = None) -> bytes:
        url = to_url(path)
        with self._reader(url) as reader:
            raw = reader.readall()
        if split_url(url)[1] == METADATA_PKL:
            return metadata_to_pickle(raw, url, self.config.pickled_metadata)
        return raw

    def getsize(self, path) -> int:
        url = to_url(path)
        if split_url(url)[1] == METADATA_PKL:
            return len(self.read(path))
        with self._reader(url) as reader:
            return reader.size

    # -- names

    def exists(self, path) -> bool:
        url = to_url(path)
        return self._ns(url).exists(url)

    def isdir(self, path) -> bool:
        url = to_url(path)
        return self._ns(url).isdir(url)

    def ls(self, path) -> list[str]:
        url = to_url(path)
        return self._ns(url).ls(url)

    def mkdir(self, path, recursive: bool = True) -> None:
        url = to_url(path)
        self._ns(url).mkdir(url, recursive)

    def delete(self, path) -> None:
        url = to_url(path)
        self._ns(url).delete(url)

    def rmdir(self, path) -> None:
        url = to_url(path)
        self._ns(url).rmdir(url)

    def rename(self, src_path, dst_path, is_directory: bool = False, background_cleanup: bool = False) -> None:
        """torch_checkpointing's commit, exactly as the table of ``Storage.rename`` says (an occupied destination
        raises ``FileExistsError``, an ``OSError``); between stores of different schemes, refused."""
        src, dst = to_url(src_path), to_url(dst_path)
        if scheme_of(src) != scheme_of(dst):
            raise OSError(errno.EXDEV, f"cannot rename {src} to {dst}: different stores")
        if is_local(src):
            self._local.rename(src, dst)
        else:
            self._objects.rename(src, dst, background_cleanup)

    def glob(self, pattern: str) -> list[str]:
        import fnmatch

        directory, name = os.path.split(pattern)
        try:
            if not self.isdir(directory):
                return []
            return [os.path.join(directory, n) for n in fnmatch.filter(self.ls(directory), name)]
        except FileNotFoundError:
            return []

    def remap_path(self, path) -> str:
        return to_url(path)
