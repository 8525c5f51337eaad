"""Never hung, never silently wrong: errors on some ranks, bad input, killed processes.

Two mechanisms, each tested here with real processes (p=2 x dp=2 on 4 CPU processes):

- errors every rank can meet on (configuration, ``pipeline_layers()``, the user's step on the first or the
  last stage, logging, collectives inside a step, batch sizes) are raised on *every* rank with one message
  naming the failing rank and the cause; those runs share one launch, each rank recording its error;
- failures inside the schedule (a layer raising, a process killed) stop every process through the failure
  watchdog within a bound, each launch measuring the time from the fault to the last process's exit.
"""

from __future__ import annotations

import dataclasses
import re
import time

import pytest

from tests.distributed.harness import launch, run_worker
from tests.models import RunSpec

pytestmark = [pytest.mark.distributed]

P2_DP2 = {"pipeline_parallel_size": 2, "stages_per_rank": 1, "num_microbatches": 4}
FAULTY = "tests.faulty_models:faulty"
# ranks are placed pipeline-inner: global rank = data-parallel rank * 2 + pipeline rank
PLACE = {r: f"rank {r} (pipeline rank {r % 2}, data-parallel rank {r // 2})" for r in range(4)}


def faulty_run(name: str, fault: str, *, strategy=None, trainer=None, batch: int = 8, checks=(), **model) -> RunSpec:
    return RunSpec(
        name=name,
        strategy={**P2_DP2, **(strategy or {})},
        model={"optimizer": "sgd", "fault": fault, **model},
        model_factory=FAULTY,
        trainer={"max_steps": 3, **(trainer or {})},
        local_batch_size=batch,
        data_parallel_size=2,
        checks=list(checks),
        expect_error=True,
    )


# name -> (run, substrings every rank's error must contain)
AGREED: dict[str, tuple[RunSpec, tuple[str, ...]]] = {}


def case(name: str, fault: str, *expected: str, **kwargs) -> None:
    AGREED[name] = (faulty_run(name, fault, **kwargs), expected)


# an exception in the user's training_step on each rank in turn: in the input capture on first-stage ranks
# (0, 2), in the loss on last-stage ranks (1, 3)
for r in range(4):
    case(
        f"raise_train_rank{r}",
        "raise_train",
        f"failed on {PLACE[r]}",
        f"ValueError: injected failure in training_step on rank {r}",
        "`training_step`",
        fault_rank=r,
        fault_step=1,
    )
for r in (1, 2):
    case(
        f"raise_val_rank{r}",
        "raise_val",
        f"failed on {PLACE[r]}",
        f"injected failure in validation_step on rank {r}",
        "`validation_step`",
        fault_rank=r,
        trainer={"val_check_interval": 1, "limit_val_batches": 2},
        checks=["validate"],
    )
# collectives inside a step
case(
    "all_gather_in_step",
    "all_gather_in_step",
    "`self.all_gather` (`trainer.strategy.all_gather`) was called inside a step",
)
case("reduce_in_step", "reduce_in_step", "`trainer.strategy.reduce` was called inside a step")
case("metric_compute_in_step", "metric_compute_in_step", "a torchmetrics Metric's sync (`compute()`")
case("metric_dist_sync_on_step", "metric_dist_sync_on_step", "the metric `synced_mae` has `dist_sync_on_step=True`")
# SIGTERM reaching one process that is not rank 0 (a preemption notice): every rank stops at the same batch
case("sigterm_rank1", "sigterm", "SIGTERMException", fault_rank=1, trainer={"max_steps": 6})
# the step
case("step_no_model", "step_no_model", "Layer `head` lives on pipeline rank 1")
case("step_model_twice", "step_model_twice", "calls `self(...)` 2 times")
case("step_string_input", "step_string_input", "passes a str to `self(...)` (argument 1)")
case("step_returns_none", "step_returns_none", "`training_step` returned None")
case("log_vector", "log_vector", "`self.log('per_output_error', ...)` was given a tensor with 3 elements")
case("log_reduce_fx_bad", "log_reduce_fx_bad", "reduce_fx 'mean', 'sum', 'max' or 'min'")
# batches
case(
    "batch_not_divisible",
    "none",
    "a batch of 6 samples cannot be split into num_microbatches=4",
    "(e.g. 4, 8)",
    batch=6,
)
case("batch_smaller_than_m", "none", "a batch of 2 samples is smaller than num_microbatches=4", batch=2)
# pipeline_layers()
case("no_layers_method", "no_layers_method", "has no `pipeline_layers()` method")
case("layers_empty", "layers_empty", "`pipeline_layers()` returned no layers")
case("layers_non_module", "layers_non_module", "item 2 is a builtin_function_or_method, not an nn.Module")
case("layers_twice", "layers_twice", "lists the module `blocks.0` twice")
case("layers_change", "layers_change", "`pipeline_layers()` returned different layers")
case("more_stages_than_layers", "none", "returns 10 layers, fewer than the 16 stages", strategy={"stages_per_rank": 8})
# the planner runs on global rank 0 only: its failure (here: no layout fits a 4 KiB memory budget) is shared,
# naming the arguments given and, per schedule, why
case(
    "planner_on_rank0",
    "none",
    "BFPPStrategy(pipeline_parallel_size='auto', stages_per_rank=1, num_microbatches=4): the planner found no layout",
    "runs within 4.0 KiB per device on 4 processes",
    "- breadth_first: ",
    "excluded: memory: ",
    strategy={"pipeline_parallel_size": "auto", "memory_budget": 4096},
    checks=["empty_init"],
)
# configuration
case(
    "pp_not_dividing_world",
    "none",
    "`pipeline_parallel_size=3` must divide the world size (4",
    strategy={"pipeline_parallel_size": 3},
)
case(
    "dp_inconsistent",
    "none",
    "pipeline_parallel_size × data_parallel_size = 2 × 4 = 8",
    strategy={"data_parallel_size": 4},
)
case(
    "stages_per_rank_str",
    "none",
    "`stages_per_rank` must be a positive int or 'auto', got '2'",
    strategy={"stages_per_rank": "2"},
)
case(
    "num_microbatches_float",
    "none",
    "`num_microbatches` must be a positive int or 'auto', got 2.5",
    strategy={"num_microbatches": 2.5},
)
case(
    "precision_plugin",
    "none",
    "does not support the precision plugin FSDPPrecision",
    trainer={"plugin_factories": ["tests.faulty_models:fsdp_precision"]},
)


@pytest.fixture(scope="module")
def agreed(tmp_path_factory):
    runs = [run for run, _ in AGREED.values()]
    return launch(runs, 4, tmp_path_factory.mktemp("agreed"), timeout=600)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(AGREED))
def test_every_rank_raises_the_same_error(agreed, name):
    _, expected = AGREED[name]
    errors = [rank["error"] for rank in agreed[name].ranks]
    assert len(errors) == 4
    assert None not in errors, f"the run trained without error on some ranks: {errors}"
    for rank, error in enumerate(errors):
        for text in expected:
            assert text in error, f"rank {rank}: {error}"
    # the same message everywhere (the raising rank may add nothing but its own place)
    assert len({re.sub(r"^\w+: ", "", e) for e in errors}) == 1, errors


def test_bad_input_has_at_least_fifteen_cases():
    bad_input = [n for n in AGREED if not n.startswith(("raise_", "all_gather", "reduce_in", "metric_compute"))]
    assert len(bad_input) >= 15, bad_input


# -- failures inside the schedule: the watchdog ---------------------------------------------------------

BOUND_S = 60.0  # every process gone within this long after the fault (failure_timeout=30 s by default)


def watched_run(fault: str, rank: int) -> RunSpec:
    run = faulty_run(f"{fault}_rank{rank}", fault, fault_rank=rank, fault_step=1)
    return dataclasses.replace(run, expect_error=False)  # the process must die, not record and go on


def _fault_time(stderr: str) -> float:
    found = re.findall(r"INJECTED \S+ on rank \d+ at ([0-9.]+)", stderr)
    assert found, stderr[-3000:]
    return float(found[0])


# each kind of fault on the first and on the last pipeline rank, of one data-parallel replica or the other
# (rank r is pipeline rank r % 2 of replica r // 2): every position and every replica is hit by one kind
FAULT_PLACES = [("layer_raise", 0), ("layer_raise", 3), ("layer_kill", 1), ("layer_kill", 2)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("fault", "rank"), FAULT_PLACES)
def test_a_fault_inside_the_schedule_stops_every_process(fault, rank, tmp_path):
    """A layer raising (or the process killed) on one rank mid-step: all 4 processes exit non-zero, in time."""
    proc = run_worker([watched_run(fault, rank)], 4, tmp_path, timeout=180)
    end = time.time()
    assert proc.returncode != 0
    elapsed = end - _fault_time(proc.stderr)
    assert elapsed < BOUND_S, f"{elapsed:.1f}s"
    if fault == "layer_raise":
        assert f"injected failure in a layer's forward on rank {rank}" in proc.stderr
        # the others say who failed (unless the launcher killed them first, which takes 5 s)
        assert f"BFPPStrategy: stopping this process because rank {rank} failed" in proc.stderr, proc.stderr[-3000:]


# a layer's output the next stage cannot receive: refused on the rank that computed it, the others stopped
STAGE_OUTPUT_FAULTS = {
    "layer_dict": ("pipeline layer `blocks.1`, the last of stage 0, returned a dict",),
    "layer_none": ("pipeline layer `blocks.1`, the last of stage 0, returned None",),
    # torch's finding, then why and what to do
    "layer_shape_varies": ("Stage 0 forward outputs", "another shape in one micro-batch than in the others"),
}


# the worker's line for a rank whose `fit` raised ("announce_exceptions"), and the watchdog's for a rank it stopped
RAISED = re.compile(r"RAISED on rank (\d+) at ([0-9.]+): (.*)$", re.M)
STOPPED = re.compile(r"\[rank (\d+)\] BFPPStrategy: stopping this process because (.*)$", re.M)
# how a rank whose failed peer exited dies when the watchdog has not stopped it first: gloo's connection is gone
CONNECTION_LOST = re.compile(r"Connection (closed|reset) by peer|Broken pipe")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", list(STAGE_OUTPUT_FAULTS))
def test_a_stage_output_that_cannot_be_sent_is_refused_and_stops_every_process(fault, tmp_path):
    """The failing rank raises the refusal, naming the cause; every process exits non-zero within the bound.

    The other ranks die of the watchdog's message, of the connection their failed peer closed, or of the
    launcher's kill, whichever reaches them first: that race is the machine's, so none of them is required.
    """
    run = faulty_run(fault, fault, fault_rank=0, fault_step=1, strategy={"partition": [3, 7]})
    run = dataclasses.replace(run, expect_error=False, checks=["announce_exceptions"])
    proc = run_worker([run], 4, tmp_path, timeout=180)
    end = time.time()  # every process has exited: the pipes they all write to are closed
    assert proc.returncode != 0
    # no rank finished the run (each writes its record at the end), so none exited with status 0
    assert not list((tmp_path / "out" / fault).glob("rank*.json"))
    raised = {int(rank): (float(at), message) for rank, at, message in RAISED.findall(proc.stderr)}
    assert 0 in raised, proc.stderr[-3000:]
    raised_at, cause = raised[0]
    assert all(expected in cause for expected in STAGE_OUTPUT_FAULTS[fault]), cause
    elapsed = end - raised_at
    assert elapsed < BOUND_S, f"{elapsed:.1f}s"
    for rank in set(raised) - {0}:
        assert CONNECTION_LOST.search(raised[rank][1]), f"rank {rank}: {raised[rank][1]}"
    for rank, reason in STOPPED.findall(proc.stderr):
        assert rank != "0" and reason.startswith("rank 0 failed"), (rank, reason)
