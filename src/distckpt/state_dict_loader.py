"""DCP's module name for the load calls."""

from .loading import load, load_state_dict

__all__ = ["load", "load_state_dict"]
