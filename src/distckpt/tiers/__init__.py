"""Tiered checkpoints: node-local memory, replicas on other nodes, a durable tier (docs/tiers.md)."""

from .manager import RestoreReport, TieredCheckpointManager
from .placement import choose_restore, replica_targets

__all__ = ["TieredCheckpointManager", "RestoreReport", "replica_targets", "choose_restore"]
