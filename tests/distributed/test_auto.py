"""``pipeline_parallel_size="auto"``: the planner measures the module and picks one layout for all ranks."""

from __future__ import annotations

import dataclasses

import pytest

from tests.distributed.harness import assert_params_match, assert_steps_match, launch
from tests.models import RunSpec, reference_run

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

# what the planner decides and the strategy must run as decided
DECIDED = (
    "schedule",
    "pipeline_parallel_size",
    "data_parallel_size",
    "stages_per_rank",
    "num_microbatches",
    "microbatch_group_size",
    "sharding",
    "mesh_order",
    "stage_layer_counts",
)


def test_strategy_runs_the_planners_first_layout_and_training_matches_one_device(tmp_path):
    run = RunSpec(name="auto", strategy={"pipeline_parallel_size": "auto"}, model={"optimizer": "sgd"},
                  local_batch_size=8, trainer={"max_steps": 4}, checks=["planner_ranking"])  # fmt: skip
    result = launch([run], 4, tmp_path, timeout=500)["auto"]
    layouts = [r["holdings"]["layout"] for r in result.ranks]
    assert all(layout == layouts[0] for layout in layouts)  # decided once, broadcast
    # the planner ran on global rank 0 only; every rank ran its first-ranked layout
    ranked = result.ranks[0]["planner_ranking"]["ranked"]
    assert len(ranked) > 1, "a single feasible layout leaves nothing to rank"
    assert all(not r["planner_ranking"]["ranked"] for r in result.ranks[1:])
    throughputs = [c["throughput"] for c in ranked]
    assert throughputs == sorted(throughputs, reverse=True)  # ranked fastest first
    best = {key: ranked[0][key] for key in DECIDED}
    for rank, rank_result in enumerate(result.ranks):
        ran = {key: rank_result["planner_ranking"]["ran"][key] for key in DECIDED}
        assert ran == best, f"rank {rank} ran {ran}, the planner ranked first {best}"
    # and the training is the one-device training of the same global batch
    ref = reference_run(dataclasses.replace(run, data_parallel_size=best["data_parallel_size"]))
    assert_steps_match(result, ref, tol=1e-5)
    assert_params_match(result, ref, tol=1e-5)
