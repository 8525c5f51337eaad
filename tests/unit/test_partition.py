"""Partition and placement as pure functions."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_bfpp.plan import Plan
from lightning_bfpp.plan.partition import balance_by_weight, uniform_counts
from lightning_bfpp.plan.placement import LOOP, V


def test_looping_placement():
    assert [LOOP.rank_of(s, 4) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert LOOP.stages_of(1, 4, 3) == (1, 5, 9)


def test_v_placement_goes_down_the_ranks_and_back_up():
    assert [V.rank_of(s, 4) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert V.stages_of(0, 4, 2) == (0, 7) and V.stages_of(3, 4, 2) == (3, 4)
    assert V.stages_of(1, 2, 4) == (1, 2, 5, 6)  # a second V after the first
    for p, v in ((1, 2), (3, 2), (4, 4)):
        stages = sorted(s for r in range(p) for s in V.stages_of(r, p, v))
        assert stages == list(range(p * v)) and all(len(V.stages_of(r, p, v)) == v for r in range(p))


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


def test_plan_maps_layers_stages_and_ranks():
    names = tuple(f"blocks.{i}" for i in range(8))
    plan = Plan("breadth_first", 2, 1, 2, 2, stage_layer_counts=(2, 2, 2, 2), layer_names=names)
    assert plan.stages_per_rank == 2
    assert plan.stage_layers(2) == ("blocks.4", "blocks.5")
    assert plan.stages_of(1) == (1, 3)
    assert plan.layers_of(1) == ("blocks.2", "blocks.3", "blocks.6", "blocks.7")
    assert plan.stage_of_layer() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert "stage   3 on pipeline rank   1" in plan.describe_stages([1] * 8)
    with pytest.raises(ValueError, match="3 stage layer counts for 4 stages"):
        Plan("breadth_first", 2, 1, 2, 2, stage_layer_counts=(4, 2, 2), layer_names=names)
    with pytest.raises(ValueError, match="add up to the number of layers"):
        Plan("breadth_first", 2, 1, 2, 2, stage_layer_counts=(2, 2, 2, 1), layer_names=names)
    # the V placement: stage 3 (the last) on rank 0, with stage 0
    v = Plan("zbv", 2, 1, 2, 2, stage_layer_counts=(2, 2, 2, 2), layer_names=names)
    assert v.stages_of(0) == (0, 3) and v.layers_of(0) == ("blocks.0", "blocks.1", "blocks.6", "blocks.7")
