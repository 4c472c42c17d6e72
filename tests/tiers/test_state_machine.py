"""A hypothesis state machine over the tiered manager: save, a save that fails on one rank, persist, preempt (what
SIGTERM's handler does), lose a node (its tier wiped, every process restarted), restart every process, restore,
corrupt a replica. It runs as a job of the Cluster kit in loopback mode: 2 nodes of 2 ranks (torchrun's multi-node
rendezvous, a tier directory per node), one replica each. Rank 0 runs the machine and sends each rule to the other
ranks.

After every rule each rank's tier holds the steps the bound keeps. After every restore: every rank has the values
of one step (never a mixed step), the step is the newest that own tiers, uncorrupted replicas on live nodes or the
durable tier can assemble whole (never an older one), and every step persisted is still in the durable tier (never
a lost durable step)."""

import os
import shutil

import pytest
import torch

WORLD, KEEP = 4, 2
TARGET = {0: 2, 1: 3, 2: 0, 3: 1}  # each rank's replica holder: the same index on the other node


def _node(rank):
    return rank // 2


class _Rank:
    """One rank's side: its manager and its training state, rebuilt as a restarted process would."""

    def __init__(self, rank, base):
        self.rank, self.base = rank, base
        self.mgr = None

    def start(self, run=None):
        import distckpt

        if run is not None:
            self.root = os.path.join(self.base, run)
            # the node's own tier directory where the Cluster kit gives one (a folder per node in loopback mode)
            node_dir = os.environ.get("DISTCKPT_TIER_DIR") or os.path.join(self.base, f"node{_node(self.rank)}")
            self.local = os.path.join(node_dir, run)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        # each rank's own shard of one tensor, so that every tier (the durable one too) keeps each rank's values
        mesh = init_device_mesh("cpu", (WORLD,))
        self.state = {"w": DTensor.from_local(torch.zeros(64), mesh, [Shard(0)], run_check=False), "meta": {"step": -1}}
        self.mgr = distckpt.TieredCheckpointManager(os.path.join(self.root, "durable"), local=self.local, replicas=1,
                                                    keep_local=KEEP, persist_every=0)

    def do(self, cmd):
        kind = cmd["do"]
        if kind == "fresh":
            if self.mgr is not None:
                self.mgr.close()
            self.start(cmd["root"])
            return None
        if kind == "save":
            self.state["w"].to_local().fill_(1000 * cmd["step"] + self.rank)
            self.state["meta"]["step"] = cmd["step"]
            self.mgr.save(cmd["step"], self.state)
            self.mgr.wait()
            return None
        if kind == "fail":  # the local write of this step fails on one rank (its tmpfs is full)
            from distckpt import faults

            before, meta = self.state["w"].to_local().clone(), self.state["meta"]["step"]
            self.state["w"].to_local().fill_(1000 * cmd["step"] + self.rank)
            self.state["meta"]["step"] = cmd["step"]
            fault = faults.Fault("enospc", kinds=("write",)) if self.rank == cmd["rank"] else faults.Fault("call")
            outcome = "saved"
            with faults.inject(fault):
                self.mgr.save(cmd["step"], self.state)
                try:
                    self.mgr.wait()
                except Exception:  # noqa: BLE001 - the step fails on every rank
                    outcome = "failed"
            self.state["w"].to_local().copy_(before)  # training goes on from what it had before the failed step
            self.state["meta"]["step"] = meta
            return outcome
        if kind == "preempt":  # what SIGTERM's handler does, short of exiting
            return self.mgr.preempt()
        if kind == "persist":
            return self.mgr.persist()
        if kind == "inspect":
            return {"own": self.mgr.own_steps(), "held": {str(o): ss for o, ss in self.mgr.replica_steps().items()}}
        if kind == "corrupt":
            if self.rank == cmd["holder"]:
                held = os.path.join(self.mgr.held_dir, f"rank-{cmd['owner']}", f"step-{cmd['step']}")
                data = sorted(f for f in os.listdir(held) if f.endswith(".safetensors"))[0]
                with open(os.path.join(held, data), "r+b") as f:
                    f.seek(-1, os.SEEK_END)
                    b = f.read(1)
                    f.seek(-1, os.SEEK_END)
                    f.write(bytes([b[0] ^ 1]))
            return None
        if kind in ("kill", "restart"):
            self.mgr.close()
            if kind == "kill" and _node(self.rank) == cmd["node"]:
                for folder in (self.mgr.own_dir, self.mgr.held_dir):
                    shutil.rmtree(folder, ignore_errors=True)
            import torch.distributed as dist

            dist.barrier()  # the wipe is done everywhere before any rank starts again
            self.start()
        report = self.mgr.restore(self.state)
        w = self.state["w"].to_local()
        return {"step": report.step, "tier": report.tier, "values": sorted({float(v) for v in w.tolist()}),
                "meta": self.state["meta"]["step"], "durable": self.mgr.durable.all_steps()}


def _machine(rank, world_size, root, examples, steps):
    import torch.distributed as dist
    from hypothesis import settings
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test


    def all_gather_json(obj, group):
        out = [None] * world_size
        dist.all_gather_object(out, obj, group=group)
        return out

    os.environ["DISTCKPT_NODE_ID"] = f"node{_node(rank)}"
    me = _Rank(rank, root)

    def everyone(cmd):
        cmd = all_gather_json(cmd if rank == 0 else None, dist.group.WORLD)[0]
        if cmd is None:
            return None
        return all_gather_json(me.do(cmd), dist.group.WORLD)

    if rank != 0:
        while everyone(None) is not None:
            pass
        me.mgr.close()
        return None

    run = {"n": 0}

    class Tiers(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            run["n"] += 1
            # each example starts from empty tiers: a new durable root and node folders, every rank restarted
            everyone({"do": "fresh", "root": f"run{run['n']}"})
            self.own = {r: set() for r in range(WORLD)}
            self.held = {h: {o: set() for o in range(WORLD) if TARGET[o] == h} for h in range(WORLD)}
            self.corrupt = set()  # (holder, owner, step)
            self.durable = set()
            self.next = 1

        def _bound(self, upto):
            for r in range(WORLD):
                steps = sorted(self.own[r] | {s for ss in self.held[r].values() for s in ss if s <= upto}, reverse=True)
                keep = set(steps[:KEEP])
                self.own[r] &= keep | {s for s in self.own[r] if s > upto}
                for o in self.held[r]:
                    gone = {s for s in self.held[r][o] if s <= upto and s not in keep}
                    self.held[r][o] -= gone
                    self.corrupt -= {(r, o, s) for s in gone}

        def _sources(self, step):
            out = {}
            for r in range(WORLD):
                if step in self.own[r]:
                    out[r] = "own"
                elif step in self.held[TARGET[r]][r] and (TARGET[r], r, step) not in self.corrupt:
                    out[r] = TARGET[r]
                else:
                    return None
            return out

        def _expect(self):
            candidates = sorted(set().union(*self.own.values(), *(ss for h in self.held.values() for ss in h.values())),
                                reverse=True)
            memory = next(((s, src) for s in candidates if (src := self._sources(s))), None)
            newest_durable = max(self.durable) if self.durable else None
            if memory and (newest_durable is None or memory[0] >= newest_durable):
                return memory[0], "memory", memory[1]
            if newest_durable is not None:
                return newest_durable, "durable", None
            return None, "none", None

        def _restore(self, cmd):
            step, tier, sources = self._expect()
            results = everyone(cmd)
            for r, res in enumerate(results):
                assert (res["step"], res["tier"]) == (step, tier), (r, res, step, tier, self.own, self.held, self.durable)
                if step is None:
                    assert res["values"] == [0.0]
                else:  # one step everywhere, never a mix
                    assert res["values"] == [1000.0 * step + r] and res["meta"] == step, (r, res, step)
                assert self.durable <= set(res["durable"]), (self.durable, res["durable"])
            if step is None:  # nothing restored: nothing deleted either
                self.next = 1
                return
            for r in range(WORLD):  # a copy fetched from a peer takes its place in the rank's own tier
                if sources and sources[r] != "own":
                    self.own[r].add(step)
            # newer steps stay where they are (a restore deletes nothing): they are never whole again, and the run's
            # next saves replace them
            self.next = step + 1

        @rule()
        def save(self):
            s = self.next
            everyone({"do": "save", "step": s})
            for r in range(WORLD):
                self.own[r].add(s)
                self.held[TARGET[r]][r].add(s)
                self.corrupt.discard((TARGET[r], r, s))  # a replica received again over the spare's files
            self._bound(s)
            self.next += 1

        @rule(rank=st.integers(0, WORLD - 1))
        def failed_save(self, rank):
            s = self.next
            got = everyone({"do": "fail", "step": s, "rank": rank})
            assert got == ["failed"] * WORLD, got
            for r in range(WORLD):  # an older copy of this step number (a history the run left) went before the save
                self.own[r].discard(s)
            self._bound(s)  # nothing of the step stays anywhere; the bound still runs
            self.next += 1

        @rule()
        def preempt(self):
            self._persist_newest({"do": "preempt"})

        @rule()
        def persist(self):
            self._persist_newest({"do": "persist"})

        def _persist_newest(self, cmd):
            common = set.intersection(*self.own.values())
            expected = max(common) if common else None
            if expected is not None and self.durable and expected < max(self.durable):
                expected = None
            got = everyone(cmd)
            assert all(g == expected for g in got), (got, expected)
            if expected is not None:
                self.durable.add(expected)

        @rule(node=st.integers(0, 1))
        def lose_node(self, node):
            for r in range(WORLD):
                if _node(r) == node:
                    self.own[r] = set()
                    self.held[r] = {o: set() for o in self.held[r]}
                    self.corrupt = {c for c in self.corrupt if c[0] != r}
            self._restore({"do": "kill", "node": node})

        @rule()
        def restart_every_process(self):
            self._restore({"do": "restart"})

        @rule()
        def restore(self):
            self._restore({"do": "restore"})

        @precondition(lambda self: any(s for h, hs in self.held.items() for o, ss in hs.items() for s in ss
                                       if (h, o, s) not in self.corrupt))
        @rule(data=st.data())
        def corrupt_a_replica(self, data):
            choices = sorted((h, o, s) for h in self.held for o, ss in self.held[h].items() for s in ss
                             if (h, o, s) not in self.corrupt)
            h, o, s = data.draw(st.sampled_from(choices))
            everyone({"do": "corrupt", "holder": h, "owner": o, "step": s})
            self.corrupt.add((h, o, s))

        @invariant()
        def durable_steps_are_never_lost(self):
            assert self.durable <= set(me.mgr.durable.all_steps()), (self.durable, me.mgr.durable.all_steps())

        @invariant()
        def each_tier_holds_what_the_bound_keeps(self):
            for r, got in enumerate(everyone({"do": "inspect"})):
                held = {int(o): set(ss) for o, ss in got["held"].items() if ss}
                assert set(got["own"]) == self.own[r], (r, got, self.own[r])
                assert held == {o: ss for o, ss in self.held[r].items() if ss}, (r, got, self.held[r])

    settings_ = settings(max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
                         derandomize=True, suppress_health_check=list(__import__("hypothesis").HealthCheck))
    try:
        run_state_machine_as_test(Tiers, settings=settings_)
    finally:
        all_gather_json(None, dist.group.WORLD)  # the other ranks stop
        me.mgr.close()
    return run["n"]


def machine_job(rank, world_size, root, examples, steps):
    """The machine as a job of the Cluster kit: torchrun's multi-node rendezvous, a tier directory per node."""
    return _machine(rank, world_size, root, examples, steps)


def _on_cluster(tmp_path, examples, steps, timeout_s):
    from distckpt.testing.cluster import Cluster

    with Cluster(str(tmp_path / "cluster"), nodes=2, ranks_per_node=2, mode="loopback") as cluster:
        out = cluster.run("tests.tiers.test_state_machine:machine_job", timeout_s=timeout_s, root=str(tmp_path / "runs"),
                          examples=examples, steps=steps, env={"DISTCKPT_CLUSTER_TIMEOUT_S": "600"})
    return out[0]


def test_state_machine_over_saves_node_losses_restores_and_persists(tmp_path):
    assert _on_cluster(tmp_path, 8, 8, timeout_s=900) >= 8


@pytest.mark.slow
def test_a_longer_state_machine(tmp_path):
    assert _on_cluster(tmp_path, 60, 20, timeout_s=3600) >= 60
