"""The tiered manager on simulated nodes (distckpt.testing.cluster: network namespaces and a private tmpfs per node
where the tests run as root, loopback and folders otherwise): a lost node restores from peer memory, bit-exact,
reading nothing from the durable tier; losing a node and its replica holder falls back to the newest durable step
on every rank; a corrupt replica is struck and every rank takes the next step whole; SIGTERM persists the newest
local step within its grace period."""

import os
import signal

import pytest

from distckpt.testing.cluster import Cluster

TRAIN = "tests.cluster.workers:train"


@pytest.fixture
def durable_env(tmp_path):
    return {"DISTCKPT_TEST_DURABLE": str(tmp_path / "durable")}


def _losses(results, rank):
    return results[rank]["losses"]


def _lose_node_after(cluster, env, run, steps, node, **kw):
    job = cluster.launch(TRAIN, env=env, run=run, steps=steps, hold=True, **kw)
    job.wait_for_marks("saved", cluster.world_size, timeout_s=240)
    cluster.kill_node(node, job)  # every process of the node, and its tmpfs
    job.stop()  # the surviving ranks' job ends too; their node (and its memory tier) stays
    for p in job.procs.values():
        p.wait(timeout=60)
    cluster.replace_node(node)


def test_a_lost_node_restores_from_its_peers_memory_bit_exact(tmp_path, durable_env):
    with Cluster(str(tmp_path / "c"), nodes=2, ranks_per_node=2) as cluster:
        reference = cluster.run(TRAIN, env=durable_env, run="ref", steps=8, timeout_s=300)
        _lose_node_after(cluster, durable_env, "run", 5, 1, persist_every=2)
        resumed = cluster.run(TRAIN, env=durable_env, run="run", steps=8, resume=True, persist_every=2, timeout_s=300)
    for rank in range(4):
        report = resumed[rank]["report"]
        assert report["step"] == 5 and report["tier"] == "memory" and report["progress"] == 5, report
        assert report["sources"] == {"0": "own", "1": "own", "2": "peer 0", "3": "peer 1"}
        assert report["bytes_from"]["durable"] == 0  # durable steps 2 and 4 exist, and none of their bytes was read
        assert report["bytes_from"]["peer" if rank >= 2 else "own"] > 0
        assert _losses(resumed, rank) == {s: _losses(reference, rank)[s] for s in ("6", "7", "8")}
        assert resumed[rank]["weights"] == reference[rank]["weights"]


@pytest.mark.slow  # guard that stays: tests/tiers/test_tier_hostile.py (a damaged durable step, the older restored)
def test_losing_a_node_and_its_replica_holder_falls_back_to_the_newest_durable_step(tmp_path, durable_env):
    with Cluster(str(tmp_path / "c"), nodes=3, ranks_per_node=1) as cluster:
        reference = cluster.run(TRAIN, env=durable_env, run="ref", steps=7, timeout_s=300)
        job = cluster.launch(TRAIN, env=durable_env, run="run", steps=5, hold=True, persist_every=2)
        job.wait_for_marks("saved", 3, timeout_s=240)
        cluster.kill_node(1, job)
        cluster.kill_node(2, job)  # node 2 held node 1's replicas
        job.stop()
        for p in job.procs.values():
            p.wait(timeout=60)
        cluster.replace_node(1)
        cluster.replace_node(2)
        resumed = cluster.run(TRAIN, env=durable_env, run="run", steps=7, resume=True, persist_every=2, timeout_s=300)
    for rank in range(3):
        report = resumed[rank]["report"]
        assert report["step"] == 4 and report["tier"] == "durable" and report["progress"] == 4, report
        assert report["bytes_from"]["durable"] > 0 and report["bytes_from"]["peer"] == 0
        assert _losses(resumed, rank) == {s: _losses(reference, rank)[s] for s in ("5", "6", "7")}
        assert resumed[rank]["weights"] == reference[rank]["weights"]


@pytest.mark.slow  # guards that stay: tests/tiers/test_mapped_step.py (a damaged step is refused), test_tier_hostile.py
def test_a_corrupt_replica_is_skipped_never_loaded(tmp_path, durable_env):
    with Cluster(str(tmp_path / "c"), nodes=2, ranks_per_node=2) as cluster:
        reference = cluster.run(TRAIN, env=durable_env, run="ref", steps=7, timeout_s=300)
        _lose_node_after(cluster, durable_env, "run", 5, 1, persist_every=2)
        resumed = cluster.run(TRAIN, env=durable_env, run="run", steps=7, resume=True, persist_every=2,
                              corrupt={"holder": 0, "owner": 2, "step": 5}, timeout_s=300)
    for rank in range(4):
        report = resumed[rank]["report"]
        # rank 2's only copy of step 5 failed its checksum: step 5 is not whole anywhere, so every rank takes step 4,
        # still in memory (keep_local=2), after one round struck the bad replica
        assert report["step"] == 4 and report["tier"] == "memory" and report["rounds"] == 2, report
        assert report["bytes_from"]["durable"] == 0
        assert _losses(resumed, rank) == {s: _losses(reference, rank)[s] for s in ("5", "6", "7")}


def test_sigterm_persists_the_newest_local_step_within_the_grace_period(tmp_path, durable_env):
    with Cluster(str(tmp_path / "c"), nodes=2, ranks_per_node=1) as cluster:
        job = cluster.launch(TRAIN, env=durable_env, run="run", steps=3, hold=True, persist_every=0, preempt_grace_s=30)
        job.wait_for_marks("saved", 2, timeout_s=240)
        assert not os.path.exists(tmp_path / "durable" / "run" / "step-0000000003")  # nothing persisted yet
        job.signal_workers(signal.SIGTERM)
        for p in job.procs.values():
            p.wait(timeout=60)
        logs = job.logs()
    assert os.path.isfile(tmp_path / "durable" / "run" / "step-0000000003" / "metadata.json")
    for node in (0, 1):
        assert "persisted step 3" in logs[node] and "(within the 30 s grace)" in logs[node], logs[node][-2000:]


@pytest.mark.slow  # guard that stays: test_sigterm_persists_the_newest_local_step_within_the_grace_period
def test_sigterm_after_a_failed_save_persists_the_newest_step_whole_everywhere(tmp_path, durable_env):
    with Cluster(str(tmp_path / "c"), nodes=2, ranks_per_node=1) as cluster:
        job = cluster.launch(TRAIN, env=durable_env, run="run", steps=3, hold=True, persist_every=0, preempt_grace_s=30,
                             fail_last=True)
        job.wait_for_marks("saved", 2, timeout_s=240)
        job.signal_workers(signal.SIGTERM)
        for p in job.procs.values():
            p.wait(timeout=60)
        logs = job.logs()
    assert os.path.isfile(tmp_path / "durable" / "run" / "step-0000000002" / "metadata.json")
    assert not os.path.exists(tmp_path / "durable" / "run" / "step-0000000003")
    for node in (0, 1):
        assert "step 3 failed as planned" in logs[node], logs[node][-2000:]
        assert "persisted step 2" in logs[node] and "(within the 30 s grace)" in logs[node], logs[node][-2000:]


@pytest.mark.slow  # guards that stay: tests/tiers/test_state_machine.py (failed saves, lost nodes), test_a_lost_node_...
def test_sigkill_anywhere_in_a_save_never_restores_a_mixed_step(tmp_path, durable_env):
    """The whole job is SIGKILLed at points spread over local writes, replication and persisting (every node keeps
    its memory tier); the restore then takes a step whose every byte is that step's, on every rank. Of four equal
    stretches of the run, the last (replication and persisting, where a mixed step could arise); all four and eight
    more under --run-slow (a kill in the local writes of the first stretch: also
    tests/tiers/test_state_machine.py's failed saves and lost nodes)."""
    _sigkill_sweep(tmp_path, durable_env, kills=4, seed=23, stretches=(3,))


@pytest.mark.slow
def test_every_stretch_of_sigkills_never_restores_a_mixed_step(tmp_path, durable_env):
    _sigkill_sweep(tmp_path, durable_env, kills=4, seed=23)


@pytest.mark.slow
def test_many_sigkills_never_restore_a_mixed_step(tmp_path, durable_env):
    _sigkill_sweep(tmp_path, durable_env, kills=12, seed=24)


def _sigkill_sweep(tmp_path, durable_env, kills, seed, stretches=None):
    import random
    import time

    rng = random.Random(seed)
    offsets = [rng.random() for _ in range(kills)]  # drawn for every stretch, so a subset kills at the same times
    with Cluster(str(tmp_path / "c"), nodes=2, ranks_per_node=2) as cluster:
        reference = cluster.run(TRAIN, env=durable_env, run="ref", steps=6, extra_mb=16, timeout_s=300)
        for i in stretches if stretches is not None else range(kills):
            run = f"sweep{i}"
            job = cluster.launch(TRAIN, env=durable_env, run=run, steps=6, persist_every=2, extra_mb=16)
            # past start-up, somewhere in the steps and their saves: one kill in each of ``kills`` equal stretches
            time.sleep(6.0 + 8.0 * (i + offsets[i]) / kills)
            job.stop()
            for p in job.procs.values():
                p.wait(timeout=60)
            resumed = cluster.run(TRAIN, env=durable_env, run=run, steps=6, resume=True, persist_every=2, extra_mb=16,
                                  timeout_s=300)
            steps = {resumed[r]["report"]["step"] for r in range(4)}
            assert len(steps) == 1, steps  # every rank agreed
            step = steps.pop()
            for rank in range(4):
                report = resumed[rank]["report"]
                if step is None:
                    assert report["tier"] == "none"
                    continue
                assert report["weights"] == reference[rank]["digests"][str(step)], (i, step, rank)
                assert report["extra"] == float(step)
                assert resumed[rank]["weights"] == reference[rank]["weights"]
