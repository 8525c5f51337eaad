"""Lightning's WeightAveraging and EMAWeightAveraging under the pipeline, against the same callbacks on one process.

Each rank averages its own stages' shards (adapter.weight_averaging). What one device does with the average must
hold here too: validation and test run with the averaged weights, training ends with them in the module, the
checkpoint's ``state_dict`` holds them beside the trained ones (``current_model_state``) and the averaging state,
and a resume continues the average exactly. One launch of 4 processes covers breadth-first with FSDP2's full
sharding and a weight tied across stages, zbv without sharding, depth-first with ZeRO-2 (saved at step 3 and
resumed), weight passing and tensor parallelism; EMA with several decays and update rules, and the equal average.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from lightning_bfpp.consolidate import consolidate
from lightning_bfpp.integrations.huggingface import export_pretrained
from tests.distributed.harness import (
    assert_params_match,
    assert_steps_match,
    assert_tested_as_reference,
    launch,
    relative_error,
    run_2x2,
)
from tests.hf_models import hf_module
from tests.models import RunSpec, make_model, reference_run

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

TOL = 1e-5
CHECKPOINT = "ckpts/last.ckpt"
VALIDATED = {"max_steps": 6, "val_check_interval": 2, "num_sanity_val_steps": 1}
HALF = {"schedule": "depth_first", "sharding": "shard_grad_op"}


def resume_run(name: str, steps: int, **kwargs) -> RunSpec:
    """64 samples, a global batch of 16: the step-3 checkpoint is mid-epoch, steps 4-6 cross into the next."""
    return run_2x2(name, strategy=HALF, data={"num_samples": 64}, trainer={"max_steps": steps}, **kwargs)


RUNS = {
    r.name: r
    for r in [
        # the first and last blocks share a weight, held on both pipeline ranks: the average keeps both copies equal
        run_2x2(
            "ema_tied",
            model={"tie_blocks": True},
            trainer=VALIDATED,
            checks=("ema", "validate", "test", "save_at_end"),
        ),
        # a module built on the meta device, each rank reading its own stages' weights: the callback's own copy of
        # the whole module (moved to the device at its `setup`) would fail here
        run_2x2(
            "ema_meta",
            trainer=VALIDATED,
            checks=("ema", "validate", "empty_init", "pretrained:initial.safetensors"),
        ),
        run_2x2(
            "average_zbv",
            strategy={"schedule": "zbv", "sharding": "no_shard"},
            trainer=VALIDATED,
            checks=("average", "validate"),
        ),
        resume_run("ema_half", 3, checks=("ema:0.8:2", "last_checkpoint_every_step")),
        resume_run("ema_resumed", 6, checks=("ema:0.8:2",), resume_from=f"ema_half/{CHECKPOINT}"),
        # one device's step-3 checkpoint file, as saved with the callback and as if saved without it
        resume_run("ema_from_file", 6, checks=("ema:0.8:2",), resume_from="one_device.ckpt"),
        resume_run("ema_from_plain_file", 6, checks=("ema:0.8:2",), resume_from="no_average.ckpt"),
        # a Hugging Face model, exported from its step-3 checkpoint (averaged and trained weights differ there)
        run_2x2(
            "ema_hf",
            model={"family": "qwen2", "layers": 3},
            model_factory="tests.hf_models:hf_module",
            loader_factory="tests.hf_models:hf_loader",
            trainer={"max_steps": 3},
            checks=("ema:0.5", "last_checkpoint_every_step"),
        ),
        RunSpec(
            name="ema_weight_passing",
            strategy={"schedule": "weight_passing", "processes_per_node": 2, "num_microbatches": 2},
            model={"optimizer": "adamw"},
            trainer=VALIDATED,
            local_batch_size=4,
            data_parallel_size=4,
            checks=["ema:0.7:1:2", "validate"],
        ),
        RunSpec(
            name="ema_tensor_parallel",
            strategy={
                "pipeline_parallel_size": 2,
                "tensor_parallel_size": 2,
                "stages_per_rank": 2,
                "num_microbatches": 4,
            },
            model={"optimizer": "sgd", "tp": "layer"},
            model_factory="tests.tp_models:make",
            trainer=VALIDATED,
            checks=["ema", "validate"],
        ),
    ]
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("averaging")
    (workdir / "out").mkdir()
    saved = torch.load(reference_run(RUNS["ema_half"]).extras["out"] / CHECKPOINT, weights_only=True)
    torch.save(saved, workdir / "out" / "one_device.ckpt")
    torch.save(without_average(saved), workdir / "out" / "no_average.ckpt")
    initial = {k: v.contiguous() for k, v in make_model(RUNS["ema_meta"]).state_dict().items()}
    save_file(initial, workdir / "out" / "initial.safetensors")
    return workdir, launch(list(RUNS.values()), 4, workdir, timeout=840)


def without_average(checkpoint: dict) -> dict:
    """A checkpoint of the same training saved without a weight-averaging callback: the trained weights only."""
    checkpoint = dict(checkpoint)
    checkpoint["state_dict"] = checkpoint.pop("current_model_state")
    del checkpoint["averaging_state"]
    return checkpoint


def without_averaging(run: RunSpec) -> RunSpec:
    checks = [c for c in run.checks if not (c.startswith("ema") or c == "average")]
    return RunSpec(**{**run.to_json(), "checks": checks, "resume_from": None})


@pytest.mark.parametrize("name", ["ema_tied", "ema_meta", "average_zbv", "ema_weight_passing", "ema_tensor_parallel"])
def test_training_validation_and_averaged_weights_match_one_device(name, results):
    _, res = results
    ref = reference_run(RUNS[name])
    assert_steps_match(res[name], ref, tol=TOL)
    # training ended with the averaged weights in the module, on one device as here
    assert_params_match(res[name], ref, tol=TOL)
    plain = reference_run(without_averaging(RUNS[name]))
    assert max(relative_error(ref.params[k], plain.params[k]) for k in ref.params) > 100 * TOL
    # every validation ran with the averaged weights (3 in training, after steps 2, 4 and 6)
    assert len(ref.validations) == 3 and ref.validations != plain.validations
    for rank_result in res[name].ranks:
        assert len(rank_result["validations"]) == 3
        for got, want in zip(rank_result["validations"], ref.validations, strict=True):
            assert got["val_loss"] == pytest.approx(want["val_loss"], rel=TOL)


def test_test_after_fit_uses_the_averaged_weights(results):
    _, res = results
    assert "test_loss" in assert_tested_as_reference(res["ema_tied"], reference_run(RUNS["ema_tied"]), tol=TOL)


def _assert_state_close(got: dict, want: dict, where: str) -> None:
    assert set(got) == set(want), f"{where}: {sorted(set(got) ^ set(want))}"
    for key in want:
        assert relative_error(got[key].float(), want[key].float()) <= TOL, f"{where}[{key}]"


@pytest.mark.parametrize("name", ["ema_tied", "ema_half"])
def test_checkpoint_holds_the_average_the_trained_weights_and_the_averaging_state(name, results, tmp_path):
    """Consolidated, the checkpoint is one device's: `state_dict` the averaged weights, `current_model_state` the
    trained ones (each tied weight under all its names), `averaging_state` the number of updates. `ema_tied` is
    saved after `fit` (training ended by copying the average into the module), `ema_half` by ModelCheckpoint at
    step 3 (trained and averaged weights differ there)."""
    workdir, _ = results
    mine = tmp_path / "mine.ckpt"
    if name == "ema_tied":
        consolidate(workdir / "out" / name / "end.ckpt", mine)
        theirs = tmp_path / "theirs.ckpt"
        reference_run(RUNS[name], save_to=str(theirs))
    else:
        consolidate(workdir / "out" / name / CHECKPOINT, mine)
        theirs = reference_run(RUNS[name]).extras["out"] / CHECKPOINT
    got, want = torch.load(mine, weights_only=True), torch.load(theirs, weights_only=True)
    _assert_state_close(got["state_dict"], want["state_dict"], "state_dict")
    _assert_state_close(got["current_model_state"], want["current_model_state"], "current_model_state")
    assert got["averaging_state"].keys() == want["averaging_state"].keys() == {"n_averaged"}
    assert int(got["averaging_state"]["n_averaged"]) == int(want["averaging_state"]["n_averaged"]) > 0
    if name == "ema_half":  # the two differ, so mixing them up would fail
        averaged, trained = want["state_dict"], want["current_model_state"]
        assert max(relative_error(averaged[k], trained[k]) for k in averaged) > 100 * TOL


@pytest.mark.parametrize(
    ("name", "saved"),
    [("ema_resumed", "own"), ("ema_from_file", "one_device.ckpt"), ("ema_from_plain_file", "no_average.ckpt")],
)
def test_resume_continues_the_average_as_one_device_does(name, saved, results):
    """3 steps, saved, resumed for 3 more, as one device resumes the same checkpoint (EMA decay 0.8 updated at
    steps 1, 3 and 5): the losses after the resume and the final averaged weights. From the pipeline's own folder
    and from one device's file, the average and its count continue; from a file saved without averaging, both
    the module and the average start from its weights."""
    workdir, res = results
    path = reference_run(RUNS["ema_half"]).extras["out"] / CHECKPOINT if saved == "own" else workdir / "out" / saved
    want = reference_run(without_resume(RUNS[name]), resume_from=str(path))
    assert_steps_match(res[name], want, tol=TOL)
    assert_params_match(res[name], want, tol=TOL)
    if saved == "no_average.ckpt":  # the resumed average differs from the fresh one a lost average would give
        continued = reference_run(without_resume(RUNS[name]), resume_from=str(workdir / "out" / "one_device.ckpt"))
        assert max(relative_error(want.params[k], continued.params[k]) for k in want.params) > 100 * TOL


def without_resume(run: RunSpec) -> RunSpec:
    return RunSpec(**{**run.to_json(), "resume_from": None})


def test_export_gives_the_averaged_model(results, tmp_path):
    """`export_pretrained` of a checkpoint saved with averaging writes the averaged weights (the checkpoint's
    `state_dict`, as Lightning's consolidation gives it), not the trained ones."""
    workdir, _ = results
    folder = workdir / "out" / "ema_hf" / CHECKPOINT
    consolidate(folder, tmp_path / "whole.ckpt")
    whole = torch.load(tmp_path / "whole.ckpt", weights_only=True)
    loaded = AutoModelForCausalLM.from_pretrained(export_pretrained(folder, tmp_path / "exported")).state_dict()
    names = hf_module(RUNS["ema_hf"]).hf_names
    assert set(loaded) == set(names)
    differs = 0
    for hf_name, ours in names.items():
        assert torch.equal(loaded[hf_name], whole["state_dict"][ours]), hf_name
        differs += not torch.equal(loaded[hf_name], whole["current_model_state"][ours])
    assert differs == len(names)
