"""``pipeline_parallel_size="auto"`` and ``schedule="auto"``: the planner measures the module (or reads the profile
it is given) and picks one layout for all ranks, within ``memory_budget`` where one is given."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest

from tests.distributed.harness import (
    assert_params_match,
    assert_steps_match,
    assert_trained_as_on_one_device,
    launch,
)
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


PLAIN = RunSpec(name="auto", strategy={"pipeline_parallel_size": "auto"}, model={"optimizer": "sgd"},
               local_batch_size=8, trainer={"max_steps": 4}, checks=["planner_ranking"])  # fmt: skip
# the suite's PipeNet with its blocks' MLPs split over tensor groups of 2 by its `parallelize_layer`
TENSOR = RunSpec(name="auto_tp", strategy={"pipeline_parallel_size": "auto", "tensor_parallel_size": 2},
                 model={"optimizer": "sgd", "tp": "layer"}, model_factory="tests.tp_models:make", local_batch_size=8,
                 trainer={"max_steps": 4}, checks=["planner_ranking"])  # fmt: skip


# the schedule chosen too, at a fixed pipeline size: among every kind the other arguments allow
SCHEDULE = RunSpec(name="auto_schedule", strategy={"pipeline_parallel_size": 2, "schedule": "auto"},
                   model={"optimizer": "sgd"}, local_batch_size=8, trainer={"max_steps": 4},
                   checks=["planner_ranking"])  # fmt: skip


def _budget_case() -> tuple[Path, Path, int, dict]:
    """A profile and a machine given to the planner (so that its ranking is known here), the fastest layout's
    predicted peak less one byte as the budget, and the layout that then is the fastest that fits."""
    from lightning_bfpp.adapter import auto
    from lightning_bfpp.plan import Cluster, LayerCost, ModelProfile
    from lightning_bfpp.plan.config import PipelineConfig

    # 10 layers like PipeNet's (embed, 8 blocks, head), with activations large beside the weights: layouts that
    # hold every micro-batch's activations (breadth-first's sweeps) need more memory than those that do not
    layer = LayerCost(1e-3, 2e-3, 4096, 2**14, 2**20, backward_weight_s=1e-3, intermediate_grad_bytes=2**18)
    profile = ModelProfile(tuple([layer] * 10), microbatch_size=8)
    cluster = Cluster(4, 4, 2**40, 1e9, 1e9, action_overhead_s=1e-4)
    folder = Path(tempfile.mkdtemp(prefix="bfpp-auto-budget-"))
    profile.to_json(folder / "profile.json")
    cluster.to_json(folder / "cluster.json")
    config = PipelineConfig(pipeline_parallel_size=2, schedule="auto")
    space = auto.search_space(config, (2,))
    ranked = [c for c in auto.search_per_replica_batch(profile, cluster, 8, space) if c.infeasible is None]
    budget = ranked[0].prediction.peak_memory - 1
    fits = next(c for c in ranked if c.prediction.peak_memory <= budget)
    return folder / "profile.json", folder / "cluster.json", budget, dataclasses.asdict(fits.config)


PROFILE_FILE, CLUSTER_FILE, BUDGET, FITS = _budget_case()
BUDGETED = RunSpec(name="auto_budget", strategy={"pipeline_parallel_size": 2, "schedule": "auto",
                   "plan_profile": str(PROFILE_FILE), "cluster": str(CLUSTER_FILE), "memory_budget": BUDGET},
                   model={"optimizer": "sgd"}, local_batch_size=8, trainer={"max_steps": 4},
                   checks=["planner_ranking"])  # fmt: skip


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch([PLAIN, TENSOR, SCHEDULE, BUDGETED], 4, tmp_path_factory.mktemp("auto"), timeout=500)


def _ran_the_first_ranked(result) -> dict:
    """Every rank ran the layout the planner (on global rank 0 only) ranked first; returns it."""
    layouts = [r["holdings"]["layout"] for r in result.ranks]
    assert all(layout == layouts[0] for layout in layouts)  # decided once, broadcast
    ranked = result.ranks[0]["planner_ranking"]["ranked"]
    assert len(ranked) > 1, "a single feasible layout leaves nothing to rank"
    assert all(not r["planner_ranking"]["ranked"] for r in result.ranks[1:])
    throughputs = [c["throughput"] for c in ranked]
    assert throughputs == sorted(throughputs, reverse=True)  # ranked fastest first
    best = {key: ranked[0][key] for key in DECIDED}
    for rank, rank_result in enumerate(result.ranks):
        ran = {key: rank_result["planner_ranking"]["ran"][key] for key in DECIDED}
        assert ran == best, f"rank {rank} ran {ran}, the planner ranked first {best}"
    return best


def test_strategy_runs_the_planners_first_layout_and_training_matches_one_device(results):
    result = results["auto"]
    best = _ran_the_first_ranked(result)
    # and the training is the one-device training of the same global batch
    ref = reference_run(dataclasses.replace(PLAIN, data_parallel_size=best["data_parallel_size"]))
    assert_steps_match(result, ref, tol=1e-5)
    assert_params_match(result, ref, tol=1e-5)


def test_with_tensor_parallelism_it_measures_the_layers_split_and_trains_as_one_device(results):
    """Every tensor group measures each layer split by the module's own ``parallelize_layer``: the planner
    sees one tensor rank's share (each block's MLP weights halved; the embedding, norms and head whole) and
    each block's one all-reduce (its row-wise ``down``), and plans tensor groups of 2; the layout it ranks
    first runs, equal to one device."""
    from lightning_bfpp.engine.layers import pipeline_layers
    from tests.models import Block, make_model

    result = results["auto_tp"]
    best = _ran_the_first_ranked(result)
    assert {c["tensor_parallel_size"] for c in result.ranks[0]["planner_ranking"]["ranked"]} == {2}
    assert [r["holdings"]["tensor_rank"] for r in result.ranks] == [0, 1, 0, 1]
    whole, share, all_reduces = [], [], []
    for _, layer in pipeline_layers(make_model(TENSOR)):
        whole.append(sum(p.numel() * 4 for p in layer.parameters()))
        all_reduces.append(int(isinstance(layer, Block)))  # down's partial sums; nothing elsewhere
        # up's rows and down's columns are split; down's bias is added once, after the all-reduce: whole
        split = sum(p.numel() * 4 for n, p in layer.named_parameters() if n in ("up.weight", "up.bias", "down.weight"))
        share.append(whole[-1] - split // 2)
    assert share != whole
    profile = result.ranks[0]["planner_ranking"]["profile"]
    assert [layer["param_bytes"] for layer in profile] == share
    # the collectives counted per layer, and every layer marked as one rank's share of a split over 2
    assert [layer["tensor_parallel_all_reduces"] for layer in profile] == all_reduces
    assert {layer["measured_split"] for layer in profile} == {2}
    assert_trained_as_on_one_device(
        result, dataclasses.replace(TENSOR, data_parallel_size=best["data_parallel_size"]), tol=1e-5
    )


def test_with_schedule_auto_it_chooses_among_the_schedules_and_trains_as_one_device(results):
    result = results["auto_schedule"]
    best = _ran_the_first_ranked(result)
    ranked = result.ranks[0]["planner_ranking"]["ranked"]
    # every kind that takes two ranks' pipelines was a candidate (weight passing needs one pipeline rank)
    assert {c["schedule"] for c in ranked} == {
        "breadth_first", "breadth_first_zb", "depth_first", "gpipe", "1f1b", "interleaved_zb", "zbv",
    }  # fmt: skip
    assert {c["pipeline_parallel_size"] for c in ranked} == {2}
    assert_trained_as_on_one_device(
        result, dataclasses.replace(SCHEDULE, data_parallel_size=best["data_parallel_size"]), tol=1e-5
    )


def test_with_a_memory_budget_it_runs_the_fastest_layout_that_fits(results):
    """The budget is the fastest layout's predicted peak less a byte: the planner leaves it out and the strategy
    runs the fastest one whose predicted peak fits, equal to one device."""
    result = results["auto_budget"]
    best = _ran_the_first_ranked(result)
    for key in DECIDED:
        if key != "stage_layer_counts":  # the planner balanced the stages; the run names its counts
            assert best[key] == FITS[key], (key, best[key], FITS[key])
    assert_trained_as_on_one_device(
        result, dataclasses.replace(BUDGETED, data_parallel_size=best["data_parallel_size"]), tol=1e-5
    )
