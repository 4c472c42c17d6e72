"""DCP's module name for its conversion helpers (they live in :mod:`distckpt.convert`)."""

from .convert import dcp_to_torch_save, torch_save_to_dcp

__all__ = ["dcp_to_torch_save", "torch_save_to_dcp"]
