"""What a caching save planner remembers between saves, so that an unchanged plan is not sent or planned again."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..errors import CheckpointError

__all__ = ["PlanCache", "NO_CACHE_MESSAGE"]

NO_CACHE_MESSAGE = "pass the same planner object to every save, on every rank"


@dataclass
class PlanCache:
    """The state of plan caching, owned by one planner object.

    Every rank keeps ``local`` (its last local plan) and ``central`` (the
    central plan it last received, without storage data). The coordinator
    also keeps what each rank last sent (``all_cols`` on the columnar path,
    ``all_local`` on the object path), the global plan it made from them
    (``columnar``, or ``global_plans`` with ``metadata``), and ``sent``, what
    it last sent each rank.
    """

    local: Any = None
    central: Any = None
    all_cols: Optional[list] = None
    columnar: Any = None
    all_local: Optional[list] = None
    global_plans: Optional[list] = None
    metadata: Any = None
    sent: Optional[list] = None

    @staticmethod
    def resolve(previous: Optional[list], plans: list, unchanged: list[bool]) -> list:
        """``plans`` with each entry marked unchanged replaced by what that rank sent last time."""
        if any(unchanged) and (previous is None or len(previous) != len(plans)):
            raise CheckpointError(f"a rank sent a cached save plan but the coordinator has no cache; {NO_CACHE_MESSAGE}")
        return [previous[i] if same else p for i, (p, same) in enumerate(zip(plans, unchanged))]
