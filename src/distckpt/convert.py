"""Conversion between distckpt checkpoints and torch.distributed.checkpoint (DCP) checkpoints.

The one module under src/ that uses DCP: it reads and writes DCP's format
through DCP itself, in one process, holding the whole state in host memory.

DCP stores its metadata, and every non-tensor value, as pickles. Reading a
DCP checkpoint therefore runs the unpickler on its files, which can execute
code: convert only DCP checkpoints you trust. :func:`from_dcp` refuses unless
called with ``trust_pickle=True`` (the command line's ``--trust-pickle``).
The other direction unpickles nothing: distckpt's format is pickle-free.

Keys keep their names: a DCP key such as ``model.layers.0.w`` is the same
key in distckpt, so nested state dicts load from the converted checkpoint as
they loaded from the original.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Optional, Union

import torch

from .errors import CheckpointError, CheckpointNotFoundError
from .loading import load, read_metadata
from .metadata import TensorStorageMetadata
from .planning import DefaultLoadPlanner, DefaultSavePlanner
from .saving import save

__all__ = ["from_dcp", "to_dcp"]

PathLike = Union[str, os.PathLike]


def _placeholders(entries: dict, tensor_type: type) -> dict[str, Any]:
    """An empty tensor per stored tensor, None per stored value: what a load fills in."""
    return {fqn: torch.empty(e.size, dtype=e.properties.dtype) if isinstance(e, tensor_type) else None
            for fqn, e in entries.items()}


def from_dcp(src: PathLike, dst: PathLike, *, trust_pickle: bool = False, allow_pickle: bool = False,
             progress: Optional[Callable[[str], None]] = None) -> int:
    """Convert the DCP checkpoint ``src`` into a new distckpt checkpoint ``dst``; return the count of keys.

    ``trust_pickle`` must be True: DCP's files are pickles (see the module text).
    Non-tensor values must be plain data unless ``allow_pickle`` (then they are
    stored pickled in distckpt too, and loading them needs the same opt-in).
    """
    if not trust_pickle:
        raise CheckpointError(
            f"{src}: DCP checkpoints store their metadata and values as pickles, and reading them can run code. "
            "Convert only checkpoints you trust, passing trust_pickle=True (distckpt convert --trust-pickle).")
    import torch.distributed.checkpoint as dcp

    if not os.path.exists(os.path.join(os.fspath(src), ".metadata")):
        raise CheckpointNotFoundError(f"{src}: no DCP checkpoint there (its .metadata file is missing)")
    md = dcp.FileSystemReader(os.fspath(src)).read_metadata()
    state = _placeholders(md.state_dict_metadata, dcp.metadata.TensorStorageMetadata)
    if progress:
        progress(f"reading {len(state)} keys from DCP checkpoint {src}")
    with warnings.catch_warnings():  # DCP warns that it runs in one process, which is the point here
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=os.fspath(src), no_dist=True)
    if progress:
        progress(f"writing distckpt checkpoint {dst}")
    save(state, checkpoint_id=dst, planner=DefaultSavePlanner(allow_pickle=allow_pickle))
    return len(state)


def to_dcp(src: PathLike, dst: PathLike, *, allow_pickle: bool = False,
           progress: Optional[Callable[[str], None]] = None) -> int:
    """Convert the distckpt checkpoint ``src`` into a new DCP checkpoint ``dst``; return the count of keys.

    ``allow_pickle`` is needed only if ``src`` itself holds pickled values.
    """
    import torch.distributed.checkpoint as dcp

    if os.path.exists(dst) and os.listdir(dst):
        raise CheckpointError(f"{dst} exists and is not empty; convert into a new directory")
    md = read_metadata(src)
    state = _placeholders(md.state_dict_metadata, TensorStorageMetadata)
    if progress:
        progress(f"reading {len(state)} keys from distckpt checkpoint {src}")
    load(state, checkpoint_id=src, planner=DefaultLoadPlanner(allow_pickle=allow_pickle))
    if progress:
        progress(f"writing DCP checkpoint {dst}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=os.fspath(dst), no_dist=True)
    return len(state)
