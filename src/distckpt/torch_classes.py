"""torch.distributed.checkpoint's own classes, passed to distckpt by code written for DCP.

Frameworks (accelerate, for one) pass DCP's ``FileSystemWriter``/``FileSystemReader`` and
``DefaultSavePlanner``/``DefaultLoadPlanner`` explicitly. Those write and read DCP's format with DCP's
metadata types, which distckpt's call sequence does not produce; mixing them fails deep inside torch.
So DCP's default classes are replaced by distckpt's, with the options they were given, and any other
concrete class of DCP's is refused with a TypeError that names the replacement. The protocol's abstract
bases (``SavePlanner``, ``StorageWriter``, ...) are not DCP's code: a user's subclass of them is used as is.

Classes are recognised by module and name; distckpt does not import torch.distributed.checkpoint.
"""

from __future__ import annotations

from typing import Any, Optional

from .backends import DCPReader, FileSystemReader, FileSystemWriter, HuggingFaceReader, HuggingFaceWriter
from .layouts.dcp import is_dcp_directory
from .planning import DefaultLoadPlanner, DefaultSavePlanner
from .torch_save_reader import BroadcastingTorchSaveReader, DynamicMetaLoadPlanner

__all__ = ["adopt"]

_DCP = "torch.distributed.checkpoint"
_PROTOCOL = {"SavePlanner", "LoadPlanner", "StorageWriter", "StorageReader", "Stateful"}
_REPLACEMENT = {
    "FileSystemWriter": "distckpt.FileSystemWriter",
    "FileSystemReader": "distckpt.FileSystemReader",
    "DefaultSavePlanner": "distckpt.DefaultSavePlanner",
    "DefaultLoadPlanner": "distckpt.DefaultLoadPlanner",
    "FsspecWriter": "distckpt.backends.FsspecWriter (same arguments), or checkpoint_id='s3://bucket/prefix'",
    "FsspecReader": "distckpt.backends.FsspecReader (same arguments), or checkpoint_id='s3://bucket/prefix'",
    "HuggingFaceStorageWriter": "distckpt.HuggingFaceWriter",
    "HuggingFaceStorageReader": "distckpt.HuggingFaceReader",
}


def _dcp_class(obj: Any) -> Optional[type]:
    """The first class of ``obj``'s type that torch.distributed.checkpoint defines, if any."""
    for cls in type(obj).__mro__:
        if cls.__module__.startswith(_DCP):
            return cls
    return None


def _own_dcp_class(obj: Any) -> bool:
    return type(obj).__module__.startswith(_DCP)


def adopt(obj: Any, role: str) -> Any:
    """``obj`` as distckpt uses it for ``role`` ("storage_writer", "storage_reader", "planner"): itself, or
    distckpt's class in place of DCP's default one, with the same options."""
    if obj is None:
        return None
    base = _dcp_class(obj)
    if base is None or base.__name__ in _PROTOCOL:
        return obj
    name = base.__name__
    if _own_dcp_class(obj):
        made = _replace(obj, name)
        if made is not None:
            return made
    replacement = _REPLACEMENT.get(name)
    what = f"{type(obj).__name__}" + (f" (a subclass of torch.distributed.checkpoint's {name})" if not _own_dcp_class(obj) else
                                     " from torch.distributed.checkpoint")
    hint = (f"use {replacement}" if replacement else
            f"use distckpt's own {role.replace('_', ' ')} (or a class of yours written against the protocol's bases)")
    if not _own_dcp_class(obj) and name in ("DefaultSavePlanner", "DefaultLoadPlanner"):
        hint = f"subclass {_REPLACEMENT[name]} instead: it has the same hooks"
    raise TypeError(f"{role}={what} reads or writes DCP's own format and metadata types, which distckpt does not "
                    f"use; {hint}")


def _replace(obj: Any, name: str) -> Any:
    """distckpt's counterpart of one of DCP's default classes, with its options; None if there is none."""
    if name == "FileSystemWriter":
        transforms = getattr(obj, "transforms", None)
        extensions = list(getattr(transforms, "extensions", ()) or ())
        return FileSystemWriter(str(obj.path), sync_files=getattr(obj, "sync_files", None),
                                thread_count=getattr(obj, "thread_count", None), overwrite=getattr(obj, "overwrite", True),
                                _extensions=extensions or None)
    if name == "FileSystemReader":
        registry = getattr(getattr(obj, "transforms", None), "extension_registry", None)
        path = str(obj.path)
        if is_dcp_directory(path):
            return DCPReader(path, _extension_registry=registry)
        return FileSystemReader(path, _extension_registry=registry)
    if name == "DefaultSavePlanner":
        return DefaultSavePlanner(flatten_state_dict=getattr(obj, "flatten_state_dict", True),
                                  flatten_sharded_tensors=getattr(obj, "flatten_sharded_tensors", True),
                                  enable_plan_caching=bool(getattr(obj, "_enable_plan_caching", False)))
    if name in ("DefaultLoadPlanner", "DynamicMetaLoadPlanner"):
        cls = DefaultLoadPlanner if name == "DefaultLoadPlanner" else DynamicMetaLoadPlanner
        return cls(flatten_state_dict=getattr(obj, "flatten_state_dict", True),
                   flatten_sharded_tensors=getattr(obj, "flatten_sharded_tensors", True),
                   allow_partial_load=getattr(obj, "allow_partial_load", False))
    if name == "HuggingFaceStorageWriter":
        # every rank writes its rows into the final shards: DCP's save_distributed and consolidation in one step
        final = getattr(obj, "consolidated_output_path", None) or obj.path
        return HuggingFaceWriter(str(final), fqn_to_index_mapping=getattr(obj, "fqn_to_index_mapping", None),
                                 thread_count=getattr(obj, "thread_count", None))
    if name == "HuggingFaceStorageReader":
        return HuggingFaceReader(str(obj.path), thread_count=getattr(obj, "thread_count", None))
    if name == "BroadcastingTorchSaveReader":
        return BroadcastingTorchSaveReader(getattr(obj, "checkpoint_id", None), getattr(obj, "coordinator_rank", 0))
    return None
