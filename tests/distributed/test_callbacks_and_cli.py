"""Callbacks, loops and the CLI behave as with one device: EarlyStopping, top-k ModelCheckpoint,
LearningRateMonitor, progress bars, prediction writers, ``sync_dist`` logging from hooks, several ``fit``
calls, LightningCLI; and what cannot work is refused with a reason."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
import torch
import yaml

from tests.distributed.harness import (
    REPO,
    assert_params_match,
    assert_steps_match,
    assert_tested_as_reference,
    launch,
    relative_error,
    run_2x2,
)
from tests.models import RunSpec, assert_same_predictions, reference_run

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]


def run(name: str, trainer=None, checks=(), model=None, **kwargs) -> RunSpec:
    return run_2x2(name, trainer=trainer, checks=checks, model={"lr": 0.05, **(model or {})}, **kwargs)


def refused(name: str, checks=(), trainer=None, **kwargs) -> RunSpec:
    return run(name, trainer={"max_steps": 2, **(trainer or {})}, checks=checks, expect_error=True, **kwargs)


EPOCHS_2 = {"max_epochs": 2, "max_steps": -1}  # 4 batches of 16 per epoch
EPOCH_LOOPS = {
    "max_epochs": 4, "max_steps": -1, "check_val_every_n_epoch": 2, "limit_train_batches": 3, "limit_val_batches": 2,
    "limit_test_batches": 1, "limit_predict_batches": 1, "profiler": "simple",
}  # fmt: skip
# the rows of docs/lightning-features.md that a run shows: each against the same callbacks on one process
FEATURE_RUNS = [
    run("weights_only", checks=("weights_only",)),
    run("resume_weights_only", resume_from="weights_only/weights_only/last.ckpt", expect_error=True),
    run("accumulation_schedule", trainer=EPOCHS_2, checks=("accumulation_schedule",)),
    # the Timer stops after the first step; `benchmark` sets cuDNN's flag, which no layer here reads
    run("max_time", trainer={"max_time": {"microseconds": 1}, "benchmark": True}),
    run("epoch_loops", trainer=EPOCH_LOOPS, checks=("validate", "test", "predict")),
    run("overfit_batches", trainer={"overfit_batches": 2, "max_epochs": 3, "max_steps": -1}, checks=("validate",)),
    run(
        "modes",
        trainer={"detect_anomaly": True, "deterministic": True, "inference_mode": False, **EPOCHS_2},
        checks=("modes", "validate", "test"),
    ),
    run("fast_dev_run", trainer={"fast_dev_run": 2}, checks=("validate",)),
    # EarlyStopping asks to stop after the first epoch without progress; min_epochs holds training until epoch 3
    run("min_epochs", trainer={"min_epochs": 3, **EPOCHS_2, "max_epochs": 6}, checks=("validate", "early_stopping")),
    run("barebones", trainer={"barebones": True, "log_every_n_steps": 0}, model={"log": False}),
    run(
        "own_sampler_reloaded",
        trainer={"use_distributed_sampler": False, "reload_dataloaders_every_n_epochs": 1, **EPOCHS_2},
        loader_factory="tests.lightning_features:replica_sampled_data",
    ),
    run(
        "monitors",
        trainer={**EPOCHS_2, "enable_autolog_hparams": False},
        checks=("device_stats", "throughput", "rich", "lambda"),
    ),
    # the finders' 16 steps of range test, then 2 steps of training at the suggested rate
    run("lr_finder", trainer={"max_steps": 2}, checks=("lr_finder",)),
    run("tuner_lr_find", trainer={"max_steps": 2}, checks=("tuner_lr_find",)),
    # every rank raises after step 3 (RaiseAtStep): OnExceptionCheckpoint saves where one device does
    run("on_exception", checks=("on_exception_checkpoint",), expect_error=True),
    run("spike", checks=("spike",), expect_error=True),
    # the user's sampler shards over all 4 processes: the pipeline's ranks would load different batches
    refused(
        "world_sampler",
        trainer={"use_distributed_sampler": False},
        loader_factory="tests.lightning_features:world_sampled_data",
    ),
    refused("swa", checks=("swa",)),
    refused("pruning", checks=("pruning",)),
    refused("backbone_finetuning", checks=("backbone_finetuning",)),
    refused("batch_size_finder", checks=("batch_size_finder",)),
    refused("tuner_scale_batch_size", checks=("tuner_scale_batch_size",)),
    refused("sync_batchnorm", trainer={"sync_batchnorm": True}),
    refused("checkpoint_io", trainer={"plugin_factories": ["lightning.pytorch.plugins.io:AsyncCheckpointIO"]}),
]


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
        *FEATURE_RUNS,
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
def test_lightning_cli(strategy_args, tmp_path, script_env):
    cmd = [
        sys.executable, "examples/cli.py", "fit", "--trainer.accelerator=cpu", "--trainer.devices=2",
        *strategy_args, "--trainer.max_steps=3", "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path}", "--model.layers=4", "--model.dim=32", "--data.batch_size=8",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=script_env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert "BFPPStrategy: pipeline_parallel_size=2" in output and "`max_steps=3` reached" in output
    if "shard_grad_op" in " ".join(strategy_args):
        assert "sharding=shard_grad_op" in output


# -- the rows of docs/lightning-features.md --------------------------------------------------------------------


def _counters(result) -> list[dict]:
    return [rank["holdings"]["counters"] for rank in result.ranks]


# what each run's one-device reference shows the feature did (so that agreeing is not agreeing on nothing)
FEATURE_EFFECTS = {
    "accumulation_schedule": lambda ref: ref.extras["counters"]["global_step"] == 4 + 2,  # 2 batches a step
    "max_time": lambda ref: ref.extras["counters"]["global_step"] == 1,
    "epoch_loops": lambda ref: ref.extras["counters"]["global_step"] == 4 * 3 and len(ref.validations) == 2,
    "overfit_batches": lambda ref: ref.extras["counters"]["global_step"] == 3 * 2 and len(ref.validations) == 3,
    "modes": lambda ref: len(ref.validations) == 2,
    "fast_dev_run": lambda ref: ref.extras["counters"]["global_step"] == 2 and len(ref.validations) == 1,
    "min_epochs": lambda ref: ref.extras["counters"]["current_epoch"] >= 3,
    "own_sampler_reloaded": lambda ref: ref.extras["counters"]["global_step"] == 8,
    "lr_finder": lambda ref: ref.extras["lr"] != 0.05 and len(ref.extras["lr_found"]["losses"]) == 16,
    "tuner_lr_find": lambda ref: ref.extras["lr"] != 0.05 and len(ref.extras["lr_found"]["losses"]) == 16,
    "monitors": lambda ref: ref.extras["counters"]["global_step"] == 8,
}


@pytest.mark.parametrize("name", sorted(FEATURE_EFFECTS))
def test_callback_or_option_trains_as_on_one_device(name, results):
    _, res = results
    got, ref = res[name], reference_run(RUNS[name])
    assert FEATURE_EFFECTS[name](ref)
    assert _counters(got) == [ref.extras["counters"]] * 4
    assert_steps_match(got, ref, tol=1e-5)
    assert_params_match(got, ref, tol=1e-5)
    for rank in got.ranks:
        assert len(rank["validations"]) == len(ref.validations)
        for have, want in zip(rank["validations"], ref.validations, strict=True):
            assert have == pytest.approx(want, rel=1e-5)
    if "test" in RUNS[name].checks:
        assert_tested_as_reference(got, ref, tol=1e-5)


def test_learning_rate_finders_see_one_devices_losses_and_suggest_its_rate(results):
    """`LearningRateFinder` and `Tuner.lr_find` run their range test (and restore the weights from their temporary
    checkpoint) under the pipeline: the same smoothed losses, the same suggestion, then the same training."""
    _, res = results
    for name in ("lr_finder", "tuner_lr_find"):
        ref = reference_run(RUNS[name]).extras
        for rank in res[name].ranks:
            assert rank["lr_found"]["losses"] == pytest.approx(ref["lr_found"]["losses"], rel=1e-5)
            assert rank["lr_found"]["suggestion"] == pytest.approx(ref["lr_found"]["suggestion"], rel=1e-9)
            assert rank["lr"] == pytest.approx(ref["lr"], rel=1e-9)


def test_anomaly_detection_determinism_and_no_inference_mode_reach_the_layers(results):
    """`detect_anomaly`, `deterministic` and `inference_mode=False` hold where the pipeline runs each layer, in
    training and validation, as on one device. (torch's first-step shape inference runs on placeholder tensors
    with anomaly detection off: the only other modes seen.)"""
    _, res = results
    want = {tuple(mode) for mode in reference_run(RUNS["modes"]).extras["modes"]}
    assert want == {("train", True, False, True, True), ("validate", False, False, True, True)}
    for rank in res["modes"].ranks:
        seen = {tuple(mode) for mode in rank["modes"]}
        assert want <= seen
        assert all(mode[3] is False for mode in seen - want), seen - want


def test_barebones_trains_as_on_one_device(results):
    _, res = results
    ref = reference_run(RUNS["barebones"])
    assert len(ref.steps) == 6 and not ref.steps[0]["callback_metrics"]  # nothing logged
    assert _counters(res["barebones"]) == [ref.extras["counters"]] * 4
    assert_params_match(res["barebones"], ref, tol=1e-5)


def test_users_own_sampler_is_requested_again_each_epoch(results):
    _, res = results
    assert [rank["loader_requests"] for rank in res["own_sampler_reloaded"].ranks] == [2] * 4


def test_device_stats_throughput_monitors_and_lambda_callback(results, tmp_path):
    """DeviceStatsMonitor logs each process's own device, as under DDP; ThroughputMonitor's world-wide rates count
    each data-parallel replica's batch once (a device's rate times 2 replicas, not times 4 processes); a
    LambdaCallback's hook logs what one device's does."""
    workdir, _ = results
    monitors = workdir / "out" / "monitors"
    got = list(csv.DictReader((monitors / "logs" / "version_0" / "metrics.csv").open()))
    out = tmp_path / "reference"
    reference_run(RUNS["monitors"], out=out)
    want = list(csv.DictReader((out / "logs" / "version_0" / "metrics.csv").open()))
    stats = {k for k in want[0] if k.startswith("DeviceStatsMonitor")}
    assert "DeviceStatsMonitor.on_train_batch_end/cpu_percent" in stats and stats <= set(got[0])
    rates = [row for row in got if row.get("train/samples_per_sec")]
    assert rates
    for row in rates:
        assert float(row["train/samples_per_sec"]) == pytest.approx(2 * float(row["train/device/samples_per_sec"]))
    assert [float(r["train/samples"]) for r in got if r.get("train/samples")] == [8.0 * k for k in range(1, 9)]
    assert _csv_column_of(got, "steps_done") == _csv_column_of(want, "steps_done") == [4.0, 8.0]
    # enable_autolog_hparams=False: the module's hyper-parameters reach the logger on neither
    files = [d / "logs" / "version_0" / "hparams.yaml" for d in (monitors, out)]
    hparams = [yaml.safe_load(f.read_text()) if f.is_file() else None for f in files]
    assert hparams[0] == hparams[1] and not hparams[0], hparams


def _csv_column_of(rows, column):
    return [float(r[column]) for r in rows if r.get(column)]


def test_limit_predict_batches_counts_each_replicas_batches_as_under_ddp(results):
    """`limit_predict_batches=1` predicts one batch per data-parallel replica (as DDP does): with 2 replicas, what
    one device predicts with `limit_predict_batches=2` at the same per-replica batch size."""
    workdir, _ = results
    spec = RUNS["epoch_loops"].to_json()
    want = reference_run(RunSpec(**{**spec, "trainer": {**spec["trainer"], "limit_predict_batches": 2}}))
    got = torch.load(workdir / "out" / "epoch_loops" / "predictions_rank0.pt")
    assert len(want.extras["predict"]) == 2  # two batches of the four
    assert_same_predictions(got, want.extras["predict"], 1e-5)


def test_weights_only_checkpoint_holds_the_weights_and_refuses_a_resume(results):
    workdir, res = results
    from lightning_bfpp.adapter._lightning_compat import consolidated_checkpoint

    saved = consolidated_checkpoint(workdir / "out" / "weights_only" / "weights_only" / "last.ckpt")
    assert "optimizer_states" not in saved and saved["global_step"] == 6
    state = {k: v for k, v in saved["state_dict"].items() if "mae" not in k}
    final = res["weights_only"].params
    assert state.keys() == final.keys()
    assert all(torch.equal(state[k], final[k]) for k in final)
    errors = [rank["error"] for rank in res["resume_weights_only"].ranks]
    assert all("holds none (saved with `save_weights_only=True`?)" in e for e in errors), errors


def test_on_exception_checkpoint_saves_where_one_device_does(results, tmp_path):
    """Every rank raises after step 3 (as a callback's error or a Ctrl-C reaches every process):
    OnExceptionCheckpoint writes the same weights as on one device. (An error on one rank alone stops the others
    through the failure watchdog; no checkpoint is written then.)"""
    workdir, res = results
    from lightning_bfpp.adapter._lightning_compat import consolidated_checkpoint

    assert all("stopped on purpose after step 3" in rank["error"] for rank in res["on_exception"].ranks)
    out = tmp_path / "reference"
    with pytest.raises(RuntimeError, match="stopped on purpose"):
        reference_run(RUNS["on_exception"], out=out)
    want = torch.load(out / "on_exception" / "interrupted.ckpt", weights_only=False)
    got = consolidated_checkpoint(workdir / "out" / "on_exception" / "on_exception" / "interrupted.ckpt")
    assert got["global_step"] == want["global_step"] == 3
    for key, value in want["state_dict"].items():
        assert relative_error(got["state_dict"][key], value) <= 1e-5, key


def test_spike_detection_stops_every_rank_at_one_devices_batch(results, tmp_path):
    workdir, res = results
    out = tmp_path / "reference"
    with pytest.raises(Exception, match="Training spike detected in batch") as raised:
        reference_run(RUNS["spike"], out=out)
    assert [rank["error"] for rank in res["spike"].ranks] == [f"TrainingSpikeException: {raised.value}"] * 4
    skipped = json.loads((workdir / "out" / "spike" / "skip.json").read_text())
    assert skipped == json.loads((out / "skip.json").read_text())


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("swa", "cannot run StochasticWeightAveraging: it switches Lightning's own backward back on"),
        ("pruning", "cannot run ModelPruning"),
        ("backbone_finetuning", "cannot run BackboneFinetuning (a BaseFinetuning callback)"),
        ("batch_size_finder", "cannot run BatchSizeFinder"),
        ("tuner_scale_batch_size", "Tuning the batch size is currently not supported with distributed strategies"),
        ("sync_batchnorm", "does not support `Trainer(sync_batchnorm=True)`"),
        ("checkpoint_io", "does not use CheckpointIO plugins, got AsyncCheckpointIO"),
        ("world_sampler", "the ranks of one pipeline loaded different batches"),
    ],
)
def test_refused_on_every_rank_with_what_to_do_instead(name, message, results):
    """At set-up (before any callback's own `setup`), on every rank; the data check at the first step."""
    _, res = results
    errors = [rank["error"] for rank in res[name].ranks]
    assert all(message in e for e in errors), errors
    instead = {
        "swa": "`EMAWeightAveraging`",
        "pruning": "Prune after training",
        "backbone_finetuning": "`lightning_bfpp.load_pretrained`",
        "batch_size_finder": "memory_budget",
        "sync_batchnorm": "LayerNorm or GroupNorm",
        "world_sampler": "distributed_sampler_kwargs",
    }
    assert name not in instead or all(instead[name] in e for e in errors)
