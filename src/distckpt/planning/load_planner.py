"""DefaultLoadPlanner: what a load reads, computed from chunk overlaps."""

from __future__ import annotations

import io
from typing import Any, Optional

import torch

from ..capabilities import keeps_plans, resolves_columns
from ..errors import CheckpointError, DTypeMismatchError, MissingKeyError, ShapeMismatchError, UnexpectedKeyError
from ..format.tensor_table import table_of
from ..format.values import decode_value
from ..item_columns import ReadColumns
from ..metadata import STATE_DICT_TYPE, BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from ..planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from .flatten import expand_to_match, flatten_state_dict, rank_local_hint, set_element
from .resharding import ChunkIndex
from .tensors import check_no_aliasing, dtype_of, held_alone, is_dtensor, local_boxes, local_pieces, piece_at

__all__ = ["DefaultLoadPlanner"]

_MAX_LISTED = 10
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensors that are their own only piece (not DTensor, not ShardedTensor)
_ORIGIN = [(0,) * n for n in range(65)]


class DefaultLoadPlanner(LoadPlanner):
    """The planner :func:`distckpt.load` uses unless told otherwise. Loads in place.

    Args:
        flatten_state_dict: match nested dicts and lists by dotted keys, as saved.
        flatten_sharded_tensors: accepted for protocol compatibility (see DefaultSavePlanner).
        allow_partial_load: skip keys of the caller's state dict that the
            checkpoint lacks, instead of raising MissingKeyError.
        allow_pickle: unpickle values that were saved pickled. Off by default;
            only for checkpoints you trust.
        allow_dtype_conversion: load a stored dtype into a destination of
            another dtype, converting. Off by default: a mismatch raises.
        allow_unexpected_keys: leave keys of the checkpoint that the state
            dict lacks unread. None (the default): allowed, as DCP does,
            except for checkpoints that hold one whole model's weights (a
            Hugging Face directory), where they raise UnexpectedKeyError.

    A key of the state dict that the checkpoint lacks is not missing when its
    tensor is the very tensor of a key the checkpoint has (tied weights, which
    Hugging Face checkpoints store once): loading that key fills both.
    """

    def __init__(
        self,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
        allow_partial_load: bool = False,
        allow_pickle: bool = False,
        allow_dtype_conversion: bool = False,
        allow_unexpected_keys: Optional[bool] = None,
    ) -> None:
        self.flatten_state_dict = flatten_state_dict
        self.flatten_sharded_tensors = flatten_sharded_tensors
        self.allow_partial_load = allow_partial_load
        self.allow_pickle = allow_pickle
        self.allow_dtype_conversion = allow_dtype_conversion
        self.allow_unexpected_keys = allow_unexpected_keys
        self.mappings: dict = {}
        self.rank = 0  # set by distckpt.load before set_up_planner
        # after create_local_plan: keys of the state dict the checkpoint lacks (skipped with allow_partial_load),
        # and keys of the checkpoint the state dict lacks (left unread)
        self.missing_keys: list[str] = []
        self.unexpected_keys: list[str] = []

    def set_up_planner(
        self,
        state_dict: STATE_DICT_TYPE,
        metadata: Optional[Metadata] = None,
        is_coordinator: bool = False,
    ) -> None:
        self.original_state_dict = state_dict
        if self.flatten_state_dict:
            state_dict, self.mappings = flatten_state_dict(state_dict, self.rank)
            if metadata is not None:  # a checkpoint DCP flattened further (lists of dicts): match its keys
                state_dict, self.mappings = expand_to_match(state_dict, self.mappings, metadata.state_dict_metadata)
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def _checkpoint_name(self) -> str:
        sm = self.metadata.storage_meta if self.metadata is not None else None
        return f"checkpoint {str(sm.checkpoint_id)!r}" if sm is not None and sm.checkpoint_id is not None else "the checkpoint"

    def create_local_plan(self) -> LoadPlan:
        """The reads of this rank, as :class:`ReadColumns`: a whole stored chunk into a whole destination is a
        column item; every other read (resharding) a ReadItem beside them."""
        assert self.metadata is not None, "set_up_planner must be given the checkpoint metadata"
        sdm = self.metadata.state_dict_metadata
        cols = ReadColumns()
        missing: list[str] = []
        problems: list[CheckpointError] = []
        boxes = local_boxes()
        pieces = {fqn: local_pieces(fqn, obj, boxes) for fqn, obj in self.state_dict.items()
                  if isinstance(obj, torch.Tensor) and type(obj) not in _PLAIN and fqn in sdm}
        # destinations checked for shared memory below: measured here where the loop has them at hand, else later
        spans: list = []
        loose = [(fqn, p[0]) for fqn, (_, ps) in pieces.items() for p in ps]
        convert = self.allow_dtype_conversion
        add_whole = cols.add_whole
        table = table_of(sdm)
        if table is not None:  # keys still exactly their row of the table of whole tensors: compared on its columns
            rows, built, start, ndim, size, prop = sdm.rows, sdm.built, table.start, table.ndim, table.size, table.property
            dtypes = [fields[0] for fields in table.fields]
        for fqn, obj in self.state_dict.items():
            if table is not None and type(obj) in _PLAIN:
                row = rows.get(fqn)
                if row is not None and fqn not in built:
                    s, n = start[row], ndim[row]
                    shape = obj.shape
                    if list(shape) == size[s:s + n] and (convert or obj.dtype == dtypes[prop[row]]):
                        add_whole(fqn, obj, _ORIGIN[n], _ORIGIN[n], 0, tuple(shape))
                        if obj.is_cpu and obj.is_contiguous():
                            lo, nbytes = obj.data_ptr(), obj.nbytes
                            if nbytes:  # an empty tensor shares no byte
                                spans.append((fqn, obj, lo, lo + nbytes))
                        else:
                            loose.append((fqn, obj))
                        continue
            md = sdm.get(fqn)
            if type(obj) in _PLAIN and md is not None:
                loose.append((fqn, obj))
            if md is None:
                missing.append(fqn)
                continue
            if type(obj) in _PLAIN and type(md) is TensorStorageMetadata and len(md.chunks) == 1:
                # the common case, one whole stored chunk into one plain tensor, without building its pieces
                chunk = md.chunks[0]
                shape = obj.shape
                if shape == md.size == chunk.sizes and (convert or obj.dtype == md.properties.dtype):
                    size = tuple(shape)
                    add_whole(fqn, obj, (0,) * len(size), tuple(chunk.offsets), 0, size)
                    continue
            if isinstance(obj, torch.Tensor):
                if not isinstance(md, TensorStorageMetadata):
                    problems.append(ShapeMismatchError(
                        f"key {fqn!r} is a tensor in your state dict but a non-tensor value in {self._checkpoint_name()}"))
                    continue
                try:
                    self._tensor_reads(cols, fqn, obj, md, *(pieces[fqn] if fqn in pieces else local_pieces(fqn, obj)))
                except (ShapeMismatchError, DTypeMismatchError) as exc:
                    problems.append(exc)
            else:
                if not isinstance(md, BytesStorageMetadata):
                    problems.append(ShapeMismatchError(
                        f"key {fqn!r} is a non-tensor value in your state dict but a tensor in {self._checkpoint_name()}; "
                        "put a tensor of the saved shape there to load it"))
                    continue
                cols.add_bytes(fqn)
        check_no_aliasing(loose, spans)
        if missing:
            missing = self._not_tied(missing)
        self.missing_keys = missing
        self.unexpected_keys = [fqn for fqn in sdm if fqn not in self.state_dict]
        if missing and not self.allow_partial_load:
            raise MissingKeyError(self._missing_message(missing))
        self._check_unexpected()
        if problems:
            first = problems[0]
            more = "".join(f"\n  also: {p}" for p in problems[1:_MAX_LISTED])
            raise type(first)(f"{first}{more}")
        self.plan = LoadPlan(cols)
        return self.plan

    def _not_tied(self, missing: list[str]) -> list[str]:
        """The keys of ``missing`` whose tensor is not also the tensor of a key the checkpoint has."""
        sdm = self.metadata.state_dict_metadata
        loaded = {sig for fqn, obj in self.state_dict.items() if fqn in sdm and isinstance(obj, torch.Tensor)
                  for sig in _identities(obj)}
        return [fqn for fqn in missing if not (isinstance(self.state_dict[fqn], torch.Tensor)
                                               and loaded.intersection(_identities(self.state_dict[fqn])))]

    def _check_unexpected(self) -> None:
        allow = self.allow_unexpected_keys
        if allow is None:
            allow = not getattr(self.metadata.storage_data, "every_key", False)
        if allow:
            return
        unexpected = self.unexpected_keys
        if unexpected:
            shown = ", ".join(repr(k) for k in unexpected[:_MAX_LISTED])
            more = f" and {len(unexpected) - _MAX_LISTED} more" if len(unexpected) > _MAX_LISTED else ""
            raise UnexpectedKeyError(
                f"Unexpected key(s) in {self._checkpoint_name()}: {shown}{more} ({len(unexpected)} key(s) the state dict "
                "lacks would not be loaded). Check that the model matches the checkpoint, or pass "
                "planner=DefaultLoadPlanner(allow_unexpected_keys=True) to leave them unread.")

    def _missing_message(self, missing: list[str]) -> str:
        sdm = self.metadata.state_dict_metadata
        shown = ", ".join(repr(k) for k in missing[:_MAX_LISTED])
        more = f" and {len(missing) - _MAX_LISTED} more" if len(missing) > _MAX_LISTED else ""
        hint = ""
        nested = [k for k in missing if any(s.startswith(k + ".") for s in sdm)]
        if nested:
            hint = (f" {nested[0]!r} is empty in your state dict but holds entries in the checkpoint: build the "
                    "structure first (for an optimizer, call distckpt.init_optimizer_state(optimizer)).")
        hint += rank_local_hint(missing, sdm)
        return (f"Missing key in checkpoint state_dict: {shown}{more} ({len(missing)} key(s) of your state dict are "
                f"not in {self._checkpoint_name()}).{hint} "
                "Check the key names, or pass planner=DefaultLoadPlanner(allow_partial_load=True) to skip them.")

    def _tensor_reads(self, cols: ReadColumns, fqn: str, tensor: torch.Tensor, md: TensorStorageMetadata,
                      global_size: torch.Size, pieces: list) -> None:
        if torch.Size(global_size) != md.size:
            raise ShapeMismatchError(
                f"Size mismatch between saved {list(md.size)} and current: {list(global_size)} for key {fqn!r} in "
                f"{self._checkpoint_name()}; build the model with the saved shapes, or leave this key out of the state dict")
        dtype, _ = dtype_of(tensor)
        if dtype != md.properties.dtype and not self.allow_dtype_conversion:
            raise DTypeMismatchError(
                f"key {fqn!r}: your tensor has dtype {dtype} but {self._checkpoint_name()} stores "
                f"{md.properties.dtype}; pass planner=DefaultLoadPlanner(allow_dtype_conversion=True) to convert")
        if len(md.chunks) == 1 and len(pieces) == 1:
            chunk, (local, offsets, sizes) = md.chunks[0], pieces[0]
            size = tuple(md.size)
            if tuple(chunk.sizes) == size == tuple(sizes):  # one whole chunk into one whole tensor
                cols.add_whole(fqn, local, tuple(offsets), tuple(chunk.offsets), 0, size)
                return
        chunks = ChunkIndex(md.chunks)
        for local, offsets, sizes in pieces:
            found = chunks.overlaps(offsets, sizes)
            if len(found) == 1 and _whole(found[0], md.chunks[found[0].chunk_index].sizes, sizes):
                # a shard loaded as it was saved (the same sharding): a column item, as a whole tensor is
                cols.add_whole(fqn, local, tuple(offsets), tuple(offsets), found[0].chunk_index, tuple(sizes))
                continue
            for ov in found:
                chunk = md.chunks[ov.chunk_index]
                cols.general.append(ReadItem(
                    LoadItemType.TENSOR,
                    MetadataIndex(fqn, offsets),
                    torch.Size(ov.dest_offsets),
                    MetadataIndex(fqn, chunk.offsets, ov.chunk_index),
                    torch.Size(ov.storage_offsets),
                    torch.Size(ov.lengths),
                ))

    def keys_held_alone(self) -> set[str]:
        """The keys whose destination this rank alone holds (see :func:`~distckpt.planning.tensors.held_alone`): a
        stored chunk read whole into one of them is needed by no other rank of the load (shared reads)."""
        return {fqn for fqn, obj in self.state_dict.items() if held_alone(obj)}

    @keeps_plans
    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = decode_value(value.getvalue(), allow_pickle=self.allow_pickle, where=f"{self._checkpoint_name()}, key {fqn!r}")
        self.set_value(fqn, obj)

    def set_value(self, fqn: str, obj: Any) -> None:
        """Put a loaded non-tensor value into the caller's state dict."""
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj

    @resolves_columns
    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        """The destination tensor behind ``index`` (the local shard, for a DTensor or ShardedTensor)."""
        return piece_at(index.fqn, self.state_dict[index.fqn], index.offset)

    @resolves_columns
    def transform_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> torch.Tensor:
        """The region of ``tensor`` that ``read_item`` fills."""
        if read_item.lengths == tensor.shape:  # all of it
            return tensor
        for dim, (off, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            tensor = tensor.narrow(dim, off, length)
        return tensor

    @resolves_columns
    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self.transform_tensor(read_item, self.lookup_tensor(read_item.dest_index))

    @resolves_columns
    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """Nothing to do: ``resolve_tensor`` returned a view of the destination."""


def _whole(overlap, chunk_sizes, sizes) -> bool:
    """Whether ``overlap`` is all of a stored chunk into all of a destination piece."""
    return (not any(overlap.dest_offsets) and not any(overlap.storage_offsets)
            and tuple(overlap.lengths) == tuple(chunk_sizes) == tuple(sizes))


def _identities(tensor: torch.Tensor) -> list:
    """What makes two destinations the same tensor: the same object, or (where it holds elements: every empty
    tensor has address 0) the same memory viewed the same way; a DTensor by its local shard and global shape."""
    out = [("object", id(tensor))]
    local = tensor.to_local() if is_dtensor(tensor) else tensor
    if not local.is_meta and local.numel():
        out.append((local.data_ptr(), tuple(local.shape), tuple(local.stride()), local.dtype, str(local.device),
                    tuple(tensor.shape)))
    return out
