"""Lightning features under the pipeline, each against the same module trained on one process.

Clipping (by the whole model's norm, and by value), gradient accumulation, LR schedulers per step and per
epoch with several parameter groups, validation (sanity check, mid-epoch `val_check_interval`, torchmetrics),
test and predict, activation checkpointing (and that it recomputes), and bf16 precisions (and that the
pipeline computes in bf16). All runs use (p, dp, v, m) = (2, 2, 2, 4) on 4 CPU processes unless a run says
otherwise.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.distributed.harness import (
    assert_params_match,
    assert_steps_match,
    assert_tested_as_reference,
    launch,
    relative_error,
    run_2x2,
)
from tests.models import RunSpec, assert_same_predictions, reference_run

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

TOL = 1e-5
run = run_2x2


RUNS = {
    r.name: r
    for r in [
        run("clip_norm", trainer={"gradient_clip_val": 0.05}),
        run("clip_value", trainer={"gradient_clip_val": 0.002, "gradient_clip_algorithm": "value"}),
        # two batches of 16 accumulated = one batch of 32 on one device
        run(
            "accumulate",
            trainer={"accumulate_grad_batches": 2, "max_steps": 3},
            reference={"local_batch_size": 16, "trainer": {"max_steps": 3}},
        ),
        # windows of 3 batches over epochs of 4: the epoch's last batch ends a window early (one device too)
        run("accumulate_epoch_end", trainer={"accumulate_grad_batches": 3, "max_epochs": 2, "max_steps": -1}),
        run(
            "accumulate_replicated",
            strategy={"sharding": "no_shard"},
            trainer={"accumulate_grad_batches": 2, "max_steps": 3},
            reference={"local_batch_size": 16, "trainer": {"max_steps": 3}},
        ),
        run("groups_step_lr", model={"param_groups": 2, "scheduler": "step"}),
        run(
            "adamw_epoch_lr",
            model={"optimizer": "adamw", "param_groups": 2, "scheduler": "epoch"},
            trainer={"max_epochs": 2, "max_steps": -1},
        ),
        run(
            "validation_and_metrics",
            model={"metrics": True, "predict_output": "labelled"},
            trainer={"max_epochs": 2, "max_steps": -1, "val_check_interval": 2, "num_sanity_val_steps": 2},
            checks=("validate", "test", "predict", "warnings"),
        ),
        # every pipeline layer compiled (`aot_eager`: dynamo and AOT autograd without inductor's compile time)
        run("compiled_layers", strategy={"compile": {"backend": "aot_eager"}}),
        # layer_probe: each layer's forward calls and matmul dtypes per step (tests/distributed/worker.py)
        run("recompute_all", strategy={"activation_checkpointing": True}, checks=("layer_probe",)),
        run("no_recompute", checks=("layer_probe",)),
        run("bf16_mixed", trainer={"precision": "bf16-mixed"}, checks=("layer_probe",)),
        run("bf16_true", trainer={"precision": "bf16-true"}, checks=("layer_probe",)),
    ]
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("features")
    return workdir, launch(list(RUNS.values()), 4, workdir, timeout=840)


@pytest.mark.parametrize(
    "name",
    [
        "clip_norm",
        "clip_value",
        "groups_step_lr",
        "adamw_epoch_lr",
        "validation_and_metrics",
        "recompute_all",
        "compiled_layers",
    ],
)
def test_training_matches_single_device(name, results):
    _, res = results
    ref = reference_run(RUNS[name])
    if name == "compiled_layers":  # every rank's layers ran compiled (10 layers, 5 on each pipeline rank)
        assert [r["holdings"]["compiled_layers"] for r in res[name].ranks] == [5] * 4
    assert_steps_match(res[name], ref, tol=TOL)
    assert_params_match(res[name], ref, tol=TOL)
    for rank_result in res[name].ranks:
        for got, want in zip(rank_result["steps"], ref.steps, strict=True):
            assert got["lrs"] == pytest.approx(want["lrs"], rel=1e-12)


def test_clipping_uses_the_whole_models_norm(results):
    _, res = results
    ref = reference_run(RUNS["clip_norm"])
    norms = [s["grad_norm"] for s in ref.steps]
    assert min(norms) > 0.05  # clipping was active at every step, so a wrong norm would change the update
    for rank_result in res["clip_norm"].ranks:
        assert [s["grad_norm"] for s in rank_result["steps"]] == pytest.approx(norms, rel=TOL)


def test_accumulation_window_cut_by_the_epoch_end_matches_one_device(results):
    _, res = results
    ref = reference_run(RUNS["accumulate_epoch_end"])
    assert res["accumulate_epoch_end"].ranks[0]["holdings"]["counters"] == ref.extras["counters"]
    assert ref.extras["counters"]["global_step"] == 4  # per epoch: a window of 3 batches, then one of 1
    assert_params_match(res["accumulate_epoch_end"], ref, tol=TOL)


@pytest.mark.parametrize("name", ["accumulate", "accumulate_replicated"])
def test_accumulation_equals_a_larger_batch_and_reduces_once_per_optimizer_step(name, results):
    _, res = results
    ref = reference_run(RUNS[name])
    assert len(ref.steps) == 3 and len(res[name].steps(0)) == 6  # 6 batches, 3 optimizer steps
    assert res[name].ranks[0]["holdings"]["counters"]["global_step"] == 3
    assert_params_match(res[name], ref, tol=TOL)
    for rank_result in res[name].ranks:
        local = [rank_result["holdings"]["pipeline_rank"] + 2 * k for k in range(2)]
        for step in (1, 2, 3):  # events are keyed by optimizer step: both batches of a window count here
            events = [(kind, stage) for s, kind, stage, _ in rank_result["events"] if s == step]
            # two batches of 4 micro-batches ran, but each stage's gradients were reduced once; in the first
            # window once per batch, until the first loss shows whether the step normalises by item counts
            # (`mean_over_items` batches are reduced one by one, see lightning_bfpp.engine.loss.BatchGradients)
            reductions = 2 if step == 1 else 1
            assert Counter(stage for kind, stage in events if kind == "forward") == Counter(dict.fromkeys(local, 8))
            assert Counter(stage for kind, stage in events if kind == "reduce") == Counter(
                dict.fromkeys(local, reductions)
            )


def test_validation_metrics_match_and_run_mid_epoch(results):
    _, res = results
    ref = reference_run(RUNS["validation_and_metrics"])
    # 4 steps per epoch, `val_check_interval=2`: two validations per epoch
    assert len(ref.validations) == 4
    for rank_result in res["validation_and_metrics"].ranks:
        assert len(rank_result["validations"]) == 4
        for got, want in zip(rank_result["validations"], ref.validations, strict=True):
            assert got.keys() == want.keys() == {"val_loss", "val_mae"}
            for key in want:
                assert got[key] == pytest.approx(want[key], rel=TOL), key
        for got, want in zip(rank_result["steps"], ref.steps, strict=True):
            for key in ("train_mae_step", "train_mae_epoch"):
                if key in want["callback_metrics"]:
                    assert got["callback_metrics"][key] == pytest.approx(want["callback_metrics"][key], rel=TOL)


def test_no_sync_dist_advice_for_values_the_strategy_already_reduced(results):
    """`val_loss`/`test_loss` are logged on epoch level without `sync_dist`: the values Lightning sees are already
    the global batch's (same on every rank), so its advice to add `sync_dist=True` would mislead."""
    _, res = results
    warned = res["validation_and_metrics"].ranks[0]["warnings"]
    assert not [w for w in warned if "sync_dist=True" in w], warned


def test_test_step_metrics_match(results):
    _, res = results
    want = assert_tested_as_reference(
        res["validation_and_metrics"], reference_run(RUNS["validation_and_metrics"]), tol=TOL
    )
    assert want.keys() == {"test_loss", "test_mae"}


def test_predict_returns_the_dataset_in_order_on_rank_zero(results):
    """One device's batches: per-sample tensors and label strings put back in dataset order from both replicas,
    and the batch-level constant once per batch."""
    workdir, _ = results
    ref = reference_run(RUNS["validation_and_metrics"]).extras["predict"]
    got = torch.load(workdir / "out" / "validation_and_metrics" / "predictions_rank0.pt")
    assert len(ref) == 4 and set(ref[0]) == {"prediction", "argmax", "labels", "head"}
    assert_same_predictions(got, ref, TOL)


@pytest.mark.parametrize("name", ["bf16_mixed", "bf16_true"])
def test_bf16_precisions_match_single_device_within_bf16_tolerance(name, results):
    _, res = results
    ref = reference_run(RUNS[name])
    assert_steps_match(res[name], ref, tol=2e-2)
    fp32 = reference_run(RunSpec(**{**RUNS[name].to_json(), "trainer": {}}))
    # and the bf16 references are really bf16: their losses differ from fp32 training
    assert any(
        s["callback_metrics"]["train_loss"] != f["callback_metrics"]["train_loss"]
        for s, f in zip(ref.steps, fp32.steps, strict=True)
    )
    # the pipeline computed in bf16 itself: every matmul on every rank, at every step, returned bf16 (a pipeline
    # silently running fp32 would still pass the tolerance above)
    for rank, rank_result in enumerate(res[name].ranks):
        dtypes = rank_result["holdings"]["layer_probe"]["linear_dtypes"]
        assert set(dtypes) == {str(step) for step in range(1, 7)}, f"rank {rank} ran no matmul at some step"
        assert all(d == ["torch.bfloat16"] for d in dtypes.values()), f"rank {rank}: {dtypes}"


@pytest.mark.parametrize(("name", "forwards_per_microbatch"), [("recompute_all", 2), ("no_recompute", 1)])
def test_activation_checkpointing_runs_each_layer_again_in_backward(name, forwards_per_microbatch, results):
    """Recomputation happened: with checkpointing each layer's forward runs twice per micro-batch (forward and
    backward), without it once; counted on the layer objects each rank holds."""
    _, res = results
    for rank_result in res[name].ranks:
        holdings = rank_result["holdings"]
        m = holdings["layout"]["m"]
        calls = holdings["layer_probe"]["forward_calls"]
        assert holdings["local_layers"]
        for step in range(2, 7):  # step 1 also runs torch's shape inference
            assert calls[str(step)] == dict.fromkeys(holdings["local_layers"], forwards_per_microbatch * m), step


def test_activation_checkpointing_changes_no_result(results):
    _, res = results
    recomputed, stored = res["recompute_all"], res["no_recompute"]
    assert set(recomputed.params) == set(stored.params)
    worst = max(relative_error(recomputed.params[k], stored.params[k]) for k in stored.params)
    assert worst <= 1e-6, worst
    for a, b in zip(recomputed.steps(0), stored.steps(0), strict=True):
        assert a["callback_metrics"]["train_loss"] == pytest.approx(b["callback_metrics"]["train_loss"], rel=1e-6)


def test_every_later_trainer_reuses_the_first_ones_process_groups(results):
    """Each run is a new Trainer in the same 4 processes, all on one layout: after the first, none adds a process
    group or a gloo thread (each Trainer used to add its mesh's groups, 3 threads and a socket per peer each
    under gloo: a rank held 139 threads by the end of this launch)."""
    _, res = results
    for rank in range(4):
        held = {name: res[name].ranks[rank]["held_after"] for name in RUNS}
        first = held["clip_norm"]
        assert first["process_groups"] >= 3 and first["gloo_threads"] > 0, first  # the world's, data's, pipeline's
        assert held == dict.fromkeys(RUNS, first), (rank, held)
