"""DCP's module name for deduplicating replicated items across ranks' save plans (the body: distckpt.planning)."""

from .planning.dcp_helpers import dedup_save_plans

__all__ = ["dedup_save_plans"]
