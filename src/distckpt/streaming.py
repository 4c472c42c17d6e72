"""Saving the keys of one checkpoint into another, one tensor at a time: conversions in bounded memory.

:class:`StreamingSavePlanner` plans a save of a source checkpoint's keys (whole tensors, as its metadata lists them)
without reading any of them; the storage writer then asks for each tensor when it writes it, and only then is that
tensor read from the source. A conversion therefore holds the tensors the writer has in flight (its threads' items
and its write batches), never the whole state, whatever the formats on either side: any reader distckpt picks
for the source (its own checkpoints, DCP directories, Hugging Face directories) and any writer.
"""

from __future__ import annotations

import io
import os
import threading
from typing import Any, Callable, Optional, Union

import torch

from .backends import reader_for
from .errors import CheckpointError
from .format.values import encode_value
from .loading import load
from .metadata import BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata
from .planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from .planning import DefaultLoadPlanner, DefaultSavePlanner
from .planning.save_planner import build_metadata

__all__ = ["StreamingSavePlanner"]


class StreamingSavePlanner(DefaultSavePlanner):
    """Saves ``keys`` (name in the new checkpoint -> name in ``source``) of the checkpoint ``source``, reading each
    tensor when the storage writer asks for it. Non-tensor values are read up front (they are small). Pass an
    empty state dict to ``save``; run in one process (``no_dist=True``).

    Args:
        source: the checkpoint to read (any id ``distckpt.load`` takes).
        keys: which keys to save, under which names; None: every key under its own name.
        allow_pickle: values that are not plain data may be read and stored pickled.
        progress: called with a line of text per tensor read.
        reader_options: options of the storage reader of ``source`` (``index=`` of a Hugging Face directory).
    """

    def __init__(self, source: Union[str, os.PathLike], keys: Optional[dict[str, str]] = None, *, allow_pickle: bool = False,
                 progress: Optional[Callable[[str], None]] = None, reader_options: Optional[dict[str, Any]] = None):
        super().__init__(allow_pickle=allow_pickle)
        self.source = os.fspath(source)
        self.reader = reader_for(self.source, **(reader_options or {}))
        self.reader.reset(self.source)
        self.source_metadata: Metadata = self.reader.read_metadata()
        sdm = self.source_metadata.state_dict_metadata
        self.keys = dict(keys) if keys is not None else {k: k for k in sdm}
        unknown = [src for src in self.keys.values() if src not in sdm]
        if unknown:
            raise CheckpointError(f"checkpoint {self.source!r} has no key(s) {unknown[:5]}")
        # every later load of one key plans on this metadata: the source is read and checked once, not per key
        self.reader.read_metadata = lambda *args, **kwargs: self.source_metadata
        self.lock = threading.Lock()
        self.progress = progress

    def create_local_plan(self) -> SavePlan:
        sdm = self.source_metadata.state_dict_metadata
        items: list[WriteItem] = []
        values = {src: None for src in self.keys.values() if isinstance(sdm[src], BytesStorageMetadata)}
        if values:
            self._load(values)
        self._encoded = {}
        for name, src in self.keys.items():
            entry = sdm[src]
            if isinstance(entry, TensorStorageMetadata):
                size = torch.Size(entry.size)
                chunk = ChunkStorageMetadata(torch.Size([0] * len(size)), size)
                props = TensorProperties(entry.properties.dtype)
                items.append(WriteItem(MetadataIndex(name, chunk.offsets), WriteItemType.TENSOR,
                                       tensor_data=TensorWriteData(chunk, props, size)))
            else:
                self._encoded[name] = encode_value(values[src], allow_pickle=self.allow_pickle, where=f"key {src!r}")
                items.append(WriteItem(MetadataIndex(name), WriteItemType.BYTE_IO))
        self.plan = SavePlan(items)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        # the plans are WriteItems, so the columnar global planning does not apply
        metadata = build_metadata(all_plans)
        self.metadata = metadata
        return all_plans, metadata

    def resolve_data(self, write_item: WriteItem) -> Union[torch.Tensor, io.BytesIO]:
        name = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self._encoded[name])
        src = self.keys[name]
        entry = self.source_metadata.state_dict_metadata[src]
        state = {src: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)}
        if self.progress:
            self.progress(f"reading {src!r} ({state[src].nbytes} bytes)")
        self._load(state)
        return state[src]

    def _load(self, state: dict[str, Any]) -> None:
        planner = DefaultLoadPlanner(allow_partial_load=False, allow_pickle=self.allow_pickle, allow_unexpected_keys=True)
        with self.lock:  # one reader, one load at a time; the writer's threads write while the next key is read
            load(state, storage_reader=self.reader, planner=planner, no_dist=True)
