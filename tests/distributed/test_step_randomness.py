"""Random draws and side effects before ``self(...)``: the first stage's input and the last stage's loss agree.

The first stage runs a step up to ``self(...)`` to capture the model's input; the last stage runs it again
to compute the loss. Identity layers make every objective exactly 0 when both runs drew the same numbers
(torch, NumPy and Python generators), under pipeline_parallel_size 1 and 2 and data_parallel_size 1 and 2.
"""

from __future__ import annotations

import pytest

from tests.distributed.harness import launch
from tests.models import RunSpec

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

OBJECTIVES = ("loss_randn", "loss_mask", "loss_numpy", "loss_python")
LAYOUTS = {  # name: (devices, strategy, local batch size); 2 epochs of 64 samples
    "p1_dp1": (1, {"pipeline_parallel_size": 1, "stages_per_rank": 2, "num_microbatches": 2}, 16),
    "p2_dp1": (2, {"pipeline_parallel_size": 2, "stages_per_rank": 2, "num_microbatches": 4}, 16),
    "p1_dp2": (2, {"pipeline_parallel_size": 1, "stages_per_rank": 2, "num_microbatches": 2}, 8),
    "p2_dp2": (4, {"pipeline_parallel_size": 2, "stages_per_rank": 1, "num_microbatches": 2}, 8),
}


def consistency_run(layout: str) -> RunSpec:
    devices, strategy, batch = LAYOUTS[layout]
    return RunSpec(
        name=f"draws_{layout}",
        strategy=strategy,
        model_factory="tests.stochastic_models:draws_before_model",
        trainer={"max_epochs": 2, "max_steps": -1},
        local_batch_size=batch,
        data_parallel_size=devices // strategy["pipeline_parallel_size"],
    )


def noisy_run(name: str) -> RunSpec:
    return RunSpec(
        name=name,
        strategy={"pipeline_parallel_size": 2, "stages_per_rank": 2, "num_microbatches": 4},
        model={"optimizer": "sgd"},
        model_factory="tests.stochastic_models:noisy_pipenet",
        trainer={"max_steps": 4},
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = {}
    for devices in (1, 2, 4):
        runs = [consistency_run(layout) for layout, (d, _, _) in LAYOUTS.items() if d == devices]
        if devices == 2:
            runs += [noisy_run("noisy_a"), noisy_run("noisy_b")]
        out.update(launch(runs, devices, tmp_path_factory.mktemp(f"randomness{devices}")))
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_draws_before_the_model_are_the_same_on_first_and_last_stage(results, layout):
    result = results[f"draws_{layout}"]
    for rank, rank_result in enumerate(result.ranks):
        steps = rank_result["steps"]
        assert len(steps) == 2 * 64 // (LAYOUTS[layout][2] * result.ranks[0]["holdings"]["layout"]["dp"])
        for step in steps:
            for name in OBJECTIVES:
                assert step["callback_metrics"][name] == 0.0, (rank, step["step"], name, step["callback_metrics"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_metric_updated_before_the_model_counts_each_sample_once(results, layout):
    """The capture run on the first stage must not add to the metric: the epoch value is one device's, 64."""
    for rank_result in results[f"draws_{layout}"].ranks:
        assert rank_result["final_metrics"]["samples_seen"] == 64.0


def test_a_stochastic_objective_trained_twice_with_the_same_seed_is_bit_identical(results):
    a, b = results["noisy_a"], results["noisy_b"]
    losses_a = [s["callback_metrics"]["train_loss"] for s in a.steps(0)]
    losses_b = [s["callback_metrics"]["train_loss"] for s in b.steps(0)]
    assert losses_a == losses_b
    assert len(set(losses_a)) == len(losses_a)  # the draws change from step to step
    for name, value in a.params.items():
        assert (value == b.params[name]).all(), name
