"""Tiny ``transformers`` models and token data for the Hugging Face adapter's tests (no downloads).

- :func:`tiny_config`: a few-layer random config of each supported family, built from the family's own config
  class, dropout off (so one device and the pipeline draw nothing).
- :func:`hf_module` (``RunSpec.model_factory``): ``HFCausalLM`` or ``HFSequenceRegressor`` from
  ``run.model = {"family": ..., "seed": ..., "tie": ..., "num_labels": ..., "pooling": ..., "pretrained": folder,
  "lora": LoraConfig fields, "freeze": parameter names or prefixes}``.
- :func:`hf_loader` (``RunSpec.loader_factory``) and :func:`hf_reference_run`: the same token data for the
  pipelined run and its one-device reference (``tests.models.reference_run`` builds the regression data of
  ``PipeNet``; this one builds token batches, with the same sampler). ``run.data`` goes to :class:`TokenData`:
  ``{"packed": True}`` gives packed documents with ``position_ids`` and no attention mask.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import AutoConfig, BertConfig, GPT2Config, RobertaConfig

from lightning_bfpp.integrations.huggingface import CAUSAL_LM_FAMILIES, HFCausalLM, HFSequenceRegressor
from tests.models import Reference, RunSpec, fit_on_one_device

VOCAB = 100
SEQ_LEN = 12
# every causal LM family the adapter is tested with
CAUSAL_FAMILIES = CAUSAL_LM_FAMILIES
# what each family's tiny config sets beyond the shared decoder settings: the options that give it its quirks, so
# that a test of the family exercises them (windows shorter than the sequence, multipliers other than 1, …)
FAMILY_SETTINGS: dict[str, dict[str, Any]] = {
    # the layers above the first use a 4-token sliding window: both of Qwen2's mask kinds
    "qwen2": {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
    "mistral": {"sliding_window": 4},  # one window for every layer
    "qwen3": {"head_dim": 8},  # q/k norms over the head dimension
    "gemma": {"head_dim": 8},  # embeddings scaled by sqrt(hidden size)
    # alternating sliding and full layers, attention and final logit soft-capping
    "gemma2": {"head_dim": 8, "sliding_window": 4, "query_pre_attn_scalar": 8},
    # 2 local (sliding, own rotary base) layers per global one, q/k norms
    "gemma3_text": {"head_dim": 8, "sliding_window": 4, "query_pre_attn_scalar": 8, "sliding_window_pattern": 2},
    "phi3": {},  # fused qkv and gate-up projections
    "olmo2": {},  # post-norms, q/k norms
    # every multiplier away from 1
    "granite": {
        "embedding_multiplier": 2.0,
        "logits_scaling": 4.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.2,
    },
    # parallel residual, a quarter of each head rotated (partial rotary)
    "gpt_neox": {"rotary_pct": 0.25, "use_parallel_residual": True, "hidden_dropout": 0.0, "attention_dropout": 0.0},
    "cohere": {"logit_scale": 0.5},  # parallel attention and MLP, logits scaled
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 8},
}
ENCODER_FAMILIES = ("bert", "roberta")


def tiny_config(family: str, *, layers: int = 2, tie: bool = False) -> Any:
    """A random config of ``family`` with hidden size 32, 4 heads and ``layers`` blocks."""
    if family == "gpt2":
        return GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=layers,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
            tie_word_embeddings=tie,
        )
    decoder = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,  # grouped-query attention
        "max_position_embeddings": 64,
        "tie_word_embeddings": tie,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if family in CAUSAL_FAMILIES:
        config = AutoConfig.for_model(family, **decoder, **FAMILY_SETTINGS.get(family, {}))
        if family == "gemma3_text":  # (the config derives the layer kinds from the pattern on creation)
            assert config.layer_types[:2] == ["sliding_attention", "full_attention"]
        return config
    encoder = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "max_position_embeddings": 64,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    }
    if family == "bert":
        return BertConfig(**encoder)
    if family == "roberta":
        return RobertaConfig(**encoder, pad_token_id=1)
    raise ValueError(family)


class SGDCausalLM(HFCausalLM):
    """SGD instead of AdamW: Adam scales each update by the gradient's own size, which hides a wrong 1/m or 1/dp
    and turns rounding noise in near-zero gradients into full-size updates."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trained = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.SGD(trained, lr=self.hparams.lr, momentum=0.9)


class SGDSequenceRegressor(HFSequenceRegressor):
    """See :class:`SGDCausalLM`."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trained = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.SGD(trained, lr=self.hparams.lr, momentum=0.9)


def hf_module(run: RunSpec) -> L.LightningModule:
    """The module ``run.model`` describes; ``"optimizer": "sgd"`` (``run_2x2``'s default) trains with SGD."""
    spec = run.model
    family = spec["family"]
    sgd = spec.get("optimizer") == "sgd"
    torch.manual_seed(spec.get("seed", 0))
    config: Any = tiny_config(family, layers=spec.get("layers", 2), tie=spec.get("tie", False))
    if "pretrained" in spec:  # a `save_pretrained` folder: built on meta, each rank reading its own stages
        config = spec["pretrained"]
    if family in CAUSAL_FAMILIES:
        cls = SGDCausalLM if sgd else HFCausalLM
        module = cls(config, lr=spec.get("lr", 0.05 if sgd else 1e-3), lora=spec.get("lora"), dtype=spec.get("dtype"))
        # frozen by hand: whole layers or single weights, by this module's parameter names
        for name, param in module.named_parameters():
            if any(name == f or name.startswith(f + ".") for f in spec.get("freeze", ())):
                param.requires_grad_(False)
        return module
    lr = spec.get("lr", 0.001)  # MSE on a random target: a larger step diverges
    regressor = SGDSequenceRegressor if sgd else HFSequenceRegressor
    return regressor(config, num_labels=spec.get("num_labels"), pooling=spec.get("pooling", "mean"), lr=lr)


def packed_positions(lengths: list[int]) -> torch.Tensor:
    """The ``position_ids`` of documents of ``lengths`` packed into one row: from 0 again at each document."""
    return torch.cat([torch.arange(n) for n in lengths])


def packed_labels(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """``DataCollatorWithFlattening``'s labels: the ids, ``-100`` at each document's first token."""
    return input_ids.masked_fill(position_ids == 0, -100)


class TokenData(Dataset):
    """Random token sequences with padding, the same on every process.

    Causal LMs: every sample has the same number of label tokens (9 of 12, left or right padded), so every
    micro-batch holds as many and its mean loss composes into the one-device token mean.
    ``packed=True`` (causal LMs): no padding and no attention mask; each row holds three documents of random
    lengths, with ``position_ids`` restarting at each and labels ``-100`` at each one's first token, as
    ``transformers.DataCollatorWithFlattening`` makes them (9 label tokens per row after the shift, too).
    Encoders: padding of varying length, and a regression target (or class) per sample.
    """

    def __init__(
        self, family: str, num_samples: int = 64, seed: int = 1, num_labels: int | None = None, packed: bool = False
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(3, VOCAB, (num_samples, SEQ_LEN), generator=g)
        self.attention_mask = torch.ones(num_samples, SEQ_LEN, dtype=torch.long)
        causal = family in CAUSAL_FAMILIES
        if packed and not causal:
            raise ValueError("packed documents are a causal LM's batches")
        self.position_ids: torch.Tensor | None = None
        if packed:  # lengths a + 1, b - a + 1 and 10 - b (a < b drawn from 0 … 8): at least 1, 2 and 2 tokens
            rows = []
            for _ in range(num_samples):
                a, b = sorted(torch.randperm(SEQ_LEN - 3, generator=g)[:2].tolist())
                rows.append(packed_positions([a + 1, b - a + 1, SEQ_LEN - b - 2]))
            self.position_ids = torch.stack(rows)
        for i in range(num_samples if not packed else 0):
            if causal and i % 2:  # left padding on odd samples: labels at positions 3 … 11
                self.attention_mask[i, :3] = 0
            elif causal:  # right padding: labels at 1 … 9 (the shift drops position 0's), 9 as well
                self.attention_mask[i, SEQ_LEN - 2 :] = 0
            else:
                pad = int(torch.randint(0, SEQ_LEN // 2, (), generator=g))
                self.attention_mask[i, SEQ_LEN - pad :] = 0
        self.input_ids[self.attention_mask == 0] = 0
        if num_labels is None:
            self.labels: torch.Tensor = torch.randn(num_samples, generator=g)
        else:
            self.labels = torch.randint(0, num_labels, (num_samples,), generator=g)
        self.causal = causal

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self.position_ids is not None:
            positions = self.position_ids[i]
            ids = self.input_ids[i]
            return {"input_ids": ids, "position_ids": positions, "labels": packed_labels(ids, positions)}
        item = {"input_ids": self.input_ids[i], "attention_mask": self.attention_mask[i]}
        if not self.causal:
            item["labels"] = self.labels[i]
        return item


def token_data(run: RunSpec) -> TokenData:
    return TokenData(run.model["family"], num_labels=run.model.get("num_labels"), **run.data)


def hf_loader(run: RunSpec, trainer: L.Trainer) -> DataLoader:
    return DataLoader(token_data(run), batch_size=run.local_batch_size)


def hf_reference_run(run: RunSpec) -> Reference:
    """``run`` trained on one process with ``strategy="auto"`` on the global batches (see ``reference_run``)."""
    if "empty_init" in run.checks:  # on the meta device, materialized as the strategy's ranks do (from the seed)
        with torch.device("meta"):
            model = hf_module(run)
        model.materialize()
    else:
        model = hf_module(run)
    return fit_on_one_device(model, token_data(run), run)


def assert_trained_as_reference(result: Any, ref: Reference, run: RunSpec, *, tol: float, atol: float) -> None:
    """A pipelined run's losses (every rank, every step) and final weights equal the one-device run's (relative
    ``tol``, plus ``atol`` for weights whose gradients are rounding noise), and the weights moved by at least
    30 times the tolerance at the median, so that agreeing is not trivial."""
    from tests.distributed.harness import assert_steps_match

    assert len(ref.steps) == 6
    assert_steps_match(result, ref, tol=tol)
    assert set(result.params) == set(ref.params)
    for name, want in ref.params.items():
        error = (result.params[name].double() - want.double()).norm().item()
        assert error <= tol * want.double().norm().item() + atol, f"{name}: {error:.2e}"
    module = hf_module(run)
    module.materialize()  # a pretrained folder's weights (a no-op for a model built in memory)
    initial = dict(module.named_parameters(remove_duplicate=False))
    moved = [(ref.params[k] - initial[k].detach()).norm() / initial[k].detach().norm() for k in ref.params]
    assert sorted(moved)[len(moved) // 2] > 30 * tol
