"""Callbacks, loops and the CLI behave as with one device: EarlyStopping, top-k ModelCheckpoint,
LearningRateMonitor, progress bars, prediction writers, ``sync_dist`` logging from hooks, several ``fit``
calls, LightningCLI; and what cannot work is refused with a reason."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest
import torch

from tests.distributed.harness import REPO, assert_params_match, assert_steps_match, launch, run_2x2, run_worker
from tests.models import RunSpec, reference_run

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]


def run(name: str, trainer=None, checks=(), model=None) -> RunSpec:
    return run_2x2(name, trainer=trainer, checks=checks, model={"lr": 0.05, **(model or {})})


RUNS = {
    r.name: r
    for r in [
        run(
            "monitoring",
            trainer={"max_epochs": 8, "max_steps": -1},
            checks=("validate", "early_stopping", "top_k", "lr_monitor", "synced_logs", "progress_bar"),
            model={"scheduler": "step"},
        ),
        run("fit_twice", trainer={"max_epochs": 1, "max_steps": -1}, checks=("fit_twice",)),
        run("writer", trainer={"max_steps": 2}, checks=("predict", "prediction_writer")),
    ]
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("callbacks")
    return workdir, launch(list(RUNS.values()), 4, workdir, timeout=840)


@pytest.fixture(scope="module")
def monitoring_reference(tmp_path_factory):
    return reference_run(RUNS["monitoring"], out=tmp_path_factory.mktemp("reference"))


def test_early_stopping_stops_at_the_same_epoch(results, monitoring_reference):
    _, res = results
    ref = monitoring_reference
    assert ref.extras["counters"]["current_epoch"] < 7  # it did stop early
    for rank_result in res["monitoring"].ranks:
        assert rank_result["holdings"]["counters"] == ref.extras["counters"]
    assert_steps_match(res["monitoring"], ref, tol=1e-5)
    assert_params_match(res["monitoring"], ref, tol=1e-5)


def test_top_k_checkpoints_are_the_same_choice(results, monitoring_reference):
    workdir, _ = results
    got = sorted(p.name for p in (workdir / "out" / "monitoring" / "topk").iterdir())
    want = sorted(p.name for p in (monitoring_reference.extras["out"] / "topk").iterdir())
    assert len(want) == 2 and got == want  # names carry epoch and val_loss to 5 decimals


def _csv_column(path, column):
    rows = list(csv.DictReader(path.open()))
    return [float(r[column]) for r in rows if r.get(column)]


def test_learning_rate_monitor_and_synced_hook_logs(results, monitoring_reference):
    workdir, _ = results
    got = workdir / "out" / "monitoring" / "logs" / "version_0" / "metrics.csv"
    want = monitoring_reference.extras["out"] / "logs" / "version_0" / "metrics.csv"
    assert _csv_column(got, "lr-SGD") == pytest.approx(_csv_column(want, "lr-SGD"))
    assert len(_csv_column(got, "lr-SGD")) > 4
    assert _csv_column(got, "epoch_lr") == pytest.approx(_csv_column(want, "epoch_lr"))
    # a sum with sync_dist=True from an epoch hook reduces over the data-parallel replicas, as DDP over its
    # ranks: 2 replicas (p=2 x dp=2), not the 4 processes, which would count each replica once per stage rank
    assert set(_csv_column(got, "ranks_reporting")) == {2.0}


def test_second_fit_continues_like_one_device(results):
    _, res = results
    ref = reference_run(RUNS["fit_twice"])
    assert len(ref.steps) == 8 and ref.extras["counters"]["current_epoch"] == 2
    assert_steps_match(res["fit_twice"], ref, tol=1e-5)
    assert_params_match(res["fit_twice"], ref, tol=1e-5)


def test_prediction_writer_sees_each_replicas_batches_with_indices(results):
    workdir, _ = results
    ref = reference_run(RUNS["writer"]).extras["predict"]
    ref_by_index = {}
    for batch_number, batch in enumerate(ref):
        for i, row in enumerate(batch["prediction"]):
            ref_by_index[batch_number * 8 + i] = row
    written = list((workdir / "out" / "writer" / "written").glob("*.pt"))
    seen = set()
    for path in written:
        indices, prediction = torch.load(path)
        for index, row in zip(indices, prediction["prediction"], strict=True):
            torch.testing.assert_close(row, ref_by_index[index], rtol=1e-5, atol=1e-6)
            seen.add(index)
    assert seen == set(ref_by_index)
    assert len(written) == 4 * 2  # every rank writes its replica's 2 batches


def test_stochastic_weight_averaging_is_refused_pointing_to_weight_averaging(tmp_path):
    """Refused at setup on every rank, naming the callback and what averages under the pipeline instead, rather
    than failing inside a step (WeightAveraging and EMAWeightAveraging work: test_weight_averaging.py)."""
    proc = run_worker([run("swa", trainer={"max_steps": 2}, checks=("swa",))], 2, tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "cannot run StochasticWeightAveraging" in proc.stderr
    assert "`WeightAveraging`" in proc.stderr and "`EMAWeightAveraging`" in proc.stderr


@pytest.mark.parametrize(
    "strategy_args",
    [
        ["--trainer.strategy=bfpp"],
        [
            "--trainer.strategy=lightning_bfpp.BFPPStrategy",
            "--trainer.strategy.pipeline_parallel_size=2",
            "--trainer.strategy.num_microbatches=4",
            "--trainer.strategy.sharding=shard_grad_op",
        ],
    ],
    ids=["registered-name", "class-path"],
)
def test_lightning_cli(strategy_args, tmp_path):
    cmd = [
        sys.executable, "examples/cli.py", "fit", "--trainer.accelerator=cpu", "--trainer.devices=2",
        *strategy_args, "--trainer.max_steps=3", "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path}", "--model.layers=4", "--model.dim=32", "--data.batch_size=8",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert "BFPPStrategy: pipeline_parallel_size=2" in output and "`max_steps=3` reached" in output
    if "shard_grad_op" in " ".join(strategy_args):
        assert "sharding=shard_grad_op" in output
