"""DefaultSavePlanner: what a save writes, on every rank and globally."""

from __future__ import annotations

import io
from typing import Any, Optional, Union

import torch

from ..capabilities import plans_on_columns, resolves_columns
from ..errors import CheckpointError, UnsupportedTensorError
from ..format.dtypes import STORABLE_DTYPES, dtype_name, itemsize
from ..format.values import encode_value
from ..item_columns import SHARD, TENSOR, WriteColumns
from ..metadata import (
    STATE_DICT_TYPE,
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from ..planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from ..wire.columns import PlanColumns
from .columnar import ColumnarPlan, plan_columns, to_metadata
from .dedup import dedup_and_balance
from .flatten import flatten_state_dict, stored_paths
from .plan_cache import PlanCache
from .resharding import volume
from .tensors import dtype_of, is_dtensor, is_sharded_tensor, local_boxes, local_pieces, piece_at

__all__ = ["DefaultSavePlanner"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensors that are their own only piece (not DTensor, not ShardedTensor)
_STRIDED = torch.strided


def _check_storable(fqn: str, tensor: torch.Tensor) -> None:
    """Raise UnsupportedTensorError, naming the key and the fix, for a tensor with no stored form."""
    if is_sharded_tensor(tensor):  # its wrapper answers no tensor attributes: check the local shards
        for shard in tensor.local_shards():
            _check_storable(fqn, shard.tensor)
        return
    where = f"state dict key {fqn!r}"
    if tensor.is_nested:
        raise UnsupportedTensorError(f"{where}: nested tensors cannot be saved; save their components (.unbind()) instead")
    if tensor.is_quantized:
        raise UnsupportedTensorError(f"{where}: quantized tensors ({tensor.dtype}) cannot be saved; save .int_repr() "
                                     "with the scale and zero point, or .dequantize()")
    if tensor.is_sparse or (not is_dtensor(tensor) and tensor.layout != torch.strided):
        raise UnsupportedTensorError(f"{where}: only strided (dense) tensors can be saved; call .to_dense() first")
    if tensor.device.type == "meta":
        raise UnsupportedTensorError(f"{where}: the tensor is on the meta device and has no data; materialise it "
                                     "(for a module: .to_empty(device=...) and initialise) before saving")
    try:
        dtype_name(tensor.dtype)
    except UnsupportedTensorError as exc:
        raise UnsupportedTensorError(f"{where}: {exc}") from None


class DefaultSavePlanner(SavePlanner):
    """The planner :func:`distckpt.save` uses unless told otherwise.

    Args:
        flatten_state_dict: turn nested dicts and lists into dotted keys
            (``{"model": {"w": t}}`` is stored as ``"model.w"``).
        flatten_sharded_tensors: accepted for compatibility with planners
            written for the protocol. distckpt stores DTensors natively, one chunk
            per distinct shard, so there is nothing further to flatten.
        dedup_replicated_tensors: write each item held by several ranks once
            (plain tensors and values under one key on every rank, and
            replicated DTensor shards), balancing bytes across ranks.
        allow_pickle: let values that are not plain data be stored pickled.
            Off by default: such a value raises UnsafeValueError at planning.
        enable_plan_caching: reuse the previous save's global plan when no
            rank's local plan changed. Pass the same planner object to every save.

    Its ``create_global_plan`` declares (``capabilities.plans_on_columns``)
    that the coordinator may plan on columns instead, through
    ``create_global_plan_columns``; a subclass that overrides
    ``create_global_plan`` plans through its override.
    """

    def __init__(
        self,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
        dedup_replicated_tensors: Optional[bool] = None,
        allow_pickle: bool = False,
        enable_plan_caching: bool = False,
    ) -> None:
        self.enable_plan_caching = enable_plan_caching
        self.flatten_state_dict = flatten_state_dict
        self.flatten_sharded_tensors = flatten_sharded_tensors
        self.dedup_replicated_tensors = True if dedup_replicated_tensors is None else dedup_replicated_tensors
        self.allow_pickle = allow_pickle
        self.mappings: dict = {}
        self.rank = 0  # set by distckpt.save before set_up_planner
        self._encoded: dict[str, bytes] = {}
        self._plan_cache: Optional[PlanCache] = None
        self._metadata: Optional[Metadata] = None
        self._columnar: Optional[ColumnarPlan] = None

    @property
    def plan_cache(self) -> Optional[PlanCache]:
        """What this planner remembers between saves, while ``enable_plan_caching`` is set."""
        if not self.enable_plan_caching:
            return None
        if self._plan_cache is None:
            self._plan_cache = PlanCache()
        return self._plan_cache

    @property
    def metadata(self) -> Optional[Metadata]:
        """The metadata of the last global plan (coordinator), without storage data."""
        if self._metadata is None and self._columnar is not None:
            self._metadata = to_metadata(self._columnar)  # built when asked: at scale it is millions of objects
        return self._metadata

    @metadata.setter
    def metadata(self, value: Optional[Metadata]) -> None:
        self._metadata, self._columnar = value, None

    # ------------------------------------------------------------ every rank

    def set_up_planner(
        self,
        state_dict: STATE_DICT_TYPE,
        storage_meta: Optional[StorageMeta] = None,
        is_coordinator: bool = False,
    ) -> None:
        self.original_state_dict = state_dict
        if self.flatten_state_dict:
            state_dict, self.mappings = flatten_state_dict(state_dict, self.rank)
        self.state_dict = state_dict
        self.storage_meta = storage_meta
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        """One write item per chunk this rank holds and per value, as :class:`WriteColumns`: the items are built
        as objects only when something reads them (a subclass, a custom storage writer)."""
        cols = WriteColumns()
        self._encoded = {}
        boxes = local_boxes()
        for fqn, obj in self.state_dict.items():
            if type(obj) in _PLAIN:  # most keys: the checks of _check_storable that a plain tensor needs, in one test
                if not (obj.dtype in STORABLE_DTYPES and obj.layout is _STRIDED and not obj.is_nested and not obj.is_meta):
                    _check_storable(fqn, obj)
                shape = tuple(obj.shape)
                cols.add_tensor(fqn, TENSOR, obj, obj.dtype, obj.requires_grad, shape, (0,) * len(shape), shape, obj.nbytes)
            elif isinstance(obj, torch.Tensor):
                _check_storable(fqn, obj)
                if is_dtensor(obj) or is_sharded_tensor(obj):
                    global_size, pieces = local_pieces(fqn, obj, boxes)
                    dtype, requires_grad = dtype_of(obj)
                    size, width = tuple(global_size), itemsize(dtype)
                    for local, offsets, sizes in pieces:
                        cols.add_tensor(fqn, SHARD, local, dtype, requires_grad, size, tuple(offsets), tuple(sizes),
                                        local.numel() * width)
                else:
                    shape = tuple(obj.shape)
                    cols.add_tensor(fqn, TENSOR, obj, obj.dtype, obj.requires_grad, shape, (0,) * len(shape), shape,
                                    obj.nbytes)
            else:
                raw = encode_value(obj, allow_pickle=self.allow_pickle, where=f"state dict key {fqn!r}")
                self._encoded[fqn] = raw
                cols.add_bytes(fqn, raw)
        plan = SavePlan(cols, planner_data=stored_paths(self.mappings, self.original_state_dict) if self.flatten_state_dict else None)
        self.plan = plan
        return plan

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = new_plan
        return new_plan

    @resolves_columns
    def resolve_data(self, write_item: WriteItem) -> Union[torch.Tensor, io.BytesIO]:
        fqn = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO:
            raw = self._encoded.get(fqn)
            if raw is None:  # a subclass rewrote the plan; encode on demand
                raw = encode_value(self.lookup_object(write_item.index), allow_pickle=self.allow_pickle, where=f"state dict key {fqn!r}")
            return io.BytesIO(raw)
        return self.transform_object(write_item, self.lookup_object(write_item.index))

    @resolves_columns
    def lookup_object(self, index: MetadataIndex) -> Any:
        """The state dict value behind ``index`` (the local shard, for a DTensor or ShardedTensor)."""
        try:
            obj = self.state_dict[index.fqn]
        except KeyError:
            raise CheckpointError(f"planner has no state dict entry {index.fqn!r}") from None
        if isinstance(obj, torch.Tensor):
            return piece_at(index.fqn, obj, index.offset)
        return obj

    @resolves_columns
    def transform_object(self, write_item: WriteItem, obj: Any) -> Any:
        """Hook for subclasses: change an object just before it is written."""
        return obj.detach() if isinstance(obj, torch.Tensor) else obj

    # ------------------------------------------------------------ coordinator

    @plans_on_columns
    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if self.dedup_replicated_tensors:
            all_plans = dedup_and_balance(all_plans)
        metadata = build_metadata(all_plans)
        self.metadata = metadata
        return all_plans, metadata

    def create_global_plan_columns(self, all_cols: list[PlanColumns]) -> ColumnarPlan:
        """What ``create_global_plan`` does, on the ranks' column plans (raises ``Declined`` where it cannot decide)."""
        plan = plan_columns(all_cols, self.dedup_replicated_tensors)
        self._metadata, self._columnar = None, plan
        return plan


def build_metadata(all_plans: list[SavePlan]) -> Metadata:
    """Metadata describing every item of the final plans; validates coverage of each tensor."""
    sdm: dict[str, Any] = {}
    merged_mappings: dict = {}
    seen: set = set()
    for plan in all_plans:
        if isinstance(plan.planner_data, dict):
            merged_mappings.update(plan.planner_data)
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                if fqn in sdm and not isinstance(sdm[fqn], BytesStorageMetadata):
                    raise CheckpointError(f"key {fqn!r} is a tensor on some ranks and a non-tensor value on others")
                sdm[fqn] = BytesStorageMetadata()
                continue
            td = item.tensor_data
            entry = sdm.get(fqn)
            if entry is None:
                entry = sdm[fqn] = TensorStorageMetadata(
                    TensorProperties(td.properties.dtype, td.properties.layout, td.properties.requires_grad,
                                     td.properties.memory_format, td.properties.pin_memory),
                    torch.Size(td.size), [])
            elif not isinstance(entry, TensorStorageMetadata) or entry.size != td.size or entry.properties.dtype != td.properties.dtype:
                raise CheckpointError(
                    f"key {fqn!r} is saved with inconsistent size or dtype across ranks; "
                    "wrap rank-specific tensors in distckpt.RankLocal(...)")
            if item.index not in seen:  # without dedup, replicas arrive more than once
                seen.add(item.index)
                entry.chunks.append(td.chunk)
    for fqn, entry in sdm.items():
        if isinstance(entry, TensorStorageMetadata):
            total = sum(volume(c.sizes) for c in entry.chunks)
            if total != volume(entry.size):
                raise CheckpointError(
                    f"key {fqn!r}: the saved chunks cover {total} of {volume(entry.size)} elements; "
                    "shards are missing or overlap (is a rank's DTensor placement inconsistent?)")
            entry.chunks.sort(key=lambda c: tuple(c.offsets))
    return Metadata(state_dict_metadata=sdm, planner_data=merged_mappings or None)
