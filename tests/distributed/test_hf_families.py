"""Every tested Hugging Face decoder family, from a ``save_pretrained`` folder, trains under the pipeline equal to
one device and exports back to ``from_pretrained`` with the one-device weights.

The families beyond GPT-2, Llama and Qwen2 (which ``test_huggingface`` covers with more settings): Mistral (one
sliding window for every layer), Qwen3 (q/k norms), Gemma (scaled embeddings, tied), Gemma 2 (alternating
sliding layers, attention and logit soft-capping, tied), Gemma 3 (local layers with their own rotary base,
tied), Phi-3 (fused projections), OLMo 2 (post-norms), Granite (embedding, residual, attention and logit
multipliers), GPT-NeoX (parallel residual, partial rotary), Cohere (parallel block, scaled logits, tied),
Mixtral and Qwen3-MoE (experts and routers, no load-balancing loss). Each is a tiny config of its own class
(``tests.hf_models.FAMILY_SETTINGS`` turns its quirks on), saved with ``save_pretrained``, trained with
(p, dp, v, m) = (2, 2, 2, 4) on 4 CPU processes on padded batches (left and right padding), and with
``strategy="auto"`` on one process on the same global batches: every step's loss on every rank and every final
weight agree within 1e-5 relative in fp32. The run's checkpoint folder is exported with ``export_pretrained``
and loaded with ``from_pretrained``: it holds the one-device run's weights (tied embeddings still tied), and after
training every rank's ``generate`` (through the pipeline, greedy, two end tokens, left-padded prompts of 1 to 13
tokens) gives the exported model's ``transformers`` ``generate`` tokens. All runs share one launch.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch
from transformers import AutoModelForCausalLM

from lightning_bfpp.integrations.huggingface import CAUSAL_LM_FAMILIES, export_pretrained
from tests.distributed.harness import launch, run_2x2
from tests.generation_models import assert_generates_as_exported
from tests.hf_models import assert_trained_as_reference, hf_module, hf_reference_run, tiny_config

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

TOL = 1e-5
ATOL = 1e-6  # see test_huggingface: rounding noise on gradients that are zero in exact arithmetic
COVERED_ELSEWHERE = ("gpt2", "llama", "qwen2")  # tests/distributed/test_huggingface.py
TIED = ("gemma", "gemma2", "gemma3_text", "cohere")  # these families tie their embeddings by default
FAMILIES = tuple(f for f in CAUSAL_LM_FAMILIES if f not in COVERED_ELSEWHERE)
FOLDERS = Path(tempfile.mkdtemp(prefix="bfpp-hf-families-"))


def family_run(family: str):
    return run_2x2(
        f"hf_family_{family}",
        # 3 blocks: 5 layers over 4 stages, so one stage runs two layers and passes the tuple between them
        model={"family": family, "layers": 3, "tie": family in TIED, "pretrained": str(FOLDERS / family)},
        model_factory="tests.hf_models:hf_module",
        loader_factory="tests.hf_models:hf_loader",
        checks=["save_at_end", "generate_at_end"],
    )


RUNS = [family_run(f) for f in FAMILIES]


def test_every_tested_family_is_run_here_or_in_test_huggingface():
    assert set(FAMILIES) | set(COVERED_ELSEWHERE) == set(CAUSAL_LM_FAMILIES)
    assert len(CAUSAL_LM_FAMILIES) >= 10


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("hf_families")
    for family in FAMILIES:
        torch.manual_seed(11)
        config = tiny_config(family, layers=3, tie=family in TIED)
        AutoModelForCausalLM.from_config(config).save_pretrained(FOLDERS / family)
    return workdir, launch(RUNS, 4, workdir, timeout=840)


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.model["family"])
def test_family_trains_as_on_one_device_and_exports_its_weights(run, launched, tmp_path):
    workdir, results = launched
    ref = hf_reference_run(run)
    result = results[run.name]
    # Granite's multipliers make its updates the smallest: 0.08% of the weights' size at the median
    assert_trained_as_reference(result, ref, run, tol=TOL, atol=ATOL)

    # save_pretrained folder -> bfpp -> export_pretrained -> from_pretrained: the one-device run's weights
    out = export_pretrained(workdir / "out" / run.name / "end.ckpt", tmp_path / "exported")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    if run.model["tie"]:
        assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
        assert torch.equal(result.params["embed.embed_tokens.weight"], result.params["head.lm_head.weight"])
    state = loaded.state_dict()
    names = hf_module(run).hf_names
    assert set(state) == set(names)
    for hf_name, ours in names.items():
        want = ref.params[ours].double()
        error = (state[hf_name].double() - want).norm().item()
        assert error <= TOL * want.norm().item() + ATOL, f"{hf_name}: {error:.2e}"


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.model["family"])
def test_family_generates_transformers_tokens_through_the_pipeline(run, launched, tmp_path):
    workdir, _ = launched
    folder = workdir / "out" / run.name
    assert_generates_as_exported(folder, export_pretrained(folder / "end.ckpt", tmp_path / "exported"))
