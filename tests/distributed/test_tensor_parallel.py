"""Tensor parallelism inside the pipeline's stages equals one device.

The suite's ``PipeNet`` with its blocks' MLPs split over the tensor group (``tests/tp_models.py``): ``up``
column-wise, ``down`` row-wise. Breadth-first, ``full_shard``, fp32, against the same module trained on one
process: losses at every step on every rank and every final weight within 1e-5.

- 4 processes, p=2 t=2: the layers parallelised by the module's ``parallelize_layer`` (per stage, after the
  split) and by Lightning's ``configure_model`` convention (before it), the latter with gradient clipping
  that clips (the norm is the whole model's: pipeline, data and tensor shards), and AdamW over two
  parameter groups with a checkpoint after the first epoch, resumed at t=1 under two other layouts (p=4; p=2
  dp=2) equal to the run that did not stop;
- 8 processes, p=2 t=2 dp=2;
- the GPT of ``examples/train_gpt.py`` (the benchmark suite's), attention split by heads through its fused
  ``qkv``, at p=2 t=2 and p=2 t=2 dp=2;
- a Hugging Face Llama parallelised by its own plan (``model.tp_plan``: q/k/v, gate and up column-wise, o and down
  row-wise, the token embedding vocabulary-parallel, the LM head column-wise with its logits gathered), with
  padding on the embedding's ``padding_idx``, at p=2 t=2 and p=2 t=2 dp=2; a Qwen 3 (per-head q/k norms whole,
  their gradients summed over the tensor group) at p=2 t=2;
- parameters tied across pipeline ranks and split alike on both stages (``PipeNet``'s first and last blocks'
  ``up``; a Llama's tied input and output embeddings, both split by vocabulary rows), equal to one device;
- refused, on every rank with the reason: a ``configure_model`` that parallelises a module outside
  ``pipeline_layers()``; a tie split on one stage and whole on the other; a tie that ``configure_model``
  splits apart (each user parallelised on its own gets its own copy).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import (
    assert_params_match,
    assert_steps_match,
    assert_trained_as_on_one_device,
    launch,
    relative_error,
)
from tests.models import RunSpec, reference_run

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

TOL = 1e-5
FACTORY = "tests.tp_models:make"
P2_T2 = {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "stages_per_rank": 2, "num_microbatches": 4}
ADAMW = {"optimizer": "adamw", "param_groups": 2, "scheduler": "step"}


def tp_run(name: str, *, tp: str = "layer", strategy=None, dp: int = 1, model=None, **kwargs) -> RunSpec:
    return RunSpec(
        name=name,
        strategy={**P2_T2, **(strategy or {})},
        model={"optimizer": "sgd", "tp": tp, **(model or {})},
        model_factory=FACTORY,
        local_batch_size=8,
        data_parallel_size=dp,
        **kwargs,
    )


def epochs_run(name: str, strategy: dict, dp: int, epochs: int, **kwargs) -> RunSpec:
    """48 samples, a global batch of 16: 3 steps per epoch (see test_checkpoint.py)."""
    return RunSpec(
        name=name,
        strategy=strategy,
        model={**ADAMW, "tp": "layer"},
        model_factory=FACTORY,
        data={"num_samples": 48},
        trainer={"max_epochs": epochs, "max_steps": -1},
        local_batch_size=16 // dp,
        data_parallel_size=dp,
        **kwargs,
    )


FOUR = [
    tp_run("tp_layer"),
    tp_run("tp_configure_model_clipped", tp="configure_model", trainer={"gradient_clip_val": 0.05}),
    epochs_run("tp_straight", P2_T2, 1, 2),
    epochs_run("tp_half", P2_T2, 1, 1, checks=["save_at_end"]),
    epochs_run("resume_t1_p4", {"pipeline_parallel_size": 4, "stages_per_rank": 1, "num_microbatches": 4}, 1, 2,
               resume_from="tp_half/end.ckpt"),
    epochs_run("resume_t1_p2_dp2", {"pipeline_parallel_size": 2, "stages_per_rank": 2, "num_microbatches": 4}, 2, 2,
               resume_from="tp_half/end.ckpt"),
    tp_run("tp_outside", tp="outside", expect_error=True),
    # the first and last blocks' `up` weights tied across pipeline ranks, split alike on both stages
    tp_run("tp_tied", model={"tie_blocks": True}),
    tp_run("tp_tied_split_unalike", tp="not_last", model={"tie_blocks": True}, expect_error=True),
    # `configure_model` splits each user of the tie on its own: untied, refused
    tp_run("tp_tied_configure_model", tp="configure_model", model={"tie_blocks": True}, expect_error=True),
]  # fmt: skip


PRETRAINED = Path(tempfile.mkdtemp(prefix="bfpp-tp-pretrained-"))  # a tied Llama's folder, saved by `results`


def hf_run(
    name: str, dp: int = 1, family: str = "llama", tie: bool = False, model: dict | None = None, **kwargs
) -> RunSpec:
    """A tiny Llama (grouped-query attention, 3 blocks), or another family, with the model's own plan."""
    return RunSpec(
        name=name,
        strategy=dict(P2_T2),
        model={"family": family, "layers": 3, "optimizer": "sgd", "tie": tie, **(model or {})},
        model_factory="tests.hf_models:hf_module",
        loader_factory="tests.hf_models:hf_loader",
        local_batch_size=8,
        data_parallel_size=dp,
        **kwargs,
    )


def gpt_run(name: str, dp: int = 1) -> RunSpec:
    """The GPT of ``examples/train_gpt.py`` (4 blocks, 4 heads) with its own ``parallelize_layer``."""
    return RunSpec(
        name=name,
        strategy=dict(P2_T2),
        model={"layers": 4},
        model_factory="tests.tp_models:gpt_module",
        loader_factory="tests.tp_models:gpt_loader",
        local_batch_size=16 // dp,
        data_parallel_size=dp,
    )


HF = [
    hf_run("hf_llama_p2_t2"),
    hf_run("hf_qwen3_p2_t2", family="qwen3"),
    # input and output embeddings tied across pipeline ranks, both split by vocabulary rows, clipped by the
    # whole model's norm
    hf_run("hf_llama_tied_p2_t2", tie=True, trainer={"gradient_clip_val": 0.3}),
    # from a `save_pretrained` folder: each rank reads only the rows of its split weights (q/k/v, gate/up, the
    # vocabulary-parallel embedding and head), and the whole tensors of the weights split by columns
    hf_run("hf_llama_tied_from_folder_p2_t2", tie=True, model={"pretrained": str(PRETRAINED)}),
]
# LoRA adapters on a folder's Llama at p=2 t=2 under every schedule kind that runs with tensor parallelism (weight
# passing does not): the base projections split by the plan, each adapter with its base layer; the adapters start
# from the seed alone (nothing copied), as one process under `strategy="auto"` starts them
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"], "lora_dropout": 0.0}
ONE_STAGE = {"stages_per_rank": 1}
LORA_SCHEDULES = {
    "breadth_first": {},
    "breadth_first_zb": {},
    "interleaved_zb": {},
    "zbv": {},
    "depth_first": {},
    "gpipe": ONE_STAGE,
    "1f1b": ONE_STAGE,
}
LORA_TP = [
    dataclasses.replace(
        hf_run(
            f"hf_lora_{kind}_p2_t2",
            model={"pretrained": str(PRETRAINED), "lora": LORA, "lr": 5.0},
            checks=["save_at_end"] if kind == "breadth_first" else [],
        ),
        strategy={**P2_T2, "schedule": kind, **extra},
    )
    for kind, extra in LORA_SCHEDULES.items()
]
FOUR += [*HF, *LORA_TP, gpt_run("gpt_p2_t2")]
EIGHT = [tp_run("tp_p2_t2_dp2", dp=2), hf_run("hf_llama_p2_t2_dp2", dp=2), gpt_run("gpt_p2_t2_dp2", dp=2)]
EQUAL = [*FOUR[:3], FOUR[7], EIGHT[0]]
HF += [EIGHT[1]]
GPT = [FOUR[-1], EIGHT[2]]


@pytest.fixture(scope="module")
def workdir4(tmp_path_factory):
    return tmp_path_factory.mktemp("tp4")


@pytest.fixture(scope="module")
def results(tmp_path_factory, workdir4):
    transformers = pytest.importorskip("transformers")
    from tests.hf_models import tiny_config

    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama", layers=3, tie=True))
    model.save_pretrained(PRETRAINED, max_shard_size="50KB")
    out = launch(FOUR, 4, workdir4, timeout=720)
    out.update(launch(EIGHT, 8, tmp_path_factory.mktemp("tp8"), timeout=600))
    return out


@pytest.mark.parametrize("run", HF, ids=lambda r: r.name)
def test_a_hugging_face_llama_trains_with_its_own_plan_as_on_one_device(run, results):
    pytest.importorskip("transformers")
    from tests.hf_models import assert_trained_as_reference, hf_reference_run

    result = results[run.name]
    assert_trained_as_reference(result, hf_reference_run(run), run, tol=TOL, atol=1e-6)
    assert [r["holdings"]["tensor_rank"] for r in result.ranks] == [0, 1] * (len(result.ranks) // 2)
    split = {n for r in result.ranks for n in r["holdings"]["tensor_parallel_parameters"]}
    projections = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
    projections += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    want = {f"blocks.{b}.layer.{proj}.weight" for b in range(3) for proj in projections} | {"head.lm_head.weight"}
    # the model's plan (`model.tp_plan`) makes the token embedding vocabulary-parallel too; Qwen 3's per-head
    # q/k norms stay whole, their gradients summed over the tensor group (`replicated_with_grad_allreduce`)
    assert split == want | {"embed.embed_tokens.weight"}


@pytest.mark.parametrize("run", EQUAL, ids=lambda r: r.name)
def test_trains_as_on_one_device(run, results):
    result = results[run.name]
    assert_trained_as_on_one_device(result, run, tol=TOL)
    holdings = [r["holdings"] for r in result.ranks]
    # every rank's blocks are split over its tensor group: half of each MLP weight per tensor rank (and per
    # data-parallel shard, under full_shard), the embedding and head whole
    assert all(h["tensor_parallel_size"] == 2 for h in holdings)
    assert [h["tensor_rank"] for h in holdings] == [0, 1] * (len(holdings) // 2)  # consecutive global ranks
    # the blocks' MLPs are split over the tensor group, and nothing else
    split = {n for h in holdings for n in h["tensor_parallel_parameters"]}
    assert split == {f"blocks.{b}.{lin}.{w}" for b in range(8) for lin in ("up", "down") for w in ("weight", "bias")}


@pytest.mark.parametrize("run", GPT, ids=lambda r: r.name)
def test_the_examples_gpt_trains_as_on_one_device(run, results):
    """Attention split by heads through the fused ``qkv`` (each rank's rows are whole heads), the MLP by hidden
    units; losses on every rank and every weight equal one device's, and the weights moved."""
    from tests.tp_models import gpt_module, gpt_reference_run

    result, ref = results[run.name], gpt_reference_run(run)
    assert_steps_match(result, ref, tol=TOL)
    assert_params_match(result, ref, tol=TOL)
    initial = gpt_module(run).state_dict()
    assert min(relative_error(ref.params[k], initial[k]) for k in ref.params if k.endswith("weight")) > 30 * TOL
    split = {n for r in result.ranks for n in r["holdings"]["tensor_parallel_parameters"]}
    linears = ("qkv.weight", "qkv.bias", "proj.weight", "proj.bias", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight")
    assert split == {f"blocks.{b}.{n}" for b in range(4) for n in (*linears, "mlp.2.bias")}


@pytest.fixture(scope="module")
def lora_reference(results):
    """LoRA on the folder's Llama trained on one process under `strategy="auto"` (the same for every schedule)."""
    from tests.hf_models import hf_reference_run

    return hf_reference_run(LORA_TP[0])


@pytest.mark.parametrize("run", LORA_TP, ids=lambda r: r.name)
def test_lora_adapters_split_with_their_base_layers_train_as_on_one_device(run, results, lora_reference):
    """fp32, 1e-5: losses on every rank and every weight equal one process's (which started from the same seed,
    nothing copied), the adapters moved and the frozen base did not; q/v's B and down's A are split, as their base
    layers (q/v column-wise, down row-wise), their A and B whole."""
    from tests.hf_models import hf_module

    result = results[run.name]
    assert_steps_match(result, lora_reference, tol=TOL)
    assert set(result.params) == set(lora_reference.params)
    for name, want in lora_reference.params.items():
        error = (result.params[name].double() - want.double()).norm().item()
        assert error <= TOL * want.double().norm().item() + 1e-6, f"{name}: {error:.2e}"
    module = hf_module(run)
    module.materialize()
    initial = dict(module.named_parameters())
    adapters = [n for n, p in initial.items() if p.requires_grad]
    assert adapters and all(".lora_" in n for n in adapters)
    assert all(torch.equal(result.params[n], p.detach()) for n, p in initial.items() if not p.requires_grad)
    moved = sorted(relative_error(result.params[n], initial[n].detach()) for n in adapters if "lora_A" in n)
    assert moved[len(moved) // 2] > 30 * TOL
    split = {n for r in result.ranks for n in r["holdings"]["tensor_parallel_parameters"]}
    for block in range(3):
        prefix = f"blocks.{block}.layer."
        for proj, lora in (("self_attn.q_proj", "lora_B"), ("self_attn.v_proj", "lora_B"), ("mlp.down_proj", "lora_A")):
            assert f"{prefix}{proj}.base_layer.weight" in split
            assert f"{prefix}{proj}.{lora}.default.weight" in split
            whole = "lora_A" if lora == "lora_B" else "lora_B"
            assert f"{prefix}{proj}.{whole}.default.weight" not in split


def test_lora_adapters_trained_with_tensor_parallelism_export_as_one_processs(
    results, workdir4, lora_reference, tmp_path
):
    """The breadth-first run's checkpoint exports its adapters for `peft` and merged into a `from_pretrained`
    folder; both give the logits of the weights it trained (which equal one process's, above), and those of one
    process within the training's own tolerance."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lightning_bfpp.integrations.huggingface import export_pretrained
    from tests.hf_models import hf_module

    checkpoint = workdir4 / "out" / LORA_TP[0].name / "end.ckpt"
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    trained = hf_module(LORA_TP[0])
    trained.materialize()
    trained.load_state_dict(results[LORA_TP[0].name].params, strict=False)
    want = trained.eval()(ids)
    reference = hf_module(LORA_TP[0])
    reference.materialize()
    reference.load_state_dict(lora_reference.params, strict=False)
    assert relative_error(want, reference.eval()(ids)) < 1e-4
    adapter = export_pretrained(checkpoint, tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(PRETRAINED), adapter).eval()
    assert (loaded(input_ids=ids).logits - want).abs().max() <= 1e-6
    merged = AutoModelForCausalLM.from_pretrained(export_pretrained(checkpoint, tmp_path / "merged", merge=True))
    assert not any("lora" in n for n in merged.state_dict())
    assert (merged.eval()(input_ids=ids).logits - want).abs().max() <= 1e-6


def test_clipping_uses_the_whole_models_norm(results):
    """The clipped run clipped (its one-device norm is above the threshold) and equals one device (above); the
    norm every rank computes (``strategy.gradient_norm``: pipeline, data and tensor shards) is one device's."""
    run = EQUAL[1]
    ref = reference_run(run)
    norms = [s["grad_norm"] for s in ref.steps]
    assert all(n is not None and n > 0.05 for n in norms), norms
    for rank in results[run.name].ranks:
        assert [s["grad_norm"] for s in rank["steps"]] == pytest.approx(norms, rel=TOL)


@pytest.mark.parametrize("name", ["resume_t1_p4", "resume_t1_p2_dp2"])
def test_a_tensor_parallel_checkpoint_resumes_without_tensor_parallelism(name, results):
    straight, resumed = results["tp_straight"], results[name]
    for rank in range(4):
        got = [s["callback_metrics"]["train_loss"] for s in resumed.steps(rank)]
        want = [s["callback_metrics"]["train_loss"] for s in straight.steps(0)][3:]
        assert got == pytest.approx(want, rel=TOL)
    assert max(relative_error(resumed.params[k], straight.params[k]) for k in straight.params) < TOL
    assert straight.optimizer_state
    assert max(relative_error(resumed.optimizer_state[k], straight.optimizer_state[k])
               for k in straight.optimizer_state) < TOL  # fmt: skip


def test_a_tie_split_differently_on_its_stages_is_refused(results):
    errors = [r["error"] for r in results["tp_tied_split_unalike"].ranks]
    assert len(set(errors)) == 1 and errors[0] is not None, errors
    assert "the parameter `blocks.0.up.weight` is shared by layers on several stages, which split it" in errors[0]
    assert "Split every layer that uses it alike" in errors[0]


def test_a_tie_that_configure_model_splits_apart_is_refused(results):
    errors = [r["error"] for r in results["tp_tied_configure_model"].ranks]
    assert len(set(errors)) == 1 and errors[0] is not None, errors
    assert "`blocks.0.up.weight`, `blocks.7.up.weight` were one tied Parameter before `configure_model`" in errors[0]


def test_parallelising_outside_the_pipeline_layers_is_refused(results):
    errors = [r["error"] for r in results["tp_outside"].ranks]
    assert len(set(errors)) == 1 and errors[0] is not None, errors
    assert (
        "`extra.weight` is a tensor-parallel (DTensor) parameter outside the module's `pipeline_layers()`"
        in (errors[0])
    )
