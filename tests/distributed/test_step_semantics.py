"""What a step does under the pipeline, against one device: the last smaller batch, non-finite losses.

- A loader's smaller last batch that ``num_microbatches`` does not divide runs with fewer micro-batches,
  exactly, with one warning per process (full batches that do not divide are refused: test_failures.py).
- ``self.log(..., sync_dist=True)`` inside a step gives one device's values (every logged value is reduced
  over the replicas with its ``reduce_fx`` anyway).
- A NaN loss reaches the logged value on every rank, and ``EarlyStopping(check_finite=True)`` stops every
  rank at the same step as on one device.
"""

from __future__ import annotations

import math

import pytest

from tests.distributed.harness import assert_params_match, assert_steps_match, load_results, run_worker
from tests.models import RunSpec, reference_run

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

P2_DP2 = {"pipeline_parallel_size": 2, "stages_per_rank": 2, "num_microbatches": 4}
RUNS = {
    # 60 samples over 2 replicas: batches of 8, 8, 8 and a last one of 6, which 4 micro-batches do not divide
    "last_batch": RunSpec(
        name="last_batch",
        strategy=P2_DP2,
        model={"optimizer": "sgd"},
        data={"num_samples": 60},
        trainer={"max_epochs": 2, "max_steps": -1},
        data_parallel_size=2,
    ),
    "sync_dist": RunSpec(
        name="sync_dist",
        strategy=P2_DP2,
        model={"optimizer": "sgd"},
        model_factory="tests.stochastic_models:sync_dist_net",
        trainer={"max_steps": 4},
        data_parallel_size=2,
    ),
    "non_finite": RunSpec(
        name="non_finite",
        strategy=P2_DP2,
        model={"optimizer": "sgd"},
        model_factory="tests.stochastic_models:non_finite_loss_net",
        data={"num_samples": 48},
        trainer={"max_epochs": 4, "max_steps": -1},
        data_parallel_size=2,
        checks=["stop_on_non_finite_loss"],
    ),
}
WARNING = "the last batch of the training loader has 6 samples, which num_microbatches=4 does not divide"


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("semantics")
    runs = list(RUNS.values())
    proc = run_worker(runs, 4, workdir, timeout=480)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_results(runs, 4, workdir), proc.stdout + proc.stderr


def test_a_smaller_last_batch_trains_exactly_with_one_warning(launched):
    results, output = launched
    ref = reference_run(RUNS["last_batch"])
    assert len(ref.steps) == 8  # 4 steps per epoch, the 4th on the smaller batch
    assert_steps_match(results["last_batch"], ref, tol=1e-5, keys=("train_loss", "max_err"))
    assert_params_match(results["last_batch"], ref, tol=1e-5)
    assert output.count(WARNING) == 4, output.count(WARNING)  # once per process, not once per epoch


def test_sync_dist_inside_a_step_logs_one_device_values(launched):
    results, _ = launched
    ref = reference_run(RUNS["sync_dist"])
    assert_steps_match(results["sync_dist"], ref, tol=1e-5, keys=("train_loss", "samples", "max_err"))
    assert {s["callback_metrics"]["samples"] for s in ref.steps} == {16.0}  # the global batch, summed


def test_a_non_finite_loss_is_logged_and_stops_every_rank_like_one_device(launched):
    results, _ = launched
    ref = reference_run(RUNS["non_finite"])
    ref_losses = [s["callback_metrics"]["train_loss"] for s in ref.steps]
    assert math.isnan(ref_losses[2]) and len(ref_losses) < 12  # stopped before the 4 epochs of 3 steps
    for rank in results["non_finite"].ranks:
        losses = [s["callback_metrics"]["train_loss"] for s in rank["steps"]]
        assert len(losses) == len(ref_losses)
        assert [math.isnan(v) for v in losses] == [math.isnan(v) for v in ref_losses]
        assert rank["holdings"]["counters"] == ref.extras["counters"]
