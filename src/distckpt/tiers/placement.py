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

    A report is ``{"own": [[step, save], ...], "replicas": {owner rank: [[step, save], ...]}, "durable": [steps]}``
    (durable steps from any rank that lists them). ``save`` names the manager incarnation that saved the copy: a
    string that orders incarnations by when they started. A step is whole in memory for one save only: every
    rank's source must hold the copy that same incarnation saved, so copies of one step number from two histories
    (a node that came back with an old tier) never mix. ``struck`` holds ``(rank, step, source)`` triples that
    failed and may not be used again (a durable step struck on any rank is struck for all).

    The memory candidate is the newest save's newest step whole in memory (a later incarnation continued from
    what it restored, so its steps are the run's present); the durable tier's newest step that is not struck
    wins where it is newer than that. Returns ``(step, "memory" | "durable" | "none", sources)`` where
    ``sources[r]`` is ``"own"``, the rank holding r's replica, or ``"durable"``.
    """
    world = len(reports)
    durable = sorted({int(s) for r in reports for s in r.get("durable", [])})
    durable = [s for s in durable if not any((rank, s, "durable") in struck for rank in range(world))]
    own: dict[tuple[int, int], str] = {}
    holders: dict[tuple[int, int, str], list[int]] = {}
    for rank, report in enumerate(reports):
        for step, save in report.get("own", []):
            own[(rank, int(step))] = str(save)
        for owner, entries in report.get("replicas", {}).items():
            for step, save in entries:
                holders.setdefault((int(owner), int(step), str(save)), []).append(rank)

    def source(rank: int, step: int, save: str) -> Any:
        if own.get((rank, step)) == save and (rank, step, "own") not in struck:
            return "own"
        for holder in sorted(holders.get((rank, step, save), [])):
            if (rank, step, holder) not in struck:
                return holder
        return None

    candidates = sorted({(save, step) for (_, step), save in own.items()} | {(save, step) for _, step, save in holders},
                        reverse=True)
    for save, step in candidates:
        sources = {rank: source(rank, step, save) for rank in range(world)}
        if all(s is not None for s in sources.values()):
            if durable and durable[-1] > step:
                break
            return step, "memory", sources
    if durable:
        return durable[-1], "durable", {rank: "durable" for rank in range(world)}
    return None, "none", {}
