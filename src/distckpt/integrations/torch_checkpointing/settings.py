"""What the local and object-store sides read of :class:`DistckptStorageConfig`, as a protocol: they need not
import the module of the config, which builds the storage that holds them."""

from typing import Protocol


class Settings(Protocol):
    """The settings each side reads when it is called (not copied: a change to the config is seen at once)."""

    block_bytes: int
    sync: bool
