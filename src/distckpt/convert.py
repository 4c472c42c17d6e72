"""Conversion between distckpt checkpoints and other formats: torch.distributed.checkpoint
(DCP) directories, single safetensors files and torch.save files.

Every conversion runs in one process, without collectives (inside a multi-rank
job, call it on one rank), and holds the whole state in host memory: tensors come out whole (consolidated), whatever the sharding they
were saved with. This is the one module under src/ that uses DCP: it reads
and writes DCP's format through DCP itself.

DCP stores its metadata, and every non-tensor value, as pickles. :func:`from_dcp`
reads them as a load of a DCP directory does (:class:`distckpt.DCPReader`): the
metadata through an unpickler that resolves only DCP's metadata classes, tensors
and values through distckpt's torch.save archive reader (never ``torch.load``). Only metadata from a DCP
version that reader refuses needs ``trust_pickle=True`` (the command line's
``--trust-pickle``), and is then read by DCP itself: for checkpoints you trust.
The other direction unpickles nothing: distckpt's format is pickle-free.

Keys keep their names: the state is nested again as DCP recorded it, so a
nested state dict (``get_state_dict``'s layout, lists of param groups included)
loads from the converted checkpoint as it loaded from the original.

A safetensors file holds the tensors under their flat keys; non-tensor
values, which safetensors cannot hold, go as distckpt's pickle-free value
encoding (JSON) into the file's ``__metadata__`` under ``distckpt.values``,
and come back from there. A torch.save file is read by distckpt's archive
reader, which builds only tensors and plain data (never ``torch.load``); it
is written as one flat dict of keys to tensors and values.
"""

from __future__ import annotations

import json
import math
import os
import uuid
import warnings
from typing import Any, Callable, Optional, Union

import torch

from . import backends
from .backends import BlobStorageReader, DCPReader, HuggingFaceWriter
from .backends.fs_objects import create_exclusive, open_regular
from .errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from .format.dtypes import itemsize
from .format.json_text import parse_json
from .format.values import from_data, to_data
from .layouts.hf import HF_INDEX_SUFFIX, is_hf_directory
from .layouts.torch_save import load_torch_save
from .loading import load, read_metadata
from .metadata import TensorStorageMetadata
from .planning import DefaultLoadPlanner, DefaultSavePlanner
from .saving import save
from .streaming import StreamingSavePlanner

__all__ = ["from_dcp", "to_dcp", "from_safetensors", "to_safetensors", "from_torch_save", "to_torch_save", "to_hf", "from_hf",
           "dcp_to_torch_save", "torch_save_to_dcp", "read_whole"]

VALUES_KEY = "distckpt.values"

PathLike = Union[str, os.PathLike]


def _placeholders(entries: dict, tensor_type: type, where: str, stored: int) -> dict[str, Any]:
    """An empty tensor per stored tensor, None per stored value: what a load fills in.

    Nothing is allocated until the tensors' bytes are known to fit in the ``stored`` bytes of the
    data files: a metadata document claiming more than is stored is damaged or forged.
    """
    claimed = sum(math.prod(e.size) * itemsize(e.properties.dtype) for e in entries.values() if isinstance(e, tensor_type))
    if claimed > stored:
        raise CorruptCheckpointError(
            f"{where}: its metadata claims {claimed} bytes of tensors, but its data files hold {stored}; "
            "the checkpoint is damaged or its metadata was edited. Nothing was converted.")
    return {fqn: _empty(e.size, e.properties.dtype, f"{where}, key {fqn!r}") if isinstance(e, tensor_type) else None
            for fqn, e in entries.items()}


def _empty(size: Any, dtype: torch.dtype, where: str) -> torch.Tensor:
    """An uninitialised tensor of ``size``. One with no elements whose dimensions are so large that its row-major
    strides overflow 64 bits (``(0, 2**62, 2**62)``) gets strides of 1: it holds nothing, and torch makes it."""
    size = tuple(size)
    if _row_major_fits(size):
        return torch.empty(size, dtype=dtype)
    if math.prod(size) == 0:
        try:
            return torch.empty_strided(size, (1,) * len(size), dtype=dtype)
        except (RuntimeError, OverflowError, TypeError):  # torch counts elements left to right: (2**62, 2**62, 0)
            pass
    raise CorruptCheckpointError(f"{where}: shape {list(size)} cannot be a torch tensor (its element count or strides "
                                 "overflow 64 bits); the checkpoint is damaged or was written by another program. "
                                 "Nothing was converted.")


def _row_major_fits(size: tuple) -> bool:
    """Whether torch can make a tensor of ``size`` with row-major strides: what torch.empty and safetensors'
    readers (torch.frombuffer(...).reshape) need. Asked of the meta device, which allocates nothing."""
    try:
        torch.empty(size, device="meta")
    except (RuntimeError, OverflowError, TypeError, ValueError):
        return False
    return True


def _new_destination(dst: PathLike, kind: str) -> None:
    """Refuse at once, before anything is read, a destination that is already there (``kind``: "file" or
    "checkpoint"; a checkpoint may go into an empty directory)."""
    path = os.fspath(dst)
    if "://" in path:
        return  # an object store: the save itself refuses a committed checkpoint
    if kind == "checkpoint" and os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path):
        return
    if os.path.lexists(path):
        raise CheckpointError(f"{path} already exists; convert into a new {'file' if kind == 'file' else 'directory'}")


def from_dcp(src: PathLike, dst: PathLike, *, trust_pickle: bool = False, allow_pickle: bool = False,
             progress: Optional[Callable[[str], None]] = None) -> int:
    """Convert the DCP checkpoint ``src`` into a new distckpt checkpoint ``dst``; return the count of keys.

    The state is nested again as it was saved (DCP records each key's path), so keys keep their names
    and a state dict laid out as the original (``get_state_dict``'s, say) loads from ``dst`` as it
    loaded from ``src``. DCP's metadata is read by distckpt's restricted unpickler and its tensors and
    values by its torch.save archive reader (see :class:`distckpt.DCPReader`). Non-tensor values
    must be plain data unless ``allow_pickle`` (then they are stored pickled in distckpt too, and
    loading them needs the same opt-in). ``trust_pickle`` lets metadata the restricted unpickler
    refuses (from a newer DCP) be read by DCP itself: only for checkpoints you trust.
    """
    _new_destination(dst, "checkpoint")
    if not os.path.exists(os.path.join(os.fspath(src), ".metadata")):
        raise CheckpointNotFoundError(f"{src}: no DCP checkpoint there (its .metadata file is missing)")
    where = f"DCP checkpoint {os.fspath(src)}"
    try:
        md = DCPReader(os.fspath(src)).read_metadata()
        state = _read_whole(src, allow_pickle, progress, what="DCP checkpoint")
    except CorruptCheckpointError:
        if not trust_pickle:
            raise
        state, md = _read_dcp_trusting_pickle(src, where, progress)
    nested = _nest(state, md.planner_data if isinstance(md.planner_data, dict) else {})
    n = _write_distckpt(nested, dst, allow_pickle, progress)
    if progress and n != len(state):
        progress(f"the {len(state)} keys of the DCP checkpoint are {n} in distckpt's: it stores a list or dict of plain "
                 "values (an optimizer's param_groups) as one key, where DCP makes a key of each leaf")
    return n


def _read_dcp_trusting_pickle(src: PathLike, where: str, progress: Optional[Callable[[str], None]]) -> tuple[dict, Any]:
    """Every key of the DCP checkpoint ``src`` read by DCP itself (its unpickler runs unrestricted), and its metadata."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        md = dcp.FileSystemReader(os.fspath(src)).read_metadata()
        state = _placeholders(md.state_dict_metadata, dcp.metadata.TensorStorageMetadata, where, _dcp_stored_bytes(src))
        if progress:
            progress(f"reading {len(state)} keys from DCP checkpoint {src}")
        with warnings.catch_warnings():  # DCP warns that it runs in one process, which is the point here
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=os.fspath(src), no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's is a BaseException; pickle raises anything
        raise CorruptCheckpointError(f"{where} cannot be read (damaged, or not a DCP checkpoint): "
                                     f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}") from exc
    return state, md


def _dcp_stored_bytes(src: PathLike) -> int:
    """Bytes of DCP's data files in ``src``: what any of its tensors can hold at most."""
    total = 0
    with os.scandir(os.fspath(src)) as entries:
        for e in entries:
            if e.name.endswith(".distcp") and e.is_file(follow_symlinks=False):
                total += e.stat(follow_symlinks=False).st_size
    return total


def to_dcp(src: PathLike, dst: PathLike, *, allow_pickle: bool = False,
           progress: Optional[Callable[[str], None]] = None) -> int:
    """Convert the distckpt checkpoint ``src`` into a new DCP checkpoint ``dst``; return the count of keys.

    ``allow_pickle`` is needed only if ``src`` itself holds pickled values.
    """
    _new_destination(dst, "checkpoint")
    import torch.distributed.checkpoint as dcp

    if os.path.exists(dst) and os.listdir(dst):
        raise CheckpointError(f"{dst} exists and is not empty; convert into a new directory")
    state = _read_whole(src, allow_pickle, progress)
    if progress:
        progress(f"writing DCP checkpoint {dst}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=os.fspath(dst), no_dist=True)
    return len(state)


def _read_whole(src: PathLike, allow_pickle: bool, progress: Optional[Callable[[str], None]],
                what: str = "distckpt checkpoint", only: Optional[Callable[[str], bool]] = None) -> dict[str, Any]:
    """Every key of the checkpoint ``src`` (``what`` it is: distckpt's, or a program's distckpt reads), tensors whole,
    in this process; with ``only``, the keys it accepts."""
    md = read_metadata(src)
    reader = backends.reader_for(src)
    reader.reset(src)
    stored = sum(reader.data_file_sizes(md).values()) if isinstance(reader, BlobStorageReader) else math.inf
    entries = md.state_dict_metadata if only is None else {k: e for k, e in md.state_dict_metadata.items() if only(k)}
    state = _placeholders(entries, TensorStorageMetadata, f"checkpoint {os.fspath(src)}", stored)
    if progress:
        progress(f"reading {len(state)} keys from {what} {src}")
    load(state, checkpoint_id=src, planner=DefaultLoadPlanner(allow_pickle=allow_pickle), no_dist=True)
    return state


def _write_distckpt(state: dict, dst: PathLike, allow_pickle: bool, progress: Optional[Callable[[str], None]]) -> int:
    """Save ``state`` as the new distckpt checkpoint ``dst`` (never over a committed one); return its count of keys
    (as stored: a nested dict counts each of its leaves)."""
    if progress:
        progress(f"writing distckpt checkpoint {dst}")
    md = save(state, checkpoint_id=dst, planner=DefaultSavePlanner(allow_pickle=allow_pickle), no_dist=True)
    return len(md.state_dict_metadata)


def _write_new_file(dst: PathLike, write: Callable[[Any], None]) -> None:
    """Create the file ``dst`` through ``write(file)`` into a new temporary file and a link:
    never replaces anything, never leaves half a file, never writes through a link.

    The temporary file has an unpredictable name and is created exclusively (no link or file
    planted at its name is followed or reused); ``dst`` is made a second name of it only if
    nothing is there yet, and is checked to be that very file.
    """
    dst = os.fspath(dst)
    if os.path.lexists(dst):
        raise CheckpointError(f"{dst} already exists; convert into a new file")
    tmp = os.path.join(os.path.dirname(os.path.abspath(dst)), f".{os.path.basename(dst)}.distckpt-tmp-{uuid.uuid4().hex}")
    try:
        fd = create_exclusive(tmp)
    except FileExistsError:
        raise CheckpointError(f"{tmp}: something is already at the temporary file's name (planted?); nothing was written") from None
    try:
        with os.fdopen(fd, "wb", closefd=False) as f:
            write(f)
        try:
            os.link(tmp, dst, follow_symlinks=False)  # fails if dst appeared meanwhile
        except FileExistsError:
            raise CheckpointError(f"{dst} appeared while converting; convert into a new file") from None
        st, ours = os.lstat(dst), os.fstat(fd)
        if (st.st_dev, st.st_ino) != (ours.st_dev, ours.st_ino):  # the temporary name was swapped meanwhile
            os.unlink(dst)  # the name we just made, for something else
            raise CheckpointError(f"{dst}: the temporary file was replaced while converting; nothing was written")
    finally:
        os.close(fd)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def to_safetensors(src: PathLike, dst: PathLike, *, allow_pickle: bool = False,
                   progress: Optional[Callable[[str], None]] = None) -> int:
    """Consolidate the distckpt checkpoint ``src`` into one new safetensors file ``dst``; return the count of keys.

    Values that are not tensors are kept in the file's metadata (see the module text).
    """
    _new_destination(dst, "file")
    from safetensors.torch import save

    for k, e in read_metadata(src).state_dict_metadata.items():  # before reading anything
        if isinstance(e, TensorStorageMetadata) and math.prod(e.size) == 0 and not _row_major_fits(tuple(e.size)):
            raise CheckpointError(
                f"checkpoint {os.fspath(src)}, key {k!r}: shape {list(e.size)} has no elements, but its row-major "
                "strides overflow 64 bits, so no safetensors reader (torch, numpy) could make the tensor back. "
                "Convert to a torch.save file instead (`--to torch-save`), which keeps it, or give the tensor a "
                "smaller empty shape, such as (0,), and save again. Nothing was written.")
    state = _read_whole(src, allow_pickle, progress)
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    values = {k: to_data(v, allow_pickle=allow_pickle, where=f"key {k!r}") for k, v in state.items() if k not in tensors}
    metadata = {"format": "pt"}
    if values:
        metadata[VALUES_KEY] = json.dumps(values, separators=(",", ":"), allow_nan=False)
    if progress:
        progress(f"writing safetensors file {dst}")
    _write_new_file(dst, lambda f: f.write(save(tensors, metadata=metadata)))
    return len(state)


def to_hf(src: PathLike, dst: PathLike, *, max_shard_size: Union[int, str] = "5GB", config: Any = None,
          prefix: Optional[str] = None, progress: Optional[Callable[[str], None]] = None) -> int:
    """Publish the tensors of checkpoint ``src`` as the new Hugging Face directory ``dst`` (shards of at most
    ``max_shard_size``, their index, ``config.json`` from ``config``); return the count of tensors.

    One tensor is read at a time, as the writer asks for it: memory holds the tensors in flight, not the model.
    ``prefix`` picks the keys under it and drops it from their names (``"model."`` for a checkpoint of
    ``{"model": model.state_dict(), "optim": ...}``); without it every key must be a tensor.
    """
    _new_destination(dst, "checkpoint")
    sdm = read_metadata(src).state_dict_metadata
    keys = {k[len(prefix):]: k for k in sdm if k.startswith(prefix)} if prefix else {k: k for k in sdm}
    if not keys:
        raise CheckpointError(f"checkpoint {os.fspath(src)!r} has no key starting with {prefix!r}; nothing to publish")
    values = [k for k in keys.values() if not isinstance(sdm[k], TensorStorageMetadata)]
    if values:
        raise CheckpointError(
            f"checkpoint {os.fspath(src)!r}: key(s) {values[:5]} are not tensors, and a Hugging Face checkpoint holds "
            "tensors only; pick the model's keys with prefix= (the command line's --prefix), e.g. 'model.'")
    if progress:
        progress(f"publishing {len(keys)} tensors of {src} as Hugging Face checkpoint {dst}")
    save({}, storage_writer=HuggingFaceWriter(dst, max_shard_size=max_shard_size, config=config),
         planner=StreamingSavePlanner(src, keys), no_dist=True)
    return len(keys)


def from_hf(src: PathLike, dst: PathLike, *, progress: Optional[Callable[[str], None]] = None) -> int:
    """Convert the Hugging Face directory ``src`` (``save_pretrained``'s shards and index, or one
    ``model.safetensors``) into a new distckpt checkpoint ``dst``, one tensor at a time; return the count of keys.
    ``src`` may also be the directory's index (``<dir>/model.safetensors.index.json``): that index is read."""
    _new_destination(dst, "checkpoint")
    source, index = os.fspath(src), None
    if source.endswith(HF_INDEX_SUFFIX) and "://" not in source and not os.path.isdir(source):
        source, index = os.path.split(os.path.abspath(source))  # the file a user copies names the directory and its index
    if not is_hf_directory(source):
        raise CheckpointNotFoundError(f"{source}: not a Hugging Face checkpoint directory (no *.safetensors.index.json "
                                      "and no model.safetensors); pass the directory save_pretrained wrote, or its "
                                      "*.safetensors.index.json (one safetensors file converts with --from safetensors)")
    planner = StreamingSavePlanner(source if source.startswith("hf://") else f"hf://{source}",
                                   reader_options={} if index is None else {"index": index})
    if progress:
        progress(f"converting {len(planner.keys)} tensors of Hugging Face checkpoint {src} into {dst}")
    save({}, checkpoint_id=dst, planner=planner, no_dist=True)
    return len(planner.keys)


def _refuse_sharded_hf(src: PathLike) -> None:
    """A Hugging Face ``save_pretrained`` directory or its index is several files: say so, and what works."""
    path = os.fspath(src)
    index = path if path.endswith(".safetensors.index.json") else None
    if index is None and os.path.isdir(path) and not os.path.islink(path):
        found = sorted(n for n in os.listdir(path) if n.endswith(".safetensors.index.json"))
        shards = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        if not found and not shards:
            return
        index = os.path.join(path, found[0]) if found else None
        what = f"a Hugging Face checkpoint directory ({len(shards)} safetensors file(s){', index ' + found[0] if found else ''})"
    elif index is not None:
        what = "the index of a sharded Hugging Face checkpoint"
    else:
        return
    raise CheckpointError(
        f"{path} is {what}, not one safetensors file; convert it with `distckpt convert --from hf DIR DST`, or load "
        "it straight into a model with distckpt.load(state_dict, checkpoint_id=DIR).")


def from_safetensors(src: PathLike, dst: PathLike, *, allow_pickle: bool = False,
                     progress: Optional[Callable[[str], None]] = None) -> int:
    """Convert the safetensors file ``src`` (from any writer, e.g. Hugging Face) into a new distckpt
    checkpoint ``dst``; return the count of keys."""
    _new_destination(dst, "checkpoint")
    from safetensors import SafetensorError, safe_open

    _refuse_sharded_hf(src)
    where = f"safetensors file {os.fspath(src)}"
    fd = _open_source(src, where)
    try:  # through the descriptor just checked: the path may have been swapped since
        with safe_open(f"/proc/self/fd/{fd}", framework="pt") as f:
            state: dict[str, Any] = {k: f.get_tensor(k) for k in f.keys()}
            raw_values = (f.metadata() or {}).get(VALUES_KEY)
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        raise CorruptCheckpointError(f"{where} cannot be read as safetensors: {exc}") from exc
    finally:
        os.close(fd)
    if raw_values is not None:
        values = parse_json(raw_values, f"{where}: metadata {VALUES_KEY!r}")
        if not isinstance(values, dict):
            raise CorruptCheckpointError(f"{where}: metadata {VALUES_KEY!r} is not a JSON object")
        for k, v in values.items():
            if k in state:
                raise CorruptCheckpointError(f"{where}: key {k!r} is both a tensor and a value")
            state[k] = from_data(v, allow_pickle=allow_pickle, where=f"{where}, key {k!r}")
    return _write_distckpt(state, dst, allow_pickle, progress)


def _open_source(src: PathLike, where: str) -> int:
    """A descriptor of the regular file ``src`` (not a link, FIFO or device), or a CheckpointError."""
    try:
        return open_regular(os.fspath(src))
    except CheckpointNotFoundError:
        raise CheckpointNotFoundError(f"{where} does not exist") from None
    except OSError as exc:
        raise CheckpointError(f"{where} cannot be opened: {exc.strerror or exc}") from exc


def to_torch_save(src: PathLike, dst: PathLike, *, allow_pickle: bool = False,
                  progress: Optional[Callable[[str], None]] = None) -> int:
    """Consolidate the distckpt checkpoint ``src`` into one new torch.save file ``dst``; return the count of keys."""
    _new_destination(dst, "file")
    state = _read_whole(src, allow_pickle, progress)
    if progress:
        progress(f"writing torch.save file {dst}")
    _write_new_file(dst, lambda f: torch.save(state, f))
    return len(state)


def read_whole(checkpoint_id: PathLike, *, allow_pickle: bool = False, under: Optional[str] = None) -> Any:
    """The whole state of a checkpoint (distckpt's, or one DCP wrote) in this process, nested again as it was
    saved, tensors whole: what ``torch.load`` gives for a torch.save file, with no template state dict.
    With ``under``, only what was saved under that top-level key: its value (``{}`` if nothing was).
    Runs without collectives."""
    md = read_metadata(checkpoint_id)
    mappings = md.planner_data if isinstance(md.planner_data, dict) else {}
    only = None if under is None else (lambda key: _top_key(key, mappings) == under)
    state = _nest(_read_whole(checkpoint_id, allow_pickle, None, only=only), mappings)
    return state if under is None else state.get(under, {})


def _top_key(key: str, mappings: dict) -> Any:
    """The top-level key a stored key was saved under (its recorded path's first step; a key with none is one)."""
    path = mappings.get(key)
    return path[0] if isinstance(path, (tuple, list)) and path else key


def dcp_to_torch_save(dcp_checkpoint_dir: PathLike, torch_save_path: PathLike) -> None:
    """DCP's helper of this name: the checkpoint directory (distckpt's, or one DCP wrote) as one new torch.save
    file, its state dict nested again as it was saved (``{"model": {"w": ...}}``, not ``"model.w"``).

    Values that are not plain data are refused, as distckpt's loads refuse them
    without ``allow_pickle``: use :func:`to_torch_save` with ``allow_pickle=True``
    for a checkpoint you trust.
    """
    nested = read_whole(dcp_checkpoint_dir)
    _write_new_file(torch_save_path, lambda f: torch.save(nested, f))


def torch_save_to_dcp(torch_save_path: PathLike, dcp_checkpoint_dir: PathLike) -> None:
    """DCP's helper of this name: the torch.save file as a new checkpoint (distckpt's format), read by
    distckpt's archive reader (tensors and plain data only)."""
    from_torch_save(torch_save_path, dcp_checkpoint_dir)


def _nest(flat: dict[str, Any], mappings: dict) -> dict[str, Any]:
    """``flat`` (dotted keys) as the nested dicts and lists it was saved from, by the saved key paths."""
    root: dict[str, Any] = {}
    for key in sorted(flat, key=lambda k: tuple(str(p) for p in mappings.get(k, (k,)))):
        path = mappings.get(key)
        if not isinstance(path, (tuple, list)) or not path or not all(_is_step(p) for p in path):
            root[key] = flat[key]
            continue
        path = [p[0] if isinstance(p, (tuple, list)) else p for p in path]  # (k,): the int key of a dict
        kinds = [isinstance(p, int) and not isinstance(p, bool) and not isinstance(raw, (tuple, list))
                 for p, raw in zip(path, mappings[key])]  # True: a list index
        parent: Any = root
        for step, next_is_index in zip(path[:-1], kinds[1:]):
            child = parent[step] if _holds(parent, step) else None
            if child is None:
                child = [] if next_is_index else {}
                _put(parent, step, child)
            parent = child
        _put(parent, path[-1], flat[key])
    return root


def _is_step(p: Any) -> bool:
    """A step of a recorded key path: a dict key (str), a list index (int), or a dict's int key as (k,)."""
    if isinstance(p, (tuple, list)):
        return len(p) == 1 and type(p[0]) is int
    return isinstance(p, (str, int)) and not isinstance(p, bool)


def _holds(container: Any, step: Any) -> bool:
    return step in container if isinstance(container, dict) else 0 <= step < len(container) and container[step] is not None


def _put(container: Any, step: Any, value: Any) -> None:
    if isinstance(container, dict):
        container[step] = value
        return
    while len(container) <= step:
        container.append(None)
    container[step] = value


def from_torch_save(src: PathLike, dst: PathLike, *, progress: Optional[Callable[[str], None]] = None) -> int:
    """Convert the torch.save file ``src`` into a new distckpt checkpoint ``dst``; return the count of keys stored.

    The file is never given to ``torch.load``: distckpt's archive reader (distckpt.layouts.torch_save) builds only
    tensors and plain data, and refuses a file holding anything else. Nested dicts are kept (keys become dotted
    paths, as for any nested state dict).
    """
    _new_destination(dst, "checkpoint")
    where = f"torch.save file {os.fspath(src)}"
    fd = _open_source(src, where)
    try:
        state = load_torch_save(lambda n, offset: os.pread(fd, n, offset), os.fstat(fd).st_size, where)
    finally:
        os.close(fd)
    if not isinstance(state, dict):
        raise CheckpointError(f"{where} holds a {type(state).__name__}, not a dict of keys to tensors and values")
    return _write_distckpt(state, dst, False, progress)
