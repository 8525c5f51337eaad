"""Hugging Face models trained under the pipeline equal one-device training, for each supported family.

GPT-2, Llama, Qwen2 (with sliding-window layers) causal LMs and a BERT regressor, built from tiny random
configs by ``tests.hf_models``, are trained with (p, dp, v, m) = (2, 2, 2, 4) on 4 CPU processes and with
``strategy="auto"`` on one process on the same global batches; every step's loss on every rank and every
final parameter must agree within 1e-5 relative in fp32. Hidden states cross stages with the attention mask
(padded batches) and position ids; rotary tables and masks are rebuilt on each stage. A Qwen2 also trains on
packed documents (``position_ids`` restarting in each row, no attention mask, as ``DataCollatorWithFlattening``
makes them), whose blocks on every stage must keep the documents apart as one device does. All runs share one
launch. Each run's checkpoint exports to a `from_pretrained` folder with the trained weights. A Qwen2 created
on the meta device trains from its own init; GPT-2 and Qwen2 with tied input and output embeddings (on
the first and the last stage) train equal to one device too, their two copies of the tied weight identical;
and a tied Llama loaded from a `save_pretrained` folder trains, exports and loads on one device with the
one-device run's weights.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch
from transformers import AutoModel, AutoModelForCausalLM

from lightning_bfpp.integrations.huggingface import export_pretrained
from tests.distributed.harness import assert_started_as_one_process, assert_steps_match, launch, run_2x2
from tests.hf_models import VOCAB, assert_trained_as_reference, hf_module, hf_reference_run, tiny_config

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

TOL = 1e-5
# an attention key bias gets no gradient in exact arithmetic (a query's softmax ignores a shift shared by all
# its keys), only rounding noise that depends on the summation order: compared absolutely, not relatively
ATOL = 1e-6
FAMILIES = ("gpt2", "llama", "qwen2", "bert")


def hf_run(name: str, family: str, **kwargs):
    # 3 blocks: 5 layers over 4 stages, so one stage runs two layers and passes the tuple between them
    return run_2x2(
        name,
        model={"family": family, "layers": 3, **kwargs.pop("model", {})},
        model_factory="tests.hf_models:hf_module",
        loader_factory="tests.hf_models:hf_loader",
        **kwargs,
    )


# each run also saves a checkpoint at its end, which `export_pretrained` turns into a `from_pretrained` folder
EQUIVALENCE = [
    hf_run(f"hf_{family}", family, checks=["save_at_end", *(["generate_at_end"] if family != "bert" else [])])
    for family in FAMILIES
]
# packed documents: no mask crosses the stages, and the sliding-window layers see the document boundaries too
PACKED = hf_run("hf_qwen2_packed", "qwen2", data={"packed": True})
# created under `trainer.init_module(empty_init=True)`: each rank materializes its own layers (rotary tables
# included) with the model's init, so the weights are not the reference's; it must train like a fresh model
META = hf_run("hf_qwen2_empty_init", "qwen2", checks=["empty_init", "save_initial_params"])
# (Gemma, Gemma 2, Gemma 3 and Cohere train tied in test_hf_families)
TIED = [hf_run(f"hf_{family}_tied", family, model={"tie": True}) for family in ("gpt2", "qwen2")]
# a `save_pretrained` folder (a tied Llama) → pipelined training → export → `from_pretrained` on one device
PRETRAINED = Path(tempfile.mkdtemp(prefix="bfpp-hf-pretrained-"))
FROM_FOLDER = hf_run(
    "hf_llama_from_folder",
    "llama",
    model={"tie": True, "pretrained": str(PRETRAINED)},
    checks=["save_at_end", "no_foreign_tensors"],
)
# the same weights stored in bf16, kept in fp32 (`dtype=`): converted as each rank reads its own stages' tensors
PRETRAINED_BF16 = Path(tempfile.mkdtemp(prefix="bfpp-hf-pretrained-bf16-"))
FROM_BF16_FOLDER = hf_run(
    "hf_llama_from_bf16_folder", "llama", model={"tie": True, "pretrained": str(PRETRAINED_BF16), "dtype": "float32"}
)
RUNS = [*EQUIVALENCE, PACKED, META, *TIED, FROM_FOLDER, FROM_BF16_FOLDER]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("huggingface")
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", layers=3, tie=True))
    model.save_pretrained(PRETRAINED, max_shard_size="50KB")  # sharded: each rank opens only its stages' files
    model.to(torch.bfloat16).save_pretrained(PRETRAINED_BF16)
    return workdir, launch(RUNS, 4, workdir, timeout=480)


@pytest.fixture(scope="module")
def results(launched):
    return launched[1]


@pytest.mark.parametrize("run", [*EQUIVALENCE, PACKED, *TIED, FROM_FOLDER, FROM_BF16_FOLDER], ids=lambda r: r.name)
def test_matches_single_device(run, results):
    assert_trained_as_reference(results[run.name], hf_reference_run(run), run, tol=TOL, atol=ATOL)


def test_a_pretrained_folder_leaves_no_rank_holding_another_ranks_layers(results):
    """Built on the meta device and read per stage, with the garbage collector off from the model's creation to the
    end of setup: no tensor of a layer another rank holds is alive anywhere."""
    for rank in results[FROM_FOLDER.name].ranks:
        foreign = rank["foreign_tensors"]
        assert foreign["kept"] and foreign["dropped"] and foreign["alive"] == 0, foreign


@pytest.mark.parametrize("run", EQUIVALENCE, ids=lambda r: r.name)
def test_export_from_the_pipelined_checkpoint(run, launched, tmp_path):
    """The BFPPStrategy checkpoint folder, exported on one process, loads with `from_pretrained` holding exactly
    the weights the pipelined run ended with."""
    workdir, results = launched
    out = export_pretrained(workdir / "out" / run.name / "end.ckpt", tmp_path / "exported")
    auto = AutoModel if run.model["family"] == "bert" else AutoModelForCausalLM
    loaded = auto.from_pretrained(out).state_dict()
    trained = results[run.name].params
    names = hf_module(run).hf_names
    assert set(loaded) == set(names)
    for hf_name, ours in names.items():
        assert torch.equal(loaded[hf_name], trained[ours]), hf_name


def test_meta_device_model_trains_as_on_one_device(launched):
    """Each rank materialized its own layers with the model's init, each module from the seed and its name: one
    process materializing the whole model from the same seed starts from the same weights (nothing copied from the
    run) and trains to the same losses and weights."""
    workdir, results = launched
    with torch.device("meta"):
        module = hf_module(META)
    module.materialize()
    assert_started_as_one_process(workdir / "out" / META.name, module)
    ref = hf_reference_run(META)
    assert len(ref.steps) == 6
    assert_steps_match(results[META.name], ref, tol=TOL)
    for name, want in ref.params.items():
        error = (results[META.name].params[name].double() - want.double()).norm().item()
        assert error <= TOL * want.double().norm().item() + ATOL, f"{name}: {error:.2e}"
    # the model's own init (std 0.02) predicts nearly uniformly at first: about ln(vocabulary size)
    first = ref.steps[0]["callback_metrics"]["train_loss"]
    assert abs(first - math.log(VOCAB)) < 0.05, first


def test_a_pretrained_folder_trains_and_exports_as_on_one_device(launched, tmp_path):
    """`save_pretrained` folder → pipelined training → export → `from_pretrained` on one device: the loaded model
    holds the one-device run's final weights (tied input and output embeddings included)."""
    workdir, _ = launched
    ref = hf_reference_run(FROM_FOLDER)
    out = export_pretrained(workdir / "out" / FROM_FOLDER.name / "end.ckpt", tmp_path / "exported")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # still tied
    state = loaded.state_dict()
    for hf_name, ours in hf_module(FROM_FOLDER).hf_names.items():
        want = ref.params[ours].double()
        error = (state[hf_name].double() - want).norm().item()
        assert error <= TOL * want.norm().item() + ATOL, f"{hf_name}: {error:.2e}"


@pytest.mark.parametrize("run", TIED, ids=lambda r: r.name)
def test_tied_embeddings_stay_equal(run, results):
    """The head's copy of the tied embedding (another stage, another rank) ends equal to the embedding, bit for
    bit: the copies' gradients are summed over the tie, so the optimizer updates them alike."""
    params = results[run.name].params
    embedding, head = params["embed.embed_tokens.weight"], params["head.lm_head.weight"]
    assert torch.equal(embedding, head)


@pytest.mark.parametrize("run", [r for r in EQUIVALENCE if r.model["family"] != "bert"], ids=lambda r: r.name)
def test_generates_transformers_tokens_through_the_pipeline(run, launched, tmp_path):
    """After training, every rank's ``generate`` gives the exported model's ``transformers`` tokens (the other
    families: ``test_hf_families``)."""
    from tests.generation_models import assert_generates_as_exported

    workdir, _ = launched
    folder = workdir / "out" / run.name
    assert_generates_as_exported(folder, export_pretrained(folder / "end.ckpt", tmp_path / "exported"))
