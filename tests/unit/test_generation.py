"""Generation on one process: the ring's bookkeeping, the layers' ``decode`` protocol, ``transformers``' semantics.

The distributed behaviour (the ring over ranks, sharded and split weights, steps) is in
``tests/distributed/test_generation.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_bfpp
from lightning_bfpp.engine.generation import Stopping, group_rows, prefill_positions

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM

from lightning_bfpp.integrations.huggingface import HFCausalLM
from tests.generation_models import EOS, PAD, prompts
from tests.hf_models import tiny_config


def test_groups_are_contiguous_near_equal_and_never_empty():
    assert group_rows(13, 4) == [slice(0, 4), slice(4, 7), slice(7, 10), slice(10, 13)]
    assert group_rows(2, 4) == [slice(0, 1), slice(1, 2)]
    assert group_rows(0, 4) == []


def test_prompt_positions_skip_left_padding_as_transformers_does():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert prefill_positions(mask).tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]


def test_stopping_needs_a_padding_token_with_an_end_and_at_least_one_token():
    with pytest.raises(ValueError, match="needs a `pad_token_id`"):
        Stopping(4, (2,), None)
    with pytest.raises(ValueError, match="at least 1"):
        Stopping(0)


class _Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(20, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids)

    def decode(self, inputs, cache):
        return self.table(inputs[0])


class _RunningMean(nn.Module):
    """Each position sees the mean of every hidden state up to it: its cache is the running sum and count."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        counts = torch.arange(1, hidden.shape[1] + 1).view(1, -1, 1)
        return self.proj(hidden.cumsum(1) / counts)

    def decode(self, hidden, cache):
        total = hidden.cumsum(1) + cache.get("sum", 0)
        counts = torch.arange(1, hidden.shape[1] + 1).view(1, -1, 1) + cache.get("count", 0)
        cache["sum"], cache["count"] = total[:, -1:], counts[:, -1:]
        return self.proj(total / counts)


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(8, 20)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.out(hidden)

    def decode(self, hidden, cache):
        return self.out(hidden[:, -1:])


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([_Embed(), _RunningMean(), _RunningMean(), _Head()])

    def pipeline_layers(self):
        return list(self.layers)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = ids
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_modules_own_layers_generate_through_the_decode_protocol_as_its_forward_would():
    """``lightning_bfpp.generate`` with layers that keep a cache gives the tokens of re-running the whole forward for
    every new token, for one group and several."""
    import lightning as L

    class ToyModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.toy = Toy()

        def pipeline_layers(self):
            return self.toy.pipeline_layers()

        def forward(self, ids):
            return self.toy(ids)

    module = ToyModule()
    ids = torch.randint(0, 20, (5, 4), generator=torch.Generator().manual_seed(1))
    want = ids
    for _ in range(6):
        want = torch.cat([want, module(want)[:, -1].argmax(-1, keepdim=True)], dim=1)
    for groups in (1, 2, 5):
        assert torch.equal(lightning_bfpp.generate(module, ids, max_new_tokens=6, num_groups=groups), want)


def test_a_layer_without_decode_is_refused_by_name_with_the_protocol():
    import lightning as L

    class NoDecode(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([_Embed(), nn.Linear(8, 20)])

        def pipeline_layers(self):
            return list(self.layers)

    with pytest.raises(TypeError, match=r"pipeline layer `layers.1` \(Linear\) cannot generate: it has no `decode"):
        lightning_bfpp.generate(NoDecode(), torch.zeros(1, 2, dtype=torch.long), max_new_tokens=1)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama", layers=3)).save_pretrained(folder)
    module = HFCausalLM(folder)
    module.materialize()
    return module, AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.mark.parametrize("groups", [1, 3])
def test_hf_generate_on_one_process_is_transformers_greedy_and_sampled(llama, groups):
    module, model = llama
    ids, mask = prompts()
    options = {"max_new_tokens": 6, "eos_token_id": list(EOS), "pad_token_id": PAD}
    want = model.generate(ids, attention_mask=mask, **options)
    assert torch.equal(module.generate(ids, mask, num_groups=groups, **options), want)
    sampling = {"do_sample": True, "top_k": 10, "top_p": 0.9, "temperature": 0.7, "repetition_penalty": 1.3}
    torch.manual_seed(3)
    want = model.generate(ids, attention_mask=mask, min_new_tokens=2, **sampling, **options)
    torch.manual_seed(3)
    seeded = torch.get_rng_state()
    got = module.generate(ids, mask, num_groups=groups, min_new_tokens=2, **sampling, **options)
    if groups == 1:  # one group draws as `transformers` does, row after row of the whole batch per step
        assert torch.equal(got, want)
    assert torch.equal(torch.get_rng_state(), seeded)  # it drew from a copy: the process's stream is as it was


def test_a_mask_is_inferred_as_transformers_infers_it(llama):
    module, model = llama
    ids, _ = prompts(4)
    options = {"max_new_tokens": 3, "pad_token_id": PAD, "eos_token_id": list(EOS)}
    assert torch.equal(module.generate(ids, **options), model.generate(ids, **options))


@pytest.mark.parametrize(
    ("options", "refusal"),
    [
        ({"num_beams": 4}, "asks for beam search, which is not supported"),
        ({"assistant_model": object()}, "asks for assisted decoding"),
        ({"num_return_sequences": 2}, "repeat the prompts instead"),
        ({"no_repeat_ngram_size": 2}, r"`generate\(no_repeat_ngram_size=...\)` is not supported"),
        ({"streamer": object()}, "asks for streaming"),
        ({"colour": "blue"}, r"`generate\(colour=...\)` is not supported"),
    ],
)
def test_other_decoding_modes_and_options_are_refused_by_name(llama, options, refusal):
    module, _ = llama
    with pytest.raises(ValueError, match=refusal):
        module.generate(torch.ones(1, 2, dtype=torch.long), max_new_tokens=2, **options)
    with pytest.raises(ValueError, match="Under BFPPStrategy `generate` decodes greedily"):
        module.generate(torch.ones(1, 2, dtype=torch.long), max_new_tokens=2, **options)


def test_a_model_generation_config_asking_for_more_is_refused_naming_the_field(llama):
    module, _ = llama
    module.generation_config.no_repeat_ngram_size = 2
    try:
        with pytest.raises(ValueError, match="does not apply `no_repeat_ngram_size=2` \\(set by the call or the model"):
            module.generate(torch.ones(1, 2, dtype=torch.long), max_new_tokens=2)
        module.generation_config.num_beams = 3
        with pytest.raises(ValueError, match="would run beam search here"):
            module.generate(torch.ones(1, 2, dtype=torch.long), max_new_tokens=2)
    finally:
        module.generation_config.no_repeat_ngram_size, module.generation_config.num_beams = None, None
