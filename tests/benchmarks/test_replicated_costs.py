"""The replicated-layout diagnostic's fit recovers the costs planted in its rows, and says when they do not fit."""

import pytest

from benchmarks.replicated_costs import LAYOUTS, fit_costs


def test_the_fit_recovers_a_cost_per_reduction_and_per_action_planted_in_the_excess() -> None:
    weights = [(2.0, 24.0), (4.0, 50.0), (8.0, 102.0), (2.0, 72.0)]
    rows = [(r * 0.010 - a * 0.0006, r, a) for r, a in weights]
    (per_reduction, per_action), residuals = fit_costs(rows)
    assert per_reduction == pytest.approx(0.010)
    assert per_action == pytest.approx(-0.0006)
    assert max(abs(e) for e in residuals) < 1e-12


def test_a_layout_the_two_terms_cannot_explain_shows_in_the_residuals() -> None:
    rows = [(0.0, 2.0, 24.0), (0.0, 4.0, 50.0), (0.0, 8.0, 102.0), (0.030, 2.0, 24.0)]  # the same weights, 30 ms apart
    _, residuals = fit_costs(rows)
    assert residuals[3] - residuals[0] == pytest.approx(0.030)


def test_each_layout_varies_one_thing_against_the_first() -> None:
    base = LAYOUTS["v2_m4_1MiB"]
    for name, layout in LAYOUTS.items():
        assert sum(a != b for a, b in zip(layout, base, strict=True)) == (0 if name == "v2_m4_1MiB" else 1)
