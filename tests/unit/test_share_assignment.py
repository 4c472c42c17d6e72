"""Shared reads' assignment (engine/share_assignment.py) answers what the rules stated entry by entry answer
(share_reference.py), byte for byte, over random tables: shared and unshared chunks, disagreeing lengths, two
shapes of one storage, checkpoints, nodes, ranks that do not verify, buckets that cut chunks into pieces."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from distckpt.engine.share_assignment import plan_shares
from distckpt.errors import CorruptCheckpointError

from . import share_reference


@st.composite
def _inputs(draw):
    world = draw(st.integers(1, 6))
    pool = draw(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5), st.integers(1, 40), st.integers(1, 12)),
                         min_size=1, max_size=8, unique_by=lambda c: c[:2]))
    tables = []
    for _ in range(world):
        if tables and draw(st.integers(0, 2)) == 0:  # the same table as another rank's (a replica)
            tables.append(tables[draw(st.integers(0, len(tables) - 1))].copy())
            continue
        picked = draw(st.permutations(range(len(pool))))[:draw(st.integers(0, len(pool)))]
        if picked and draw(st.integers(0, 29)) == 0:  # a table listing a chunk twice: refused
            picked.append(picked[0])
        rows = []
        for i in picked:
            f, o, n, row = pool[i]
            if draw(st.integers(0, 9)) == 0:  # another length, or another shape, for the same place
                n, row = draw(st.sampled_from([(n + 1, row), (n, row + 1)]))
            first = draw(st.integers(0, n - 1))
            end = draw(st.integers(first + 1, n))
            rows.append((f, o, n, row, first, end))
        tables.append(np.array(rows, dtype="<i8").reshape(-1, 6).T.copy())
    bucket = draw(st.integers(1, 64))
    verify = draw(st.booleans())
    verifying = draw(st.none() | st.lists(st.booleans(), min_size=world, max_size=world))
    kinds = draw(st.none() | st.lists(st.integers(0, 1), min_size=world, max_size=world))
    nodes = draw(st.none() | st.lists(st.integers(0, 2), min_size=world, max_size=world))
    own = draw(st.none() | st.lists(st.integers(0, 100), min_size=world, max_size=world))
    min_run = draw(st.sampled_from([1, 1, 10, 50, 1000]))
    return tables, bucket, verify, verifying, kinds, nodes, own, min_run


def _answer(plan, tables, *args):
    try:
        return plan(tables, *args)
    except CorruptCheckpointError as exc:
        return f"refused: {exc}"


@given(_inputs())
def test_the_array_assignment_answers_as_the_rules_entry_by_entry(case):
    tables, *args = case
    assert _answer(plan_shares, tables, *args) == _answer(share_reference.plan_shares, tables, *args)


@pytest.mark.parametrize("world", [1, 3, 64])
def test_replicated_and_disjoint_tables_at_a_few_sizes(world):
    rng = np.random.default_rng(world)
    n = rng.integers(1, 5000, size=40)
    base = np.stack([np.zeros(40), np.arange(40) * 8192, n, np.full(40, 16), np.zeros(40), n]).astype("<i8")
    own = [np.stack([np.full(3, 1), np.arange(3) * 8192 + r, np.full(3, 100), np.full(3, 10), np.zeros(3),
                     np.full(3, 100)]).astype("<i8") for r in range(world)]
    for tables in ([base] * world, own, [np.concatenate([base, o], axis=1) for o in own]):
        for bucket in (1 << 20, 3000):
            assert plan_shares(tables, bucket, True) == share_reference.plan_shares(tables, bucket, True)
            assert plan_shares(tables, bucket, False) == share_reference.plan_shares(tables, bucket, False)
