"""The memory tier's pure choices: where replicas go, and which step and sources a restore takes."""

from hypothesis import given, settings
from hypothesis import strategies as st

from distckpt.tiers.placement import choose_restore, replica_targets


def _report(own=(), replicas=None, durable=()):
    return {"own": [list(e) for e in own], "replicas": {str(o): [list(e) for e in es] for o, es in (replicas or {}).items()},
            "durable": list(durable)}


def test_replicas_go_to_other_nodes():
    targets = replica_targets(["a", "a", "b", "b"], 1)
    assert targets == {0: [2], 1: [3], 2: [0], 3: [1]}


def test_a_struck_durable_step_does_not_hide_an_older_step_whole_in_memory():
    # durable 2 and 4, 4 damaged; step 3 whole in memory, step 4 not: step 3 from memory, not durable 2
    reports = [_report(own=[(3, "A"), (4, "A")], replicas={1: [(3, "A")]}, durable=[2, 4]), _report(own=[])]
    struck = frozenset({(0, 4, "durable"), (1, 4, "durable")})
    assert choose_restore(reports, struck) == (3, "memory", {0: "own", 1: 0})
    assert choose_restore(reports)[:2] == (4, "durable")


def test_copies_of_one_step_from_two_saves_never_mix():
    # rank 1's node came back with its old copy of step 2 (save A); the run had restored step 1 and saved step 2
    # again (save B), rank 1's part of it held by rank 0: step 2 of save B, rank 1's from rank 0's replica
    reports = [_report(own=[(1, "A"), (2, "B")], replicas={1: [(2, "B")]}),
               _report(own=[(1, "A"), (2, "A")], replicas={0: [(2, "A")]})]
    assert choose_restore(reports) == (2, "memory", {0: "own", 1: 0})
    # without save B's replica: save A's step 2, rank 0's part from rank 1's replica (never rank 0's copy of B)
    reports[0]["replicas"] = {}
    assert choose_restore(reports) == (2, "memory", {0: 1, 1: "own"})
    # and without that either, step 2 is whole in no save: save A's step 1, own everywhere
    reports[1]["replicas"] = {}
    assert choose_restore(reports) == (1, "memory", {0: "own", 1: "own"})


@settings(deadline=None)
@given(st.data())
def test_every_chosen_source_holds_the_chosen_step_of_one_save(data):
    world = data.draw(st.integers(1, 4))
    saves = ["A", "B"]
    entry = st.tuples(st.integers(1, 4), st.sampled_from(saves))
    reports = [_report(own=data.draw(st.lists(entry, max_size=4, unique_by=lambda e: e[0])),
                       replicas={o: data.draw(st.lists(entry, max_size=3)) for o in range(world) if o != r},
                       durable=data.draw(st.lists(st.integers(1, 4), max_size=2)) if r == 0 else [])
               for r in range(world)]
    step, tier, sources = choose_restore(reports)
    if tier != "memory":
        return

    def held(rank, src):
        entries = reports[rank]["own"] if src == "own" else reports[src]["replicas"][str(rank)]
        return {save for s, save in entries if s == step}

    assert set.intersection(*(held(rank, src) for rank, src in sources.items())), (step, sources, reports)
    durable = reports[0]["durable"]
    assert not durable or max(durable) <= step
