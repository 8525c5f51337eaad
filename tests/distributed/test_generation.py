"""Generation through the pipeline gives ``transformers``' tokens, with the pipeline kept full, and changes nothing.

A 6-block Llama from a ``save_pretrained`` folder (``tests.generation_models``), greedy with two end-of-sequence
tokens on 13 left-padded prompts of lengths 1 to 13 in one batch, compared with ``transformers``' ``generate`` on one
process on the same folder:

- at (p, v, dp, t) = (2, 1, 1, 1), (2, 2, 1, 1), (4, 2, 1, 1), (2, 2, 2, 1), (2, 1, 1, 2), with the call made on every
  rank from a hook (``on_train_start``): the same tokens, and every step's logits within 1e-5 relative (the rows
  still running); at least three rows stop early. Sampling from a seed gives the same tokens at every p, v and t
  (two groups), and with one group ``transformers``' own. A rank holds a cache for its own stages only, one per
  (stage, group), of the size the docs' formula gives. A call for 32 new tokens makes as many collectives (FSDP2's
  gathers among them) as one for 8: none per token. Replicas with 13, 6 and 0 prompts all finish;
- in a ``fit`` at p=2 v=2 dp=2 whose ``validation_step`` generates (the step path) and whose
  ``on_validation_epoch_end`` samples: each replica's completions are ``transformers``' for its rows, the logged
  count sums the replicas', ``trainer.predict`` returns completions, and the losses and weights equal, bit for bit,
  the same ``fit`` validating without generation (a model with attention dropout, so a changed random state would
  show);
- weight passing (every rank decoding its own prompts through the whole model) and the "zbv" placement (a V: the
  ring's messages pass through ranks) give the same tokens;
- a layer failing on one rank in the middle of a call stops every process, the others naming it.

Every family in ``CAUSAL_LM_FAMILIES`` generates ``transformers``' tokens at p=2 dp=2 v=2 (``generate_at_end`` in
``test_hf_families`` and ``test_huggingface``).
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch
from transformers import AutoModelForCausalLM

from tests.distributed.harness import launch, relative_error, run_worker
from tests.generation_models import EOS, NEW_TOKENS, PAD, PROMPT_LENGTH, SAMPLING, PromptData, prompts
from tests.hf_models import tiny_config
from tests.models import RunSpec

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

FOLDER = Path(tempfile.mkdtemp(prefix="bfpp-generation-"))  # the Llama's folder, written by `results`
DROPOUT = FOLDER / "dropout"  # the same with attention dropout (the fits that must not change)
FACTORY = "tests.generation_models:generating_llama"
LOADER = "tests.generation_models:prompt_loader"


def hooks_run(name: str, p: int, v: int, dp: int = 1, t: int = 1, **strategy) -> RunSpec:
    return RunSpec(
        name=name,
        strategy={
            "pipeline_parallel_size": p,
            "stages_per_rank": v,
            "tensor_parallel_size": t,
            "num_microbatches": 2,
            **strategy,
        },
        model={"pretrained": str(FOLDER), "generate": "hooks", "groups": 2},
        model_factory=FACTORY,
        loader_factory=LOADER,
        trainer={"max_steps": 1},
        local_batch_size=8 // dp,
        data_parallel_size=dp,
    )


LAYOUTS = {  # (p, v, dp, t) -> processes
    (2, 1, 1, 1): 2,
    (2, 2, 1, 1): 2,
    (4, 2, 1, 1): 4,
    (2, 2, 2, 1): 4,
    (2, 1, 1, 2): 4,
}
HOOKS = {layout: hooks_run("hooks_p{}_v{}_dp{}_t{}".format(*layout), *layout) for layout in LAYOUTS}
OTHER_KINDS = {
    "weight_passing": dataclasses.replace(
        hooks_run("hooks_weight_passing", 1, 1, dp=4, schedule="weight_passing"),
        strategy={"schedule": "weight_passing"},
    ),
    "zbv": hooks_run("hooks_zbv", 2, 2, dp=2, schedule="zbv"),
}


def fit_run(name: str, generate: str) -> RunSpec:
    return RunSpec(
        name=name,
        strategy={"pipeline_parallel_size": 2, "stages_per_rank": 2, "num_microbatches": 2},
        model={"pretrained": str(DROPOUT), "generate": generate, "groups": 2},
        model_factory=FACTORY,
        loader_factory=LOADER,
        local_batch_size=4,
        data_parallel_size=2,
        checks=["validate", "predict"] if generate == "steps" else ["validate"],
        trainer={"max_epochs": 2, "max_steps": -1, "num_sanity_val_steps": 2},
    )


FITS = {"generating": fit_run("fit_generating", "steps"), "plain": fit_run("fit_plain", "none")}
FAILING = dataclasses.replace(
    hooks_run("failing", 2, 1, dp=2), model={"pretrained": str(FOLDER), "generate": "hooks", "fail_rank": 1}
)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama", layers=6)).save_pretrained(FOLDER)
    config = tiny_config("llama", layers=6)
    config.attention_dropout = 0.1
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(DROPOUT)
    root = tmp_path_factory.mktemp("generation")
    out = {}
    for processes in (2, 4):
        runs = [run for layout, run in HOOKS.items() if LAYOUTS[layout] == processes]
        if processes == 4:
            runs += [*OTHER_KINDS.values(), *FITS.values()]
        folder = root / str(processes)
        folder.mkdir()
        out.update({run.name: (folder / "out" / run.name, run) for run in runs})
        launch(runs, processes, folder, timeout=840)
    return out


def generated(results, run: RunSpec) -> list[dict]:
    folder, _ = results[run.name]
    return [torch.load(path, weights_only=False) for path in sorted(folder.glob("generated_rank*.pt"))]


@pytest.fixture(scope="module")
def reference(results):
    """``transformers``' ``generate`` on one process: greedy with logits, and sampled from the runs' seed."""
    model = AutoModelForCausalLM.from_pretrained(FOLDER).eval()
    ids, mask = prompts()
    options = {"max_new_tokens": NEW_TOKENS, "eos_token_id": list(EOS), "pad_token_id": PAD}
    greedy = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, output_logits=True, **options)
    torch.manual_seed(7)
    sampled = model.generate(ids, attention_mask=mask, **SAMPLING, **options)
    return model, greedy, sampled


def test_the_end_of_sequence_tokens_stop_rows_early(reference):
    _, greedy, _ = reference
    new = greedy.sequences[:, PROMPT_LENGTH:]
    stopped = (new == PAD).any(dim=1) & (new[:, -1] == PAD)
    assert int(stopped.sum()) >= 3, new
    assert greedy.sequences.shape[1] == PROMPT_LENGTH + NEW_TOKENS  # some row ran to the end


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=lambda layout: "p{}_v{}_dp{}_t{}".format(*layout))
def test_greedy_tokens_and_logits_are_transformers(results, reference, layout):
    _, greedy, _ = reference
    for rank, record in enumerate(generated(results, HOOKS[layout])):
        assert torch.equal(record["greedy"], greedy.sequences), f"rank {rank}"
        assert torch.equal(record["greedy_row_groups"], greedy.sequences), f"rank {rank}"
        for step, (got, want) in enumerate(zip(record["logits"], greedy.logits, strict=True)):
            running = got.abs().sum(-1) > 0  # the rows of groups still in the ring at that step
            assert running.any()
            assert relative_error(got[running], want[running]) < 1e-5, (rank, step)


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=lambda layout: "p{}_v{}_dp{}_t{}".format(*layout))
def test_sampling_from_a_seed_is_the_same_at_every_layout_and_transformers_with_one_group(results, reference, layout):
    _, _, sampled = reference
    first = generated(results, HOOKS[(2, 1, 1, 1)])[0]["sampled_groups2"]
    for record in generated(results, HOOKS[layout]):
        assert torch.equal(record["sampled_groups1"], sampled)
        if layout[2] == 1:  # the same replica count and group count: the same draws
            assert torch.equal(record["sampled_groups2"], first)


@pytest.mark.parametrize("layout", [(2, 1, 1, 1), (4, 2, 1, 1), (2, 1, 1, 2)], ids=str)
def test_each_rank_caches_its_own_stages_one_cache_per_stage_and_group_of_the_documented_size(results, layout):
    """Cache bytes per rank: 2 (keys, values) x its decoder layers x KV heads per tensor rank x head size x rows x
    (prompt + new tokens - 1) x 4 bytes (fp32), summed over its (stage, group) caches (docs/generation.md)."""
    p, v, _, t = layout
    config = tiny_config("llama", layers=6)
    head_dim = config.hidden_size // config.num_attention_heads
    for rank, record in enumerate(generated(results, HOOKS[layout])):
        pipeline_rank = rank // t
        stages = [s for s in range(p * v) if s % p == pipeline_rank]
        assert {stage for stage, _ in record["cache_bytes_32"]} <= set(stages)
        assert {group for _, group in record["cache_bytes_32"]} == set(range(p))  # the default: p groups
        layers = record["decoder_layers"]
        want = 2 * layers * (config.num_key_value_heads // t) * head_dim * PROMPT_LENGTH * (PROMPT_LENGTH + 31) * 4
        assert sum(record["cache_bytes_32"].values()) == want, (rank, record["cache_bytes_32"], want)


def test_no_collective_per_token_and_weights_gathered_once_per_call(results):
    """32 new tokens cost the collectives 8 do (FSDP2's all-gathers, one per stage: full_shard at dp=2)."""
    for record in generated(results, HOOKS[(2, 2, 2, 1)]):
        assert record["collectives_8"] == record["collectives_32"]
        assert record["collectives_8"].get("foreach_all_gather", 0) == 2  # each of its two stages, once


def test_replicas_with_different_numbers_of_prompts_finish(results):
    model = AutoModelForCausalLM.from_pretrained(FOLDER).eval()
    ids, mask = prompts()
    for record in generated(results, HOOKS[(2, 2, 2, 1)]):
        rows = record["replica_rows"]
        assert record["replica"].shape[0] == rows
        if rows:
            want = model.generate(
                ids[:rows], attention_mask=mask[:rows], max_new_tokens=NEW_TOKENS, eos_token_id=list(EOS),
                pad_token_id=PAD,
            )  # fmt: skip
            assert torch.equal(record["replica"], want)
    assert {record["replica_rows"] for record in generated(results, HOOKS[(2, 2, 2, 1)])} == {13, 0}


@pytest.mark.parametrize("kind", list(OTHER_KINDS))
def test_weight_passing_and_the_v_placement_give_the_same_tokens(results, reference, kind):
    _, greedy, _ = reference
    records = generated(results, OTHER_KINDS[kind])
    assert len(records) == 4
    for record in records:
        assert torch.equal(record["greedy"], greedy.sequences)


def test_validation_steps_and_predict_generate_transformers_tokens_for_their_replicas_rows(results):
    """The sanity check's validation steps (the folder's weights) on the last stages, each replica its rows; the
    count they log sums both replicas'; ``trainer.predict`` after training returns the trained model's completions,
    every replica's, in dataset order on global rank 0."""
    from tests.distributed.harness import load_results
    from tests.generation_models import generating_llama

    run = FITS["generating"]
    folder = results[run.name][0]
    model = AutoModelForCausalLM.from_pretrained(DROPOUT).eval()
    data = PromptData()
    options = {"max_new_tokens": NEW_TOKENS, "eos_token_id": list(EOS), "pad_token_id": PAD}
    records = generated(results, run)
    for rank in (0, 2):  # first stages: the step runs up to its call only
        assert records[rank]["sanity"] == [] and records[rank]["validation"] == []
    for rank in (1, 3):
        replica = rank // 2
        rows = list(range(replica, len(data), 2))  # Lightning's evaluation sampler: replica r takes rows r, r + 2, …
        assert len(records[rank]["sanity"]) == 2 and len(records[rank]["validation"]) == 2 * 4
        for b, got in enumerate(records[rank]["sanity"]):
            part = rows[4 * b : 4 * b + 4]
            want = model.generate(data.ids[part], attention_mask=data.mask[part], **options)
            assert torch.equal(got, want), (rank, b)
    # predictions: the trained weights' completions (`transformers` on them), every replica's batches
    trained = load_results([run], 4, folder.parent.parent)[run.name].params
    module = generating_llama(run)
    module.materialize()
    module.load_state_dict(trained, strict=False)
    model.load_state_dict(module.hf_state_dict())
    predictions = torch.cat(torch.load(folder / "predictions_rank0.pt", weights_only=False))
    assert predictions.shape[0] == len(data)  # both replicas' rows, in dataset order
    for i, got in enumerate(predictions):  # row by row: a batch's width is its longest row's
        want = model.generate(data.ids[i : i + 1], attention_mask=data.mask[i : i + 1], **options)[0]
        assert torch.equal(got[: len(want)], want) and bool((got[len(want) :] == PAD).all()), i


def test_fit_with_generation_in_validation_changes_nothing(results):
    """Losses at every step and every final weight equal the same fit validating without generation, bit for bit."""
    from tests.distributed.harness import load_results

    runs = list(FITS.values())
    folder = results[runs[0].name][0].parent.parent
    loaded = load_results(runs, 4, folder)
    with_generation, plain = loaded[FITS["generating"].name], loaded[FITS["plain"].name]
    for rank in range(4):
        got = [s["callback_metrics"]["train_loss"] for s in with_generation.steps(rank)]
        want = [s["callback_metrics"]["train_loss"] for s in plain.steps(rank)]
        assert got == want and len(got) == 8
    assert plain.params and all(torch.equal(with_generation.params[k], v) for k, v in plain.params.items())


def test_a_failure_during_generation_stops_every_process_naming_the_rank(results, tmp_path):
    proc = run_worker([FAILING], 4, tmp_path, timeout=240)
    end = time.time()
    assert proc.returncode != 0
    found = re.findall(r"injected failure in decode on rank 1 at ([0-9.]+)", proc.stderr)
    assert found, proc.stderr[-3000:]
    assert end - float(found[0]) < 60
    stopped = re.findall(r"BFPPStrategy: stopping this process because (.*)$", proc.stderr, re.M)
    assert stopped and all(reason.startswith("rank 1 failed") for reason in stopped), proc.stderr[-3000:]
