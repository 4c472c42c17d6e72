"""DCP's module name for the save calls."""

from .async_saving import AsyncCheckpointerType, AsyncSaveHandle, async_save
from .saving import save, save_state_dict

__all__ = ["save", "save_state_dict", "async_save", "AsyncSaveHandle", "AsyncCheckpointerType"]
