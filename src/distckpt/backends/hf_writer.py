"""Publishing a Hugging Face checkpoint directory (safetensors shards, their index, ``config.json``) from a state
at any world size: every rank writes the rows it holds straight into their place in the shards. Nothing is gathered
on one rank, and no rank holds more than its own shards plus a bounded window of host copies.

The coordinator fixes the whole layout from the global shapes (:mod:`distckpt.layouts.hf_publish`), creates the
shards in a hidden staging directory beside the target (each with its header, at its final size), and every rank
then writes its chunks' byte runs with positional writes. The coordinator commits: it checks that every tensor is
covered and every shard is still the file it made, writes the index and ``config.json``, syncs, and renames the
directory into place. A publish that dies leaves only the hidden staging directory (and its lease), which
``from_pretrained`` never sees and a CheckpointManager's cleanup removes.
"""

from __future__ import annotations

import json
import os
import stat
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Optional, Union

import torch
from torch.futures import Future

from .. import faults, knobs
from ..engine.budget import ByteBudget
from ..engine.tensor_bytes import flat_bytes, host_tensor
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, UnsupportedTensorError
from ..format.dtypes import itemsize
from ..format.json_text import parse_json
from ..format.locations import check_cover, checked_chunk
from ..layouts.hf_publish import DEFAULT_MAX_SHARD_SIZE, INDEX_FILE, parse_size, plan_shards, runs
from ..metadata import BytesStorageMetadata, ChunkStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata
from ..planner import SavePlan, SavePlanner, WriteItemType
from ..planning.resharding import volume
from ..progress import Progress
from ..storage import StorageWriter, WriteResult
from .blob_storage import done
from .direct_io import pwrite_all
from .filesystem import FsStore, _io_error, _strip_file_scheme
from .fs_objects import create_exclusive, is_real_dir, open_regular
from .leases import Lease

__all__ = ["HuggingFaceWriter"]

CONFIG_FILE = "config.json"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class HuggingFaceWriter(StorageWriter):
    """Writes a directory that ``transformers``' ``from_pretrained`` and ``safetensors`` load unchanged.

    ``distckpt.save(get_model_state_dict(model), storage_writer=HuggingFaceWriter(path, config=model.config))``
    publishes from any world size (FSDP2, tensor parallel, one process): the shards are split by
    ``max_shard_size`` as ``save_pretrained`` splits them and each rank writes its own rows. Every key must be a
    tensor of a dtype safetensors stores; a checkpoint of training state (optimizer, step) is not a Hugging Face
    checkpoint: publish the model's state dict.

    Args:
        path: the directory to create (may also be given as ``checkpoint_id``). It must not exist, or be empty.
        max_shard_size: bytes of tensor data per shard, an int or a string such as "5GB" (save_pretrained's default).
        config: written as ``config.json``: a ``transformers`` config object (``to_json_string``), a dict, or the
            path of a ``config.json`` file or of a directory holding one.
        metadata: extra string entries for every shard header's ``__metadata__`` (``format`` is always "pt").
        sync_files: fsync the shards and the directory before the commit (default: the DISTCKPT_FSYNC knob).
        thread_count: writer threads per rank (default: the DISTCKPT_IO_THREADS knob).
        fqn_to_index_mapping: the shard (numbered from 1) of every tensor, instead of ``max_shard_size`` (DCP's
            HuggingFaceStorageWriter's option).
    """

    def __init__(self, path: Union[str, os.PathLike, None] = None, *, max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
                 config: Any = None, metadata: Optional[dict[str, str]] = None, sync_files: Optional[bool] = None,
                 thread_count: Optional[int] = None, fqn_to_index_mapping: Optional[dict[str, int]] = None):
        self.path = _strip(path)
        if fqn_to_index_mapping is not None and not isinstance(fqn_to_index_mapping, Mapping):
            raise CheckpointError(f"HuggingFaceWriter(fqn_to_index_mapping=...): a {type(fqn_to_index_mapping).__name__} is "
                                  "not a mapping of tensor names to shard numbers")
        self.fqn_to_index_mapping = dict(fqn_to_index_mapping) if fqn_to_index_mapping is not None else None
        self.max_shard_size = parse_size(max_shard_size)
        self.config_text = _config_text(config)
        if metadata is not None and not (isinstance(metadata, Mapping) and
                                         all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
            raise CheckpointError("HuggingFaceWriter(metadata=...): a safetensors header's __metadata__ maps strings to strings")
        if metadata is not None and metadata.get("format", "pt") != "pt":  # from_pretrained reads shards by it
            raise CheckpointError(f"HuggingFaceWriter(metadata=...): format {metadata['format']!r}; a PyTorch checkpoint's "
                                  "shards say format 'pt', and the writer writes it")
        self.metadata = dict(metadata or {})
        self.sync_files = sync_files
        self.thread_count = thread_count
        self.is_coordinator = True
        self.rank = 0
        self.save_id: Optional[str] = None
        self.committed_save_id: Optional[str] = None
        self._lease: Optional[Lease] = None

    # ------------------------------------------------------------ every rank

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        if checkpoint_id is not None:
            self.path = _strip(checkpoint_id)
        self.save_id = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        text = os.fspath(checkpoint_id)
        return isinstance(text, str) and text.startswith("hf://") and "://" not in text[len("hf://"):]

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self._final())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, rank: int = 0, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = rank
        if is_coordinator:
            _check_free(self._final())

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        values = [item.index.fqn for item in plan.items if item.type == WriteItemType.BYTE_IO]
        if values:
            shown = ", ".join(repr(k) for k in values[:5]) + (f" and {len(values) - 5} more" if len(values) > 5 else "")
            raise UnsupportedTensorError(
                f"cannot publish {self._final()!r} as a Hugging Face checkpoint: key(s) {shown} are not tensors, and "
                "safetensors holds tensors only. Publish the model's state dict (get_model_state_dict(model)), or "
                "leave the other keys out.")
        # the state dict's order, which decides the shards (as save_pretrained's): a dedup may move keys between ranks
        return replace(plan, storage_data={"order": list(dict.fromkeys(item.index.fqn for item in plan.items))})

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        tensors = _checked_chunks(plans, f"Hugging Face checkpoint {self._final()!r}")
        order = [fqn for plan in plans if isinstance(plan.storage_data, dict) for fqn in plan.storage_data.get("order", ())]
        tensors = {fqn: tensors[fqn] for fqn in dict.fromkeys(order + list(tensors)) if fqn in tensors}
        layout = plan_shards([(k, d, s) for k, (d, s) in tensors.items()], self.max_shard_size, self.metadata,
                             self.fqn_to_index_mapping)
        self.layout = layout
        self.save_id = uuid.uuid4().hex
        store = FsStore(self._final())
        self._lease = Lease(store, self.save_id)  # before a byte exists: a cleaner must see this publish is alive
        staging = store.staging(self.save_id)
        staging.prepare()
        self._made = {"": _identity(os.lstat(staging.root))}  # what the commit renames, and every file in it
        for name, (header, size) in layout.files.items():
            self._made[name] = _create_shard(os.path.join(staging.root, name), header, size)
        out = []
        for plan in plans:
            mine = {item.index.fqn for item in plan.items}
            placement = {fqn: layout.placement[fqn] for fqn in mine}
            sizes = {layout.placement[fqn][0]: layout.files[layout.placement[fqn][0]][1] for fqn in mine}
            out.append(replace(plan, storage_data={"save_id": self.save_id, "placement": placement, "sizes": sizes}))
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        sd = plan.storage_data
        if not isinstance(sd, dict) or "placement" not in sd:
            raise CheckpointError("the save plan has no storage data from HuggingFaceWriter.prepare_global_plan; was the "
                                  "plan built by this writer?")
        self.save_id = sd["save_id"]
        staging = FsStore(self._final()).staging(self.save_id).root
        results = _RankPublish(staging, sd["placement"], sd["sizes"], plan, planner, self._sync(),
                               self.thread_count or knobs.io_threads(), self.is_coordinator, self.rank).run()
        return done(results)

    # ------------------------------------------------------------ coordinator

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        final = self._final()
        where = f"Hugging Face checkpoint {final!r}"
        for fqn, entry in metadata.state_dict_metadata.items():  # whatever planner made it: never publish a gap
            if isinstance(entry, BytesStorageMetadata):
                raise UnsupportedTensorError(f"{where}: key {fqn!r} is not a tensor; safetensors holds tensors only")
            if isinstance(entry, TensorStorageMetadata):
                for c in entry.chunks:
                    checked_chunk(c, entry.size, f"{where}: key {fqn!r}")
                check_cover(entry.chunks, entry.size, f"{where}: key {fqn!r}")
        store = FsStore(final)
        staging = store.staging(self.save_id)
        found = staging.sizes()
        for name, (_, size) in self.layout.files.items():
            if found.get(name) != size:
                raise CorruptCheckpointError(
                    f"{staging.describe(name)} is {'missing' if name not in found else f'{found[name]} bytes, not {size}'} just "
                    f"before the commit of {where}; something else removed or changed this publish's files. Nothing was "
                    "committed: publish again.")
        if self.layout.index is not None:
            self._made[INDEX_FILE] = _write_new(os.path.join(staging.root, INDEX_FILE), self.layout.index, self._sync())
        if self.config_text is not None:
            self._made[CONFIG_FILE] = _write_new(os.path.join(staging.root, CONFIG_FILE), self.config_text.encode("utf-8"),
                                                 self._sync())
        if self._sync():
            for name in self.layout.files:
                _fsync_file(os.path.join(staging.root, name))
        _check_made(staging.root, self._made, where)  # sizes say nothing of a file put in the place of one made here
        store.commit(staging, overwrite=False, sync=self._sync())
        self.committed_save_id = self.save_id
        self._release_lease()

    def discard_incomplete(self) -> None:
        """Remove this publish's staging directory after a failed save (coordinator, best effort)."""
        if self.save_id and self.committed_save_id != self.save_id:
            try:
                store = FsStore(self._final())
                store.discard(store.staging(self.save_id))
            except (OSError, CheckpointError):
                pass
        self._release_lease()

    # ------------------------------------------------------------ helpers

    def _final(self) -> str:
        if not self.path:  # "" (or "hf://") is no directory: abspath would make it the working directory, replaced
            raise CheckpointError("HuggingFaceWriter has no path: pass checkpoint_id=, or HuggingFaceWriter(path)")
        return os.path.abspath(self.path)

    def _sync(self) -> bool:
        return knobs.fsync_enabled() if self.sync_files is None else bool(self.sync_files)

    def _release_lease(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            try:
                lease.release()
            except (OSError, CheckpointError):
                pass  # a lease left behind names a process that will be seen dead


def _strip(path: Union[str, os.PathLike, None]) -> Optional[str]:
    if path is None:
        return None
    if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str):
        raise CheckpointError(f"HuggingFaceWriter: a path is a str (or an os.PathLike of one), not {type(path).__name__}")
    text = _strip_file_scheme(path)
    text = text[len("hf://"):] if text.startswith("hf://") else text
    if "://" in text:  # s3://, gs://, hf://s3://...: made local, it would be a directory named "s3:" under the cwd
        raise CheckpointError(f"HuggingFaceWriter publishes to a local (or mounted) directory, not to {text!r}; publish to "
                              "a local path and upload it, or mount the bucket")
    return text


def _config_text(config: Any) -> Optional[str]:
    """The text of ``config.json`` from what the caller gave, checked to be a JSON object."""
    if config is None:
        return None
    if hasattr(config, "to_json_string"):  # a transformers PretrainedConfig, written as save_pretrained writes it
        text = config.to_json_string(use_diff=True)
        if not isinstance(text, str):
            raise CheckpointError(f"HuggingFaceWriter(config=...): {type(config).__name__}.to_json_string() gave a "
                                  f"{type(text).__name__}, not the text of config.json")
    elif isinstance(config, dict):
        try:
            text = json.dumps(config, indent=2, sort_keys=True) + "\n"
        except (TypeError, ValueError, RecursionError) as exc:  # a dtype or tensor in it, keys of mixed types, a cycle
            raise CheckpointError(f"HuggingFaceWriter(config=...): the dict cannot be written as config.json ({exc}); "
                                  "give it plain JSON data (strings for dtypes), or a transformers config") from None
    elif isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if is_real_dir(path):
            path = os.path.join(path, CONFIG_FILE)
        try:
            fd = open_regular(path)
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(f"HuggingFaceWriter(config={os.fspath(config)!r}): {path} does not exist; pass "
                                          "the path of a config.json, or of the directory holding it") from None
        try:
            size = os.fstat(fd).st_size
            if size > knobs.max_metadata_bytes():
                raise CheckpointError(f"{path}: {size} bytes, over the cap of {knobs.max_metadata_bytes()} for a config "
                                      "(DISTCKPT_MAX_METADATA_BYTES)")
            raw = os.pread(fd, size, 0)
        finally:
            os.close(fd)
        try:
            text = raw.decode("utf-8", errors="strict")
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"HuggingFaceWriter(config={path!r}): not UTF-8 text, as config.json must be ({exc})") from None
    else:
        raise CheckpointError(f"HuggingFaceWriter(config=...): a {type(config).__name__} is not a config; pass a transformers "
                              "config, a dict, or the path of a config.json")
    try:
        doc = parse_json(text, "HuggingFaceWriter(config=...)")  # bounded: nesting too deep is an error, not a crash
    except CorruptCheckpointError as exc:
        raise CheckpointError(f"HuggingFaceWriter(config=...): not a JSON document ({exc})") from None
    if not isinstance(doc, dict):
        raise CheckpointError("HuggingFaceWriter(config=...): config.json must hold a JSON object")
    return text


def _check_free(final: str) -> None:
    """A publish commits by renaming a whole directory into place: the target must be free or an empty directory."""
    if not os.path.lexists(final):
        return
    if not is_real_dir(final):
        raise CheckpointError(f"cannot publish to {final!r}: it exists and is not a directory (a file or a link); "
                              "publish to a new path")
    names = sorted(os.listdir(final))
    if names:
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise CheckpointError(f"cannot publish to {final!r}: the directory holds files ({shown}). A publish puts a whole "
                              "directory in place and never mixes its files with others, nor replaces them; publish to a "
                              "new or empty directory.")


def _create_shard(path: str, header: bytes, size: int) -> tuple[int, int]:
    """Create shard ``path`` at its final ``size`` with its header written (the ranks then write into it); its
    identity (device, inode)."""
    try:
        fd = create_exclusive(path)
        try:
            faults.point("write", path)
            pwrite_all(fd, [memoryview(header)], 0)
            os.ftruncate(fd, size)
            return _identity(os.fstat(fd))
        finally:
            os.close(fd)
    except OSError as exc:
        raise _io_error("creating", path, exc) from exc


def _write_new(path: str, data: bytes, sync: bool) -> tuple[int, int]:
    try:
        fd = create_exclusive(path)
        try:
            faults.point("write", path)
            pwrite_all(fd, [memoryview(data)], 0)
            if sync:
                faults.point("fsync", path)
                os.fsync(fd)
            return _identity(os.fstat(fd))
        finally:
            os.close(fd)
    except OSError as exc:
        raise _io_error("writing", path, exc) from exc


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _check_made(root: str, made: dict[str, tuple[int, int]], where: str) -> None:
    """Just before the commit: the staging directory and every file in it are the very ones this publish made
    (``made``: name -> identity, "" for the directory), not a link or a file of the same size put in their place."""
    for name, identity in made.items():
        path = os.path.join(root, name) if name else root
        try:
            st = os.lstat(path)
        except OSError:
            st = None
        kind = stat.S_ISDIR if not name else stat.S_ISREG
        if st is None or not kind(st.st_mode) or _identity(st) != identity:
            raise CorruptCheckpointError(
                f"{path} is not the {'staging directory' if not name else 'file'} this publish made (something else "
                f"replaced it) just before the commit of {where}. Nothing was committed: publish again.")


def _checked_chunks(plans: list[SavePlan], where: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Each tensor's (dtype, global shape) from the ranks' plans, once every rank's chunks of it are known to agree
    on both, to lie inside it, and to cover it exactly once (replicas: one box held alike). The writer writes every
    item it is given in place, so a chunk the metadata does not record (another rank's at the same offsets) would
    still land over its neighbours' bytes: checked here, on the items themselves, before a byte is written."""
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    boxes: dict[str, dict[tuple, tuple]] = {}
    for plan in plans:
        for item in plan.items:
            td = item.tensor_data
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO or td is None:
                raise UnsupportedTensorError(f"key {fqn!r} is not a tensor; safetensors holds tensors only")
            here = (td.properties.dtype, tuple(td.size))
            first = tensors.setdefault(fqn, here)
            if first != here:
                raise CheckpointError(f"cannot publish {where}: key {fqn!r} is a {first[0]} tensor of size {list(first[1])} "
                                      f"on one rank and a {here[0]} tensor of size {list(here[1])} on another")
            offsets, sizes = tuple(td.chunk.offsets), tuple(td.chunk.sizes)
            if any(n < 0 for n in offsets + sizes):
                raise CheckpointError(f"cannot publish {where}: key {fqn!r}: chunk {list(offsets)}+{list(sizes)} is negative")
            try:
                checked_chunk(td.chunk, td.size, f"key {fqn!r}")
            except CorruptCheckpointError as exc:
                raise CheckpointError(f"cannot publish {where}: {exc}") from None
            held = boxes.setdefault(fqn, {})
            other = held.setdefault(offsets, sizes)
            if other != sizes:
                raise CheckpointError(
                    f"cannot publish {where}: key {fqn!r}: ranks write chunks {list(offsets)}+{list(other)} and "
                    f"{list(offsets)}+{list(sizes)}, which overlap (do the ranks agree on the tensor's placement?); "
                    "nothing was written")
    for fqn, held in boxes.items():
        chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n in held.items()]
        try:
            check_cover(chunks, torch.Size(tensors[fqn][1]), f"key {fqn!r}")
        except CorruptCheckpointError as exc:
            raise CheckpointError(f"cannot publish {where}: the ranks' chunks of {str(exc).split(' It was')[0]} (do the "
                                  "ranks agree on the tensor's placement?); nothing was written") from None
    return tensors


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
    try:
        faults.point("fsync", path)
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_shard(path: str, size: int) -> int:
    """The shard the coordinator created, opened for writing: a regular file of its planned size, never a link."""
    try:
        fd = os.open(path, os.O_WRONLY | _NOFOLLOW | _CLOEXEC)
    except OSError as exc:
        raise _io_error("opening", path, exc) from exc
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        os.close(fd)
        raise CorruptCheckpointError(f"{path} is not the shard this publish created (not a regular file of {size} bytes); "
                                     "something else changed the staging directory. Nothing was committed: publish again.")
    return fd


class _RankPublish:
    """One rank's part of a publish: each item's bytes into its runs of its shard, from several threads."""

    def __init__(self, staging: str, placement: dict, sizes: dict, plan: SavePlan, planner: SavePlanner, sync: bool,
                 threads: int, is_coordinator: bool, rank: int = 0):
        self.staging, self.placement, self.sizes, self.rank = staging, placement, sizes, rank
        self.plan, self.planner, self.sync, self.threads = plan, planner, sync, max(1, threads)
        self.items = list(plan.items)
        self.nbytes = [_item_bytes(item) for item in self.items]
        self.budget = ByteBudget(knobs.memory_budget_bytes())
        self.progress = Progress("publish", sum(self.nbytes), is_coordinator)
        self.fds: dict[str, int] = {}

    def run(self) -> list[WriteResult]:
        try:
            for name in sorted({self.placement[item.index.fqn][0] for item in self.items}):
                path = os.path.join(self.staging, name)
                self.fds[name] = _open_shard(path, self.sizes[name])
            order = self.order()
            if self.threads == 1 or len(order) < 2:
                for i in order:
                    self.write_item(i)
            else:
                with ThreadPoolExecutor(min(self.threads, len(order)), thread_name_prefix="distckpt-publish") as pool:
                    for f in [pool.submit(self.write_item, i) for i in order]:
                        f.result()
            if self.sync:
                for name, fd in self.fds.items():
                    faults.point("fsync", name)
                    os.fsync(fd)
        except OSError as exc:
            raise _io_error("writing into", self.staging, exc) from exc
        finally:
            for fd in self.fds.values():
                os.close(fd)
            self.progress.close()
        return [WriteResult(item.index, n, self.placement[item.index.fqn]) for item, n in zip(self.items, self.nbytes)]

    def order(self) -> list[int]:
        """The items in the order this rank's threads take them: one shard after another, round robin, starting at
        a shard of this rank's own, so that the threads of all ranks start in different files (a file takes one
        writer at a time on many file systems); within a shard, largest first, so the threads finish together."""
        by_file: dict[str, list[int]] = {}
        for i in sorted(range(len(self.items)), key=lambda i: -self.nbytes[i]):
            by_file.setdefault(self.placement[self.items[i].index.fqn][0], []).append(i)
        files = sorted(by_file)
        if not files:
            return []
        start = (self.rank * self.threads) % len(files)
        queues = [by_file[f] for f in files[start:] + files[:start]]
        out: list[int] = []
        while queues:
            out += [q.pop(0) for q in queues]
            queues = [q for q in queues if q]
        return out

    def write_item(self, i: int) -> None:
        item = self.items[i]
        td = item.tensor_data
        fqn = item.index.fqn
        name, base = self.placement[fqn]
        fd, path = self.fds[name], os.path.join(self.staging, name)
        tensor = self.planner.resolve_data(item)
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"resolve_data for tensor item {fqn!r} returned {type(tensor).__name__}")
        dtype, global_shape = td.properties.dtype, tuple(td.size)
        checked_chunk(td.chunk, td.size, f"key {fqn!r}")  # a chunk outside its tensor would write over another's bytes
        offsets, sizes = tuple(td.chunk.offsets), tuple(td.chunk.sizes)
        if tuple(tensor.shape) != sizes:
            raise CheckpointError(f"key {fqn!r}: resolve_data returned shape {tuple(tensor.shape)}, the plan expects {sizes}")
        width = itemsize(dtype)
        if not sizes or tensor.numel() == 0:
            self.write_block(fd, path, base, global_shape, offsets, sizes, width, tensor, dtype)
            return
        rows_per_block = max(1, knobs.hf_copy_block_bytes() // max(1, tensor[0].numel() * width))
        direct = tensor.dtype == dtype and tensor.is_cpu and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()
        if direct:
            rows_per_block = sizes[0]
        for r0 in range(0, sizes[0], rows_per_block):
            r1 = min(sizes[0], r0 + rows_per_block)
            block = tensor[r0:r1]
            self.write_block(fd, path, base, global_shape, (offsets[0] + r0,) + offsets[1:], (r1 - r0,) + sizes[1:], width,
                             block, dtype)

    def write_block(self, fd: int, path: str, base: int, global_shape: tuple, offsets: tuple, sizes: tuple, width: int,
                    block: torch.Tensor, dtype: torch.dtype) -> None:
        held = 0
        direct = block.dtype == dtype and block.is_cpu and block.is_contiguous() and not block.is_conj() and not block.is_neg()
        if not direct:
            held = block.numel() * width
            self.budget.acquire(held)
        try:
            host = block.detach() if direct else host_tensor(block.detach().to(dtype))
            if dtype == torch.bool and host.numel() and bool(host.view(torch.uint8).gt(1).any()):
                host = host.view(torch.uint8).ne(0)  # bools stored as other bytes than 0 and 1: make them so
            data = flat_bytes(host)
            starts, length = runs(global_shape, offsets, sizes, width)
            at = 0
            for start in starts.tolist():
                faults.point("write", path)
                pwrite_all(fd, [data[at:at + length]], base + start)
                at += length
            self.progress.advance(len(data))
        finally:
            if held:
                self.budget.release(held)


def _item_bytes(item: Any) -> int:
    td = item.tensor_data
    return volume(td.chunk.sizes) * itemsize(td.properties.dtype)
