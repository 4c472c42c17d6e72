"""The Stateful protocol: objects saved through their state dict."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["Stateful"]


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict(sd)``: modules, optimizers, your own classes.

    A top-level value of a state dict that is Stateful is saved as its
    ``state_dict()`` and, after a load, restored with ``load_state_dict``.
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...
