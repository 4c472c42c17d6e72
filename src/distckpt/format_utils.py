"""DCP's module name for its conversion helpers (they live in :mod:`distckpt.convert` and
:mod:`distckpt.torch_save_reader`)."""

from .convert import dcp_to_torch_save, torch_save_to_dcp
from .torch_save_reader import BroadcastingTorchSaveReader, DynamicMetaLoadPlanner

__all__ = ["dcp_to_torch_save", "torch_save_to_dcp", "BroadcastingTorchSaveReader", "DynamicMetaLoadPlanner"]
