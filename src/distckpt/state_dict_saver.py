"""DCP's module name for the save calls."""

from .saving import save, save_state_dict
from .staging import AsyncSaveHandle, async_save

__all__ = ["save", "save_state_dict", "async_save", "AsyncSaveHandle"]
