"""The object-store side (``memory://``, ``s3://``, any store registered by scheme): directories as stores of
blobs, a directory rename committed as a save with its manifest."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import threading
import uuid
from typing import Optional

from ...backends.schemes import scheme_of, store_for
from ...engine.blobs import RUNS, BlobReader, BlobStore
from ...errors import CheckpointNotFoundError, CorruptCheckpointError
from ...format import METADATA_FILE
from ...format.json_text import parse_json
from .checksums import BlockCrcs, ChecksummingWriter
from .paths import DIR_MARKER, MANIFEST_FORMAT, is_hidden, occupied, sidecar_name, split_url
from .settings import Settings

_COPY_BYTES = 64 << 20


class ObjectNamespace:
    """Directories as stores of blobs; a renamed directory is a committed save of its destination's store.

    A directory is the store ``store_for(url)``: its files are blobs, with a marker blob from ``mkdir``. A
    rename of directory T onto D copies T's blobs into ``D.staging(save id)``, adds a manifest (the files and
    their sizes) as the staging store's metadata blob, and commits it with ``D.commit`` (S3: a conditional
    PUT; of two racing renames exactly one wins). Files of a committed D are read from ``D.data_store``.
    """

    def __init__(self, config: Settings):
        self.config = config
        self._manifests: dict[str, dict] = {}
        self._lock = threading.Lock()

    # -- committed directories

    def _manifest(self, url: str) -> Optional[dict]:
        with self._lock:
            if url in self._manifests:
                return self._manifests[url]
        if "/" not in url.partition("://")[2]:
            return None  # a bucket or a name alone: no checkpoint there
        try:
            store = store_for(url)
            if not store.exists(METADATA_FILE):
                return None
            blob = store.open(METADATA_FILE)
        except CheckpointNotFoundError:
            return None
        try:
            raw = blob.pread(blob.size, 0)
        finally:
            blob.close()
        doc = parse_json(raw, f"{url}/{METADATA_FILE}")
        if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
            raise CorruptCheckpointError(f"{url} holds a checkpoint distckpt wrote itself, not torch_checkpointing's; "
                                         "load it with distckpt.load")
        files, save_id = doc.get("files"), doc.get("save_id")
        if doc.get("version") != 1 or not isinstance(files, dict) or not isinstance(save_id, str) or \
                not all(isinstance(k, str) and type(v) is int and v >= 0 for k, v in files.items()):
            raise CorruptCheckpointError(f"{url}/{METADATA_FILE}: not a manifest of version 1 with files and a save id")
        with self._lock:
            self._manifests[url] = doc
        return doc

    def _committed_home(self, url: str) -> Optional[tuple[str, dict, str]]:
        """(the committed directory holding ``url``, its manifest, ``url`` relative to it), or None."""
        parent = url
        while "://" in parent and "/" in parent.partition("://")[2]:
            parent, _ = split_url(parent)
            manifest = self._manifest(parent)
            if manifest is not None:
                return parent, manifest, url[len(parent) + 1:]
        return None

    # -- files

    def create(self, url: str) -> ChecksummingWriter:
        parent, name = split_url(url)
        if self._committed_home(url) is not None or self._manifest(url) is not None:
            raise FileExistsError(errno.EEXIST, f"{url} is inside a committed checkpoint, which is never written to "
                                                "again; write into a new directory and rename it", url)
        if self._isdir(url):
            raise IsADirectoryError(errno.EISDIR, f"{url} is a directory", url)
        store = store_for(parent)
        blob = store.create(name)

        def finish(crcs: Optional[BlockCrcs]) -> None:
            if crcs is not None:
                blob.close(self.config.sync)
                store.put_atomic(sidecar_name(name), crcs.encode(), self.config.sync)

        return ChecksummingWriter(blob, self.config.block_bytes, url, finish)

    def _locate(self, url: str) -> tuple[BlobStore, str]:
        home = self._committed_home(url)
        if home is not None:
            directory, manifest, rel = home
            if rel not in manifest["files"]:
                raise FileNotFoundError(errno.ENOENT, f"{url} is not a file of the committed checkpoint {directory}", url)
            return store_for(directory).data_store(manifest["save_id"]), rel
        parent, name = split_url(url)
        return store_for(parent), name

    def open(self, url: str) -> tuple[BlobReader, Optional[bytes]]:
        store, name = self._locate(url)
        try:
            blob = store.open(name)
        except CheckpointNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"{url} does not exist", url) from None
        try:
            side = store.open(sidecar_name(name))
        except CheckpointNotFoundError:
            return blob, None
        try:
            if side.size > 64 << 20:
                raise CorruptCheckpointError(f"{url}: its checksum file holds {side.size} bytes, more than distckpt writes")
            return blob, side.pread(side.size, 0)
        finally:
            side.close()

    def _is_file(self, url: str) -> bool:
        home = self._committed_home(url)
        if home is not None:
            return home[2] in home[1]["files"]
        parent, name = split_url(url)
        return "/" in parent.partition("://")[2] and store_for(parent).exists(name)

    # -- directories

    def _entries(self, url: str) -> list[str]:
        """What ``ls`` shows of directory ``url`` (its hidden blobs left out)."""
        manifest = self._manifest(url)
        if manifest is not None:
            return sorted({f.split("/", 1)[0] for f in manifest["files"]})
        home = self._committed_home(url)
        if home is not None:
            prefix = home[2] + "/"
            return sorted({f[len(prefix):].split("/", 1)[0] for f in home[1]["files"] if f.startswith(prefix)})
        store = store_for(url)
        names = {n.rstrip("/") for n in store.list()}
        if RUNS in store.capabilities:
            names.update(store.children())
        return sorted(n for n in names if n and not is_hidden(n) and "#tmp-" not in n)

    def _isdir(self, url: str) -> bool:
        if "/" not in url.partition("://")[2]:
            return True  # a bucket, or the top of memory://
        if self._manifest(url) is not None:
            return True
        home = self._committed_home(url)
        if home is not None:
            return any(f.startswith(home[2] + "/") for f in home[1]["files"])
        store = store_for(url)
        if any(True for _ in store.list()):
            return True
        return RUNS in store.capabilities and bool(store.children())

    def exists(self, url: str) -> bool:
        return self._isdir(url) or self._is_file(url)

    def isdir(self, url: str) -> bool:
        return self._isdir(url)

    def mkdir(self, url: str, recursive: bool) -> None:
        if self._is_file(url):
            raise FileExistsError(errno.EEXIST, f"{url} is a file", url)
        parent, _ = split_url(url)
        if not recursive and "/" in parent.partition("://")[2] and not self._isdir(parent):
            raise FileNotFoundError(errno.ENOENT, f"{parent} does not exist", parent)
        if self._manifest(url) is None and self._committed_home(url) is None:
            store = store_for(url)
            store.prepare()
            store.put_atomic(DIR_MARKER, b"", False)

    def ls(self, url: str) -> list[str]:
        if not self._isdir(url):
            raise FileNotFoundError(errno.ENOENT, f"{url} is not a directory", url)
        return self._entries(url)

    def delete(self, url: str) -> None:
        raise io.UnsupportedOperation(f"{url}: the store of {scheme_of(url)}:// deletes whole directories only (rmdir)")

    def rmdir(self, url: str) -> None:
        if not self._isdir(url):
            raise FileNotFoundError(errno.ENOENT, f"{url} is not a directory", url)
        if self._committed_home(url) is not None:
            raise io.UnsupportedOperation(f"{url} is inside a committed checkpoint; remove the whole checkpoint")
        self._remove_tree(url)

    def _remove_tree(self, url: str) -> None:
        store = store_for(url)
        if RUNS not in store.capabilities:
            raise io.UnsupportedOperation(f"the store of {url} cannot remove directories")
        if self._manifest(url) is None:
            for child in store.children():
                self._remove_tree(f"{url}/{child}")
        store.remove()
        with self._lock:
            self._manifests.pop(url, None)

    def rename(self, src: str, dst: str, background_cleanup: bool) -> None:
        if dst == src or dst.startswith(src + "/"):
            raise OSError(errno.EINVAL, f"cannot rename {src} to {dst}: a directory cannot be moved into itself")
        if self._is_file(src):
            raise io.UnsupportedOperation(f"{src}: the store of {scheme_of(src)}:// renames directories only")
        if not self._isdir(src):
            raise FileNotFoundError(errno.ENOENT, f"{src} does not exist", src)
        if self._committed_home(src) is not None:
            raise io.UnsupportedOperation(f"{src} is a directory inside a committed checkpoint, which is never changed; "
                                          "rename the whole checkpoint")
        if self._committed_home(dst) is not None:
            raise occupied(src, dst, errno.EEXIST)
        if self._is_file(dst):
            raise occupied(src, dst, errno.ENOTDIR)
        if self._manifest(dst) is not None or self._entries(dst):
            raise occupied(src, dst, errno.ENOTEMPTY)
        files = self._files_below(src)
        target = store_for(dst)
        save_id = uuid.uuid4().hex
        staging = target.staging(save_id)
        try:
            staging.prepare()
            sizes = {}
            for rel, store, name in files:
                sizes[rel] = self._copy(f"{src}/{rel}", store, name, rel, staging)
            manifest = {"format": MANIFEST_FORMAT, "version": 1, "save_id": save_id,
                        "files": {rel: size for rel, size in sizes.items() if not is_hidden(rel.rpartition("/")[2])}}
            staging.put_atomic(METADATA_FILE, json.dumps(manifest, separators=(",", ":")).encode(), self.config.sync)
        except BaseException:
            target.discard(staging)
            raise
        try:
            target.commit(staging, overwrite=False, sync=self.config.sync)
        except BaseException as exc:
            # Only a lost race is "occupied": another save's manifest is there now. A commit that landed before its
            # store failed (cleaning up after it) is a commit. Any other failure is itself, and this save's staged
            # copy goes (a store's discard also leaves a save that did commit alone).
            committed = None
            if isinstance(exc, Exception):
                with contextlib.suppress(Exception):
                    committed = self._manifest(dst)
            if committed is None or committed.get("save_id") != save_id:
                with contextlib.suppress(Exception):
                    target.discard(staging)
                if committed is not None:
                    raise occupied(src, dst, errno.EEXIST) from None
                if isinstance(exc, OSError) or not isinstance(exc, Exception):
                    raise
                raise OSError(errno.EIO, f"committing the rename of {src} to {dst} failed: {exc}; nothing was committed, "
                                         f"{src} is left as it was") from exc
        if background_cleanup:
            threading.Thread(target=self._remove_tree, args=(src,), daemon=True).start()
        else:
            self._remove_tree(src)

    def _files_below(self, url: str, rel: str = "") -> list[tuple[str, BlobStore, str]]:
        """Every file below directory ``url``, its checksum files included: (its name relative to ``url`` prefixed
        with ``rel``, the store holding it, its name there). A committed directory's files are those of its
        manifest, read from its save's data store (never its store's own objects: on S3 the manifest and the
        save area)."""
        out = {}
        manifest = self._manifest(url)
        if manifest is not None:
            data = store_for(url).data_store(manifest["save_id"])
            for name in manifest["files"]:
                out[rel + name] = (data, name)
                if data.exists(sidecar_name(name)):
                    out[rel + sidecar_name(name)] = (data, sidecar_name(name))
            return sorted((r, st, n) for r, (st, n) in out.items())
        store = store_for(url)
        for name in store.list():
            if name.endswith("/") or name == DIR_MARKER:
                continue
            out[rel + name] = (store, name)
        listed = sorted((r, st, n) for r, (st, n) in out.items())
        if RUNS in store.capabilities:
            for child in store.children():
                if "#tmp-" not in child:
                    listed.extend(self._files_below(f"{url}/{child}", f"{rel}{child}/"))
        return sorted(listed, key=lambda f: f[0])

    def _copy(self, where: str, store: BlobStore, name: str, rel: str, staging: BlobStore) -> int:
        src = where
        reader = store.open(name)
        try:
            writer = staging.create(rel)
            try:
                buf = bytearray(min(_COPY_BYTES, max(1, reader.size)))
                at = 0
                while at < reader.size:
                    view = memoryview(buf)[: min(len(buf), reader.size - at)]
                    got = reader.readinto(view, at)
                    if got != len(view):
                        raise CorruptCheckpointError(f"{src}: cut short at byte {at + got} while it was renamed")
                    writer.pwrite(view, at)
                    at += got
            except BaseException:
                writer.abort()
                raise
            writer.close(self.config.sync)
            return reader.size
        finally:
            reader.close()
