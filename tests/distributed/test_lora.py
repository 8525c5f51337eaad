"""LoRA and frozen weights under the pipeline equal one device, under every schedule and sharding.

A tiny Llama (3 blocks, grouped-query attention) with ``peft`` LoRA adapters on the attention's q and v and the
MLP's down projection (rank 4) trains on padded batches on 4 CPU processes:

- breadth-first with ``full_shard``, ``shard_grad_op`` and ``no_shard``, depth-first, GPipe and 1F1B (one stage
  per rank), weight passing, and ``hybrid_shard`` (2 "nodes" of 2 processes); each against ``strategy="auto"``
  on one process on the same global batches: losses and every weight (adapters and frozen base) within 1e-5
  relative in fp32;
- only the adapters have optimizer state; the frozen base stays sharded as full fine-tuning's weights are
  (each rank holds the same share of them), and it is never reduced: the bytes FSDP2 reduce-scatters per step
  are the adapters' gradients alone, against the whole model's for full fine-tuning of the same model in the
  same launch. The parameter and optimizer memory per rank of both is printed;
- a run stopped after 4 steps and resumed from its checkpoint continues as one device resumed from its own, and
  so does a run resumed from one device's checkpoint (its optimizer covers the trained parameters only);
- the trained adapters export to ``peft``'s adapter folder (``PeftModel.from_pretrained`` on the base model
  gives the one-device model's logits) and, merged, to a ``from_pretrained`` folder;
- a pipeline rank whose stages hold only frozen weights (adapters on other stages) trains with no optimizer
  (the module's ``configure_optimizers`` over its trained parameters gets an empty list there);
- modules that freeze part of themselves by hand (the embedding layer, and one weight inside a block, with
  ``requires_grad_(False)``) train equal to one device under ``full_shard``, ``no_shard`` and weight passing.

All runs share one launch.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import lightning as L
import torch
from peft import PeftModel
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM

from lightning_bfpp.engine.layers import pipeline_layers
from lightning_bfpp.integrations.huggingface import export_pretrained
from tests.distributed.harness import assert_steps_match, launch, run_2x2
from tests.hf_models import hf_module, hf_reference_run, tiny_config, token_data
from tests.models import trainer_defaults

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

TOL = 1e-5
ATOL = 1e-6  # see test_huggingface: rounding noise on gradients that are zero in exact arithmetic
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"], "lora_dropout": 0.0}
# LoRA's B starts at zero and its A moves only once B has: a larger step than full fine-tuning's, so that both
# move by much more than the tolerance within the 6 steps
LORA_LR = 5.0
ONE_STAGE_PER_RANK = {"stages_per_rank": 1, "num_microbatches": 4}
WEIGHT_PASSING = {"schedule": "weight_passing", "num_microbatches": 2}
# one stage pair per rank (p=1), sharded inside each "node" of 2 processes and replicated across the two
HYBRID = {
    "pipeline_parallel_size": 1,
    "stages_per_rank": 2,
    "num_microbatches": 2,
    "sharding": "hybrid_shard",
    "processes_per_node": 2,
}


def run(name: str, *, strategy=None, model=None, checks=(), **kwargs):
    """(p, dp, v, m) = (2, 2, 2, 4) unless ``strategy`` says otherwise; weight passing: 4 replicas of 4 samples."""
    spec = run_2x2(
        name,
        strategy=strategy,
        model={"family": "llama", "layers": 3, "seed": 3, "lr": 0.2, **(model or {})},
        model_factory="tests.hf_models:hf_module",
        loader_factory="tests.hf_models:hf_loader",
        checks=checks,
        **kwargs,
    )
    if strategy in (WEIGHT_PASSING, HYBRID):  # 4 replicas of 4 samples: the same global batch
        return dataclasses.replace(spec, strategy=strategy, local_batch_size=4, data_parallel_size=4)
    return spec


def lora_run(name: str, *, model=None, **kwargs):
    return run(name, model={"lora": LORA, "lr": LORA_LR, **(model or {})}, **kwargs)


# the same layout for LoRA and full fine-tuning, whose memory is compared rank by rank (the modules' default
# partition is by measured time, which differs between them and between runs)
UNIFORM = {"partition": "uniform"}
LORA_RUNS = [
    lora_run(
        "lora_bf_full_shard",
        strategy=UNIFORM,
        trainer={"enable_model_summary": True},
        checks=["traffic", "save_at_end"],
    ),
    lora_run("lora_bf_shard_grad_op", strategy={"sharding": "shard_grad_op"}),
    lora_run("lora_bf_no_shard", strategy={"sharding": "no_shard"}),
    lora_run("lora_depth_first", strategy={"schedule": "depth_first"}),
    lora_run("lora_gpipe", strategy={"schedule": "gpipe", **ONE_STAGE_PER_RANK}),
    lora_run("lora_1f1b", strategy={"schedule": "1f1b", **ONE_STAGE_PER_RANK}),
    lora_run("lora_weight_passing", strategy=WEIGHT_PASSING),
    lora_run("lora_hybrid_shard", strategy=HYBRID),
]
# adapters on blocks 0 and 2 only, with stages [embed], [block 0], [block 1], [block 2, head]: pipeline rank 0
# holds only frozen weights, and the module's optimizer over its trained parameters gets an empty list there
ONE_RANK_FROZEN = run(
    "lora_one_rank_all_frozen",
    strategy={"partition": [1, 1, 1, 2]},
    # (a smaller step: with half the adapters each moves faster, and at 5.0 rounding noise grows to 1e-4 by step 6)
    model={"lora": {**LORA, "layers_to_transform": [0, 2]}, "lr": 1.0},
    checks=["save_at_end"],
)
FULL = run("full_fine_tuning", strategy=UNIFORM, checks=["traffic"])
HALF = lora_run("lora_half", trainer={"max_steps": 4}, checks=["save_at_end"])
RESUMED = lora_run("lora_resumed", resume_from="lora_half/end.ckpt")
# a one-device LoRA checkpoint (4 steps with `strategy="auto"`, written by the fixture) resumed under bfpp
ONE_DEVICE_CHECKPOINT = Path(tempfile.mkdtemp(prefix="bfpp-lora-one-device-")) / "half.ckpt"
FROM_ONE_DEVICE = lora_run("lora_from_one_device_checkpoint", resume_from=str(ONE_DEVICE_CHECKPOINT))
# the embedding layer and the first block's up projection frozen by hand
FREEZE = ["embed", "blocks.0.layer.mlp.up_proj.weight"]
FROZEN_RUNS = [
    run("frozen_full_shard", model={"freeze": FREEZE}),
    run("frozen_no_shard", model={"freeze": FREEZE}, strategy={"sharding": "no_shard"}),
    run("frozen_weight_passing", model={"freeze": FREEZE}, strategy=WEIGHT_PASSING),
]
# ... whose checkpoint resumes (rank 0 reads no optimizer state)
ONE_RANK_FROZEN_RESUMED = dataclasses.replace(
    ONE_RANK_FROZEN,
    name="lora_one_rank_all_frozen_resumed",
    trainer={"max_steps": 7},
    checks=[],
    resume_from="lora_one_rank_all_frozen/end.ckpt",
)
RUNS = [*LORA_RUNS, ONE_RANK_FROZEN, ONE_RANK_FROZEN_RESUMED, FULL, HALF, RESUMED, FROM_ONE_DEVICE, *FROZEN_RUNS]


def one_device_fit(steps: int, *, resume: Path | None = None, save: Path | None = None):
    """``HALF``'s module on one device with ``strategy="auto"`` for ``steps`` steps (resumed from ``resume``, saved
    to ``save``): its losses per step and its weights."""
    losses: list[float] = []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    data = token_data(HALF)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=HALF.local_batch_size * HALF.data_parallel_size, sampler=sampler)
    model = hf_module(HALF)
    options = {**trainer_defaults(HALF), "max_steps": steps}
    trainer = L.Trainer(accelerator="cpu", devices=1, callbacks=[Losses()], **options)
    trainer.fit(model, loader, ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    return losses, {k: v.detach() for k, v in model.named_parameters()}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("lora")
    one_device_fit(4, save=ONE_DEVICE_CHECKPOINT)  # what FROM_ONE_DEVICE resumes
    return workdir, launch(RUNS, 4, workdir, timeout=840)


@pytest.fixture(scope="module")
def results(launched):
    return launched[1]


@pytest.fixture(scope="module")
def lora_reference():
    return hf_reference_run(LORA_RUNS[0])


def assert_weights_match(params: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(params) == set(want)
    for name, w in want.items():
        error = (params[name].double() - w.double()).norm().item()
        assert error <= TOL * w.double().norm().item() + ATOL, f"{name}: {error:.2e}"


@pytest.mark.parametrize("spec", [*LORA_RUNS, ONE_RANK_FROZEN, FULL, *FROZEN_RUNS], ids=lambda r: r.name)
def test_trains_as_on_one_device(spec, results, lora_reference):
    ref = lora_reference if spec.model.get("lora") == LORA else hf_reference_run(spec)
    assert len(ref.steps) == 6
    result = results[spec.name]
    assert_steps_match(result, ref, tol=TOL)
    assert_weights_match(result.params, ref.params)
    # what trains moved, what is frozen did not
    initial = dict(hf_module(spec).named_parameters())
    trained = {n for n, p in initial.items() if p.requires_grad}
    frozen = set(initial) - trained
    assert trained and frozen if spec is not FULL else not frozen
    for name in frozen:
        assert torch.equal(result.params[name], initial[name].detach()), name
    moved = sorted(
        ((ref.params[n] - initial[n]).norm() / initial[n].norm()).item() for n in trained if "lora_B" not in n
    )
    assert moved[len(moved) // 2] > 1e-3


def test_a_rank_with_nothing_to_train_runs_its_stages_without_an_optimizer(results):
    """Pipeline rank 0's stages are all frozen: its optimizer is the empty stand-in (no state to save), and the
    run above still trains equal to one device."""
    for rank in (0, 2):
        assert results[ONE_RANK_FROZEN.name].ranks[rank]["holdings"]["optimizer_state"] == {}
        assert results[ONE_RANK_FROZEN.name].ranks[rank]["holdings"]["parameter_numel"]["trained"] == 0
    for rank in (1, 3):
        assert results[ONE_RANK_FROZEN.name].ranks[rank]["holdings"]["optimizer_state"]
    # its checkpoint resumes: step 7 continues from the saved adapters and optimizer state
    resumed = results[ONE_RANK_FROZEN_RESUMED.name]
    assert [s["step"] for s in resumed.steps(0)] == [7]
    for name, value in results[ONE_RANK_FROZEN.name].params.items():
        assert torch.equal(resumed.params[name], value) != ("lora_B" in name or "lora_A" in name), name


def test_model_summary_shows_the_whole_model_with_its_trainable_share(results):
    """Lightning's model summary under bfpp: every pipeline layer (not a rank's part and its placeholders), the
    whole model's parameter count and the adapters' share of it, each layer's stage and pipeline rank."""
    module = hf_module(LORA_RUNS[0])
    total = sum(p.numel() for p in module.parameters())
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    layers = [name for name, _ in pipeline_layers(module)]
    for rank_result in results["lora_bf_full_shard"].ranks:
        summary = rank_result["holdings"]["model_summary"]
        assert (summary["total"], summary["trainable"]) == (total, trainable)
        assert summary["columns"]["Name"] == layers
        assert "RemoteLayer" not in summary["columns"]["Type"]
        stages = [int(s) for s in summary["columns"]["Stage"]]
        assert stages == sorted(stages) and set(stages) == {0, 1, 2, 3}  # 5 layers over 4 stages, in order
        assert summary["columns"]["Pipeline rank"] == [str(s % 2) for s in stages]  # stage s on rank s mod p


def reduced_bytes_per_step(result) -> int:
    """The bytes FSDP2 reduce-scattered on rank 0 in step 2 (gradient reductions' inputs)."""
    return sum(
        size for step, name, _, size, inside in result.ranks[0]["traffic"] if step == 2 and inside and "reduce" in name
    )


def test_only_adapters_have_gradient_reductions_and_optimizer_state(results):
    lora, full = results["lora_bf_full_shard"], results["full_fine_tuning"]
    initial = dict(hf_module(LORA_RUNS[0]).named_parameters())
    adapters = {n for n, p in initial.items() if p.requires_grad}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    adapter_numel = sum(initial[n].numel() for n in adapters)
    memory = {}
    for label, result in (("LoRA", lora), ("full fine-tuning", full)):
        per_rank = []
        for rank_result in result.ranks:
            state = rank_result["holdings"]["optimizer_state"]
            if result is lora:
                assert set(state) <= adapters and state, sorted(state)[:3]  # only adapters (of local stages)
            optimizer = sum(v["local_numel"] for entries in state.values() for v in entries.values())
            numel = rank_result["holdings"]["parameter_numel"]
            per_rank.append({"parameters": (numel["trained"] + numel["frozen"]) * 4, "optimizer": optimizer * 4})
        memory[label] = per_rank
    # the frozen base is sharded like the rest: each rank holds what full fine-tuning's holds, plus its adapters
    for lora_rank, full_rank in zip(lora.ranks, full.ranks, strict=True):
        lora_numel, full_numel = lora_rank["holdings"]["parameter_numel"], full_rank["holdings"]["parameter_numel"]
        assert lora_numel["frozen"] == full_numel["trained"]
    # never reduced: what FSDP2 reduce-scatters is the adapters' gradients (one rank's share of the adapters of
    # its stages, padded), far below full fine-tuning's
    lora_bytes, full_bytes = reduced_bytes_per_step(lora), reduced_bytes_per_step(full)
    assert 0 < lora_bytes <= 4 * adapter_numel * 1.1, (lora_bytes, adapter_numel)
    assert full_bytes > 5 * lora_bytes
    print(f"\nadapters: {adapter_numel} of {sum(p.numel() for p in initial.values())} parameters")
    for label, per_rank in memory.items():
        print(f"{label}: parameter + optimizer (SGD momentum) bytes per rank: {per_rank}")
    print(f"reduce-scattered per step on rank 0: LoRA {lora_bytes} B, full fine-tuning {full_bytes} B")
    # SGD with momentum: full fine-tuning keeps a buffer per weight, LoRA per adapter weight
    for lora_rank, full_rank in zip(memory["LoRA"], memory["full fine-tuning"], strict=True):
        assert lora_rank["optimizer"] < 0.2 * full_rank["optimizer"]


@pytest.mark.parametrize("name", ["lora_resumed", "lora_from_one_device_checkpoint"])
def test_resumed_run_continues_as_one_device_resumed(name, results, launched):
    """The checkpoint (adapters, frozen base, the adapters' optimizer state) resumes the pipelined run exactly as
    one device resumes from its own; so does a one-device checkpoint, whose optimizer (over the trained
    parameters only) is mapped to them by position.

    Not the uninterrupted run: a checkpoint written after ``fit`` stopped by ``max_steps`` resumes with
    Lightning's own data order (a plain ``DataLoader`` has no place to restore), on one device as here."""
    losses, params = one_device_fit(6, resume=ONE_DEVICE_CHECKPOINT)
    resumed = results[name]
    for rank in range(4):
        steps = resumed.steps(rank)
        assert [s["step"] for s in steps] == [5, 6]
        for got, want in zip(steps, losses, strict=True):
            assert abs(got["callback_metrics"]["train_loss"] - want) <= TOL * want
    assert_weights_match(resumed.params, params)


def test_adapters_export_for_peft_and_merged(launched, lora_reference, tmp_path):
    workdir, _ = launched
    checkpoint = workdir / "out" / "lora_bf_full_shard" / "end.ckpt"
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    reference = hf_module(LORA_RUNS[0])
    reference.load_state_dict(lora_reference.params, strict=False)
    want = reference.eval()(ids)

    adapter = export_pretrained(checkpoint, tmp_path / "adapter")
    assert (adapter / "adapter_config.json").exists()
    torch.manual_seed(3)  # the base model the run started from (frozen: the same after training)
    base = AutoModelForCausalLM.from_config(tiny_config("llama", layers=3))
    loaded = PeftModel.from_pretrained(base, adapter).eval()
    assert (loaded(input_ids=ids).logits - want).abs().max() <= 1e-5

    merged = export_pretrained(checkpoint, tmp_path / "merged", merge=True)
    plain = AutoModelForCausalLM.from_pretrained(merged).eval()
    assert not any("lora" in n for n in plain.state_dict())
    assert (plain(input_ids=ids).logits - want).abs().max() <= 1e-5
