"""Where each rank's replicas go, and what a restore can take from where: pure functions of the ranks' reports."""

from __future__ import annotations

from typing import Any, Optional

from ..errors import CheckpointError

__all__ = ["replica_targets", "choose_restore"]


def replica_targets(nodes: list[str], replicas: int) -> dict[int, list[int]]:
    """For each rank, the ranks that keep its replicas: the same local index (modulo the node's size) on the next
    ``replicas`` nodes, cyclically, nodes ordered by their lowest rank. ``nodes[r]`` is rank r's node identity."""
    order: list[str] = []
    members: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        if node not in members:
            order.append(node)
            members[node] = []
        members[node].append(rank)
    if replicas >= len(order):
        raise CheckpointError(f"replicas={replicas} needs at least {replicas + 1} nodes; this job has {len(order)} "
                              f"({', '.join(order)}): a replica is never kept on its own rank's node. Lower replicas=")
    targets: dict[int, list[int]] = {}
    for n, node in enumerate(order):
        for index, rank in enumerate(members[node]):
            targets[rank] = []
            for k in range(1, replicas + 1):
                peers = members[order[(n + k) % len(order)]]
                targets[rank].append(peers[index % len(peers)])
    return targets


def choose_restore(reports: list[dict[str, Any]], struck: frozenset = frozenset()) -> tuple[Optional[int], str, dict[int, Any]]:
    """The step every rank restores and each rank's source, from every rank's report.

    A report is ``{"own": [steps], "replicas": {owner rank: [steps]}, "durable": [steps]}`` (durable steps from any
    rank that lists them). ``struck`` holds ``(rank, step, source)`` triples that failed verification and may not be
    used again. Returns ``(step, "memory" | "durable" | "none", sources)`` where ``sources[r]`` is ``"own"``, the
    rank holding r's replica, or ``"durable"``.
    """
    world = len(reports)
    durable = sorted({int(s) for r in reports for s in r.get("durable", [])})
    holders: dict[tuple[int, int], list[int]] = {}
    for holder, report in enumerate(reports):
        for owner, steps in report.get("replicas", {}).items():
            for step in steps:
                holders.setdefault((int(owner), int(step)), []).append(holder)

    def source(rank: int, step: int) -> Any:
        if step in reports[rank].get("own", []) and (rank, step, "own") not in struck:
            return "own"
        for holder in sorted(holders.get((rank, step), [])):
            if (rank, step, holder) not in struck:
                return holder
        return None

    candidates = sorted({int(s) for r in reports for s in r.get("own", [])} | {s for _, s in holders}, reverse=True)
    newest_durable = durable[-1] if durable else None
    for step in candidates:
        if newest_durable is not None and newest_durable > step:
            break
        sources = {rank: source(rank, step) for rank in range(world)}
        if all(s is not None for s in sources.values()):
            return step, "memory", sources
    for step in reversed(durable):
        if all((rank, step, "durable") not in struck for rank in range(world)):
            return step, "durable", {rank: "durable" for rank in range(world)}
    return None, "none", {}
