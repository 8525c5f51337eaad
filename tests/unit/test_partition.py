"""Partition and placement as pure functions."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_bfpp.plan.partition import StagePlan, balance_by_weight, rank_stages, stage_rank, uniform_counts


def test_looping_placement():
    assert [stage_rank(s, 4) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert rank_stages(1, 4, 3) == (1, 5, 9)


def test_uniform_counts():
    assert uniform_counts(10, 4) == (3, 3, 2, 2)
    with pytest.raises(ValueError):
        uniform_counts(3, 4)


def test_balance_puts_heavy_layers_alone():
    # embedding and head are heavy; the blocks are light
    weights = [1000, 100, 100, 100, 100, 100, 100, 1000]
    counts = balance_by_weight(weights, 4)
    assert counts[0] == 1 and counts[-1] == 1
    assert sum(counts) == len(weights)


def test_balance_spreads_parameter_free_layers():
    # a Linear/ReLU alternation: activations must not pile up on one stage
    weights = [100, 0] * 4
    assert balance_by_weight(weights, 4) == (2, 2, 2, 2)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=14), st.data())
def test_balance_is_optimal_and_contiguous(weights, data):
    stages = data.draw(st.integers(1, len(weights)))
    counts = balance_by_weight(weights, stages)
    assert len(counts) == stages and all(c >= 1 for c in counts) and sum(counts) == len(weights)

    def heaviest(cs):
        out, i = 0, 0
        for c in cs:
            out = max(out, sum(w + 1 for w in weights[i : i + c]))
            i += c
        return out

    # brute force over all cut positions for small inputs
    import itertools

    n = len(weights)
    best = min(
        heaviest([b - a for a, b in zip((0, *cuts), (*cuts, n), strict=True)])
        for cuts in itertools.combinations(range(1, n), stages - 1)
    )
    assert heaviest(counts) == best


def test_stage_plan_maps_layers_stages_and_ranks():
    names = tuple(f"blocks.{i}" for i in range(8))
    plan = StagePlan(names, (2, 2, 2, 2), pipeline_parallel_size=2)
    assert plan.stages_per_rank == 2
    assert plan.stage_layers(2) == ("blocks.4", "blocks.5")
    assert plan.stages_of(1) == (1, 3)
    assert plan.layers_of(1) == ("blocks.2", "blocks.3", "blocks.6", "blocks.7")
    assert "stage   3 on pipeline rank   1" in plan.describe([1] * 8)
    with pytest.raises(ValueError, match="multiple"):
        StagePlan(names, (4, 2, 2), pipeline_parallel_size=2)
