"""Hugging Face ``transformers`` models as pipelines of layers, ready for :class:`~lightning_bfpp.BFPPStrategy`.

The strategy needs a LightningModule whose ``pipeline_layers()`` compose to ``forward`` and pass only tensors
between each other. A ``transformers`` model is one ``forward`` that builds attention masks and rotary tables
once and hands them, with a cache, to every block; this module cuts it into layers that each rebuild what
they need from a few small tensors:

- **embeddings** — ``(input_ids, attention_mask=None, position_ids=None, token_type_ids=None)`` (of the causal
  LMs only GPT-2 takes token types; encoders: ``(input_ids, attention_mask, token_type_ids, position_ids)``)
  to ``(hidden_states, attention_mask, position_ids)`` (encoders: ``(hidden_states, attention_mask)``). A
  missing ``position_ids`` becomes ``arange(seq_len)[None]``, as the model's own forward does. Only tensors
  enter the pipeline and cross stages, yet a causal LM's mask must stay "none" when the batch has none:
  ``transformers`` separates packed documents (``position_ids`` restarting at 0, as
  ``DataCollatorWithFlattening`` makes them) only when no 2-D mask is given. So a missing mask travels as one
  column of ones, which the blocks read as none;
- **one layer per transformer block** — builds the 4-D mask from the 2-D one (and ``position_ids``) with
  ``transformers``' own mask functions (so the configured attention implementation decides its form) and, for
  rotary models, the ``(cos, sin)`` table from ``position_ids`` with its own copy of the model's rotary
  embedding, then calls the model's real block (``LlamaDecoderLayer``, ``Gemma2DecoderLayer``, ``GPT2Block``,
  ``BertLayer``, …) with its weights, without a cache;
- **head** — final norm and LM head (logits), or for encoders a pooling and a linear head.

The composition equals the model's own forward without a cache (``model(**batch, use_cache=False)``, what
``transformers``' Trainer runs: with a cache, ``transformers`` does not separate packed documents).

Causal LMs: any ``*ForCausalLM`` with an embedding, one ``ModuleList`` of decoder layers, a final norm and a
rotary embedding (:func:`decoder_parts`: from ``config.base_model_pp_plan``, or inferred), plus GPT-2. The
families in :data:`CAUSAL_LM_FAMILIES` are tested; another is checked against its own forward when built
(:func:`check_composition`). What this module does for particular families is :data:`FAMILY_CODE`. Encoders:
``BertModel`` (e.g. ``sentence-transformers/all-MiniLM-L6-v2``) and ``RobertaModel``. Tied input/output
embeddings stay tied: the head's weight is the embedding layer's ``Parameter``. LoRA adapters (``lora=``, or a
``peft`` model) train with the rest of the model frozen.

Models created on the meta device (``trainer.init_module(empty_init=True)``) come out right when the
strategy materializes each rank's layers: every ``transformers`` submodule that holds tensors gets a
``reset_parameters()`` that runs the model's own ``_init_weights`` (weights as ``from_config`` draws them,
and non-persistent buffers such as rotary ``inv_freq`` and BERT's ``position_ids`` recomputed).

:func:`export_pretrained` writes a trained module (or a checkpoint of one) back as a ``save_pretrained``
folder.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import math
import os
import warnings
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

try:
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel
    from transformers.masking_utils import (
        create_bidirectional_mask,
        create_causal_mask,
        create_chunked_causal_mask,
        create_sliding_window_causal_mask,
    )
    from transformers.models.bert.modeling_bert import BertModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2LMHeadModel
    from transformers.models.roberta.modeling_roberta import RobertaModel
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "lightning_bfpp.integrations.huggingface needs `transformers` (>= 5.24): "
        'pip install "lightning-bfpp[huggingface]"'
    ) from error

from lightning_bfpp.adapter import _lightning_compat
from lightning_bfpp.engine import _compat
from lightning_bfpp.engine.checkpoint import MODEL_KEY, TIED_KEY, load_metadata, reader, torch_load
from lightning_bfpp.engine.loss import mean_over_items
from lightning_bfpp.engine.pretrained import PretrainedWeights, PretrainedWeightsError, write_safetensors
from lightning_bfpp.engine.tensor_regions import SumGradient, SumOutputs

__all__ = [
    "CAUSAL_LM_FAMILIES",
    "ENCODER_CLASSES",
    "FAMILY_CODE",
    "DecoderParts",
    "HFCausalLM",
    "HFSequenceRegressor",
    "causal_lm_layers",
    "check_composition",
    "decoder_parts",
    "encoder_layers",
    "export_pretrained",
]

ENCODER_CLASSES: tuple[type[PreTrainedModel], ...] = (BertModel, RobertaModel)
POOLINGS = ("mean", "cls", "pooler", "none")


def _names(classes: tuple[type, ...]) -> str:
    return ", ".join(f"`{c.__name__}`" for c in classes)


# -- pipeline layers --------------------------------------------------------------------------------------


class CausalEmbedding(nn.Module):
    """First layer of a causal LM: token embeddings, then what the family's forward adds before the first block
    (GPT-2's learned positions and token types, Granite's ``embedding_multiplier``, an embedding dropout).

    Returns ``(hidden_states, attention_mask, position_ids)``, everything the blocks need to rebuild their
    masks and rotary tables on whichever rank they run; without a mask, the one-column stand-in of
    :func:`_no_attention_mask`. ``embeds_token_types``: ``token_type_ids`` are embedded with the token
    embedding and added, as ``GPT2Model`` does; models without it refuse them.
    """

    def __init__(
        self,
        embed_tokens: nn.Module,
        embed_positions: nn.Embedding | None = None,
        dropout: nn.Module | None = None,
        *,
        embeds_token_types: bool = False,
        multiplier: float | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.embed_positions = embed_positions
        self.dropout = dropout
        self.embeds_token_types = embeds_token_types
        self.multiplier = multiplier

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if token_type_ids is not None and not self.embeds_token_types:
            raise ValueError("This model's forward takes no `token_type_ids` (only GPT-2's of the supported ones).")
        if position_ids is None:  # what the models' own forward uses without a cache
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        hidden = self.embed_tokens(input_ids)
        if self.embed_positions is not None:
            hidden = hidden + self.embed_positions(position_ids)
        if token_type_ids is not None:
            hidden = hidden + self.embed_tokens(token_type_ids)
        if self.multiplier is not None:
            hidden = hidden * self.multiplier
        if self.dropout is not None:
            hidden = self.dropout(hidden)
        return hidden, _mask_to_send(attention_mask, input_ids), position_ids


def _no_attention_mask(input_ids: torch.Tensor) -> torch.Tensor:
    """What stands for "no attention mask" where only tensors may go (the pipeline's input, between stages): one
    column of ones, read back as None by :func:`_mask_received`.

    ``transformers`` treats a missing mask like an all-ones one, except that only without a mask does it read
    packed documents from ``position_ids``, so "none" needs a tensor form of its own.
    """
    return input_ids.new_ones(input_ids.shape[0], 1)


def _mask_to_send(attention_mask: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor:
    """The 2-D mask as it travels between stages: the given one, or :func:`_no_attention_mask`."""
    if attention_mask is None:
        return _no_attention_mask(input_ids)
    if attention_mask.dim() != 2 or attention_mask.shape[1] not in (1, input_ids.shape[1]):
        raise ValueError(
            f"`attention_mask` must be 2-D with one column per token: got shape {tuple(attention_mask.shape)} for"
            f" `input_ids` of shape {tuple(input_ids.shape)} (a cache or prefix is not supported)."
        )
    return attention_mask


def _mask_received(attention_mask: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor | None:
    """The mask :func:`_mask_to_send` sent, None for :func:`_no_attention_mask` (a one-token batch's stand-in is
    its all-ones mask, which means the same for a single token)."""
    return attention_mask if attention_mask.shape[1] == hidden.shape[1] else None


def _causal_mask(
    config: PreTrainedConfig,
    hidden: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    sliding: bool,
) -> Any:
    """The 4-D (or implementation-specific, or ``None``) mask the model's forward builds without a cache."""
    make_mask = create_sliding_window_causal_mask if sliding else create_causal_mask
    return make_mask(
        config=config,
        inputs_embeds=hidden,
        attention_mask=_mask_received(attention_mask, hidden),
        cache=None,
        position_ids=position_ids,
    )


# -- the parts of a decoder ------------------------------------------------------------------------------

# The causal LM families whose composed layers are tested against the model's own logits (with padding and with
# packed documents), trained under the pipeline against one device, and exported back (see docs/huggingface.md).
# Another family with the same structure is taken after the check of :func:`check_composition`.
CAUSAL_LM_FAMILIES: tuple[str, ...] = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "olmo2",
    "granite",
    "gpt_neox",
    "gpt2",
    "cohere",
    "mixtral",
    "qwen3_moe",
)

# The code this adapter has for particular families: the steps of their forward that live in the forward
# function rather than in a module, so that no pipeline plan or module tree reveals them. Everything else is the
# model's own modules (decoder layers, rotary embeddings, norms) and ``transformers``' own mask functions.
FAMILY_CODE: dict[str, str] = {
    "gpt2": "learned positions and token types are added in `GPT2Model.forward`, and `GPT2Config` declares no"
    " pipeline plan: its own embedding (`CausalEmbedding` with `wpe`) and block (`GPT2DecoderBlock`) layers",
    "granite": "`inputs_embeds * config.embedding_multiplier` in the base forward and `logits /"
    " config.logits_scaling` in the LM's forward",
    "gemma2, gemma3_text": "`config.final_logit_softcapping` (tanh soft-capping of the logits) in the LM's forward",
    "cohere": "`logits * config.logit_scale` in the LM's forward",
    "starcoder2": "dropout of `config.embedding_dropout` after the embedding, in the base forward",
}
_LOGIT_SCALED = ("cohere", "cohere2")
_MASKS: dict[str, Any] = {
    "full_attention": create_causal_mask,
    "sliding_attention": create_sliding_window_causal_mask,
    "chunked_attention": create_chunked_causal_mask,
}


def _layer_type(config: PreTrainedConfig, layer_idx: int) -> str:
    """The attention kind the model's forward gives layer ``layer_idx`` (which mask it builds for it)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        kind = layer_types[layer_idx]
    else:
        kind = "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
    if kind not in _MASKS:
        raise ValueError(
            f"Layer {layer_idx} of this `{config.model_type}` model is a `{kind}` layer; the Hugging Face adapter"
            f" pipelines attention layers only ({sorted(_MASKS)}), whose state is the hidden states alone."
        )
    return kind


@dataclasses.dataclass
class DecoderParts:
    """The modules a causal LM's forward runs, in order: embedding (and an optional dropout), decoder layers, final
    norm, LM head, and the rotary embedding each layer's position table comes from."""

    embed_tokens: nn.Module
    embed_dropout: nn.Module | None
    layers: list[nn.Module]
    norm: nn.Module
    lm_head: nn.Module
    rotary_emb: nn.Module


def _missing(model: PreTrainedModel, part: str, where: str) -> ValueError:
    return ValueError(
        f"lightning_bfpp's Hugging Face adapter could not find {part} in `{type(model).__name__}` ({where}). It"
        " pipelines causal LMs whose base model is an embedding, one `ModuleList` of decoder layers, a final norm"
        " and a rotary embedding, with an LM head. Write `pipeline_layers()` for this architecture yourself."
    )


def decoder_parts(model: PreTrainedModel) -> DecoderParts:
    """A ``*ForCausalLM``'s parts, read from its pipeline plan (``config.base_model_pp_plan``: the modules before the
    one ``ModuleList`` of layers run on the first stage, those after it on the last) or, where the config declares
    none, from its base model's children (the input embeddings, the one ``ModuleList``, and the module with
    weights after it). ``rotary_emb`` is in no plan: the base model's, copied onto every stage.

    Refused, naming what was not found or why: a model without an LM head (a base model), more or fewer than one
    ``ModuleList``, a position scheme computed in the forward (no ``rotary_emb``), non-attention layers (state-space
    or linear-attention hybrids), Gemma 3's bidirectional mode, and the load-balancing loss of mixture-of-experts
    models (``output_router_logits=True``): it is a product of means over all layers' router outputs, which live on
    different stages, so it does not split into per-stage terms.
    """
    config = model.config
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if base is None or base is model or lm_head is None:
        raise TypeError(
            f"`{type(model).__name__}` is not a causal LM with an LM head over a base model. Load one with"
            " `AutoModelForCausalLM` (a base model such as `LlamaModel` has no LM head)."
        )
    plan = getattr(config, "base_model_pp_plan", None)
    children = dict(base.named_children())
    if plan:
        names = list(plan)
        missing = [n for n in names if n not in children]
        if missing:
            raise _missing(model, f"`{missing[0]}`", "named in `config.base_model_pp_plan`")
        lists = [n for n in names if isinstance(children[n], nn.ModuleList)]
        where = "in `config.base_model_pp_plan`"
    else:
        names = list(children)
        lists = [n for n in names if isinstance(children[n], nn.ModuleList)]
        where = "among the base model's children; its config declares no `base_model_pp_plan`"
    if len(lists) != 1:
        raise _missing(model, f"one `ModuleList` of decoder layers (found {lists or 'none'})", where)
    i = names.index(lists[0])
    if plan:
        before, after = [children[n] for n in names[:i]], [children[n] for n in names[i + 1 :]]
    else:
        embedding = base.get_input_embeddings()
        before = [embedding] if embedding is not None else []
        after = [children[n] for n in names[i + 1 :] if any(True for _ in children[n].parameters())]
        after = [m for m in after if m is not getattr(base, "rotary_emb", None)]
    if not before:
        raise _missing(model, "the token embedding", where)
    if len(before) > 2 or (len(before) == 2 and not isinstance(before[1], nn.Dropout)):
        raise _missing(model, "an embedding followed by at most a dropout", where)
    if len(after) != 1:
        raise _missing(model, f"one final norm after the layers (found {len(after)} modules)", where)
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None:
        raise _missing(model, "a rotary embedding (`rotary_emb`)", "its positions are computed in its forward")
    if getattr(config, "output_router_logits", False):
        raise ValueError(
            f"`{type(model).__name__}` is configured with `output_router_logits=True`: its load-balancing loss is a"
            " product of means over every layer's router outputs, which live on different pipeline stages, so it"
            " cannot be computed stage by stage. Set `config.output_router_logits = False` (the experts and router"
            " still train through the language-model loss)."
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("Bidirectional attention (`use_bidirectional_attention=True`) is not supported.")
    dropout = before[1] if len(before) == 2 else None
    if dropout is None and config.model_type == "starcoder2" and config.embedding_dropout:
        dropout = nn.Dropout(config.embedding_dropout)
    layers = list(children[lists[0]])[: config.num_hidden_layers]
    for i in range(len(layers)):
        _layer_type(config, i)
    return DecoderParts(before[0], dropout, layers, after[0], lm_head, rotary)


def check_composition(model: PreTrainedModel, layers: list[nn.Module], *, atol: float = 1e-4) -> None:
    """Refuse ``layers`` unless they compose to ``model``'s own logits on a small padded batch and on a packed one.

    Run on families outside :data:`CAUSAL_LM_FAMILIES`: a forward step that lives in the family's code rather
    than in its modules would otherwise train a different model without a word. Dropout is off during the check.
    """
    vocab = model.config.vocab_size
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(min(3, vocab - 1), vocab, (2, 6), generator=g).to(device)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    positions = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]], device=device)
    modes = [m.training for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            for kwargs in ({"attention_mask": mask}, {"position_ids": positions}):
                want = model(input_ids=ids, use_cache=False, **kwargs).logits
                try:
                    x = layers[0](ids, kwargs.get("attention_mask"), kwargs.get("position_ids"))
                    for layer in layers[1:]:
                        x = layer(x)
                except Exception as error:
                    raise ValueError(
                        f"The pipeline layers of this `{model.config.model_type}` model fail where its own forward"
                        f" runs ({type(error).__name__}: {error}): its layers take something the generic decoder path"
                        " does not give them. Write `pipeline_layers()` for this architecture yourself. Tested"
                        f" families: {', '.join(CAUSAL_LM_FAMILIES)}."
                    ) from error
                error = (x - want).abs().max().item()
                if not error <= atol * max(1.0, want.abs().max().item()):
                    raise ValueError(
                        f"The pipeline layers of this `{model.config.model_type}` model do not reproduce its logits"
                        f" (largest difference {error:.2e} with {sorted(kwargs)}): its forward does something the"
                        " generic decoder path does not know. Write `pipeline_layers()` for this architecture"
                        f" yourself. Tested families: {', '.join(CAUSAL_LM_FAMILIES)}."
                    )
    finally:
        for m, training in zip(model.modules(), modes, strict=True):
            m.training = training


class GPT2DecoderBlock(nn.Module):
    """One ``GPT2Block``, with the causal mask built from the 2-D attention mask as ``GPT2Model`` builds it."""

    def __init__(self, block: nn.Module, config: PreTrainedConfig) -> None:
        super().__init__()
        self.block = block
        self.config = config

    def forward(
        self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden, attention_mask, position_ids = inputs
        mask = _causal_mask(self.config, hidden, attention_mask, position_ids, sliding=False)
        hidden = self.block(hidden, attention_mask=mask, use_cache=False, position_ids=position_ids)
        return hidden, attention_mask, position_ids


class DecoderBlock(nn.Module):
    """One decoder layer of a rotary-position model (Llama, Mistral, Qwen, Gemma, Phi-3, OLMo 2, GPT-NeoX, …),
    called as the model's own forward calls it, with its own copy of the model's rotary embedding.

    The ``(cos, sin)`` table is computed here from ``position_ids`` rather than sent between stages (it is larger
    than the hidden states' last dimension times two, and cheap to recompute); the mask is the one the model's
    forward gives this layer: by ``config.layer_types`` where the config has them (full, sliding-window or chunked
    attention; Gemma 3's rotary table differs by layer type too), else sliding-window for every layer when
    ``config.sliding_window`` is set (Mistral, Phi-3, Starcoder2, Mixtral), else full causal.
    """

    def __init__(self, layer: nn.Module, rotary_emb: nn.Module, config: PreTrainedConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer = layer
        self.rotary_emb = rotary_emb
        self.config = config
        self.layer_type = _layer_type(config, layer_idx)
        self.rotary_by_type = "layer_type" in inspect.signature(rotary_emb.forward).parameters

    def forward(
        self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden, attention_mask, position_ids = inputs
        mask = _MASKS[self.layer_type](
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=_mask_received(attention_mask, hidden),
            cache=None,
            position_ids=position_ids,
        )
        if self.rotary_by_type:
            position_embeddings = self.rotary_emb(hidden, position_ids, self.layer_type)
        else:
            position_embeddings = self.rotary_emb(hidden, position_ids)
        out = self.layer(
            hidden,
            attention_mask=mask,
            position_embeddings=position_embeddings,
            position_ids=position_ids,
            use_cache=False,
        )
        hidden = out[0] if isinstance(out, tuple) else out
        return hidden, attention_mask, position_ids


class CausalLMHead(nn.Module):
    """Last layer of a causal LM: the final norm and the LM head, returning logits, then what the family's forward
    does to the logits (Gemma 2/3's ``final_logit_softcapping``, Granite's ``logits_scaling``, Cohere's
    ``logit_scale``; see :data:`FAMILY_CODE`)."""

    def __init__(
        self,
        norm: nn.Module,
        lm_head: nn.Linear,
        *,
        softcap: float | None = None,
        logits_divisor: float | None = None,
        logits_multiplier: float | None = None,
    ) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.softcap = softcap
        self.logits_divisor = logits_divisor
        self.logits_multiplier = logits_multiplier

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        logits = self.lm_head(self.norm(inputs[0]))
        if self.logits_multiplier is not None:
            logits = logits * self.logits_multiplier
        if self.logits_divisor is not None:
            logits = logits / self.logits_divisor
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class EncoderEmbedding(nn.Module):
    """First layer of a BERT-family encoder: the model's embeddings module (words, positions, token types).

    A missing mask becomes all ones (an encoder's bidirectional mask reads nothing else), missing token types and
    positions the embeddings' own defaults (RoBERTa's positions count from its padding index, skipping padding).
    """

    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids)
        return hidden, attention_mask


class EncoderBlock(nn.Module):
    """One ``BertLayer``/``RobertaLayer``, with the bidirectional mask built as the model's forward builds it."""

    def __init__(self, layer: nn.Module, config: PreTrainedConfig) -> None:
        super().__init__()
        self.layer = layer
        self.config = config

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, attention_mask = inputs
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask)
        hidden = self.layer(hidden, mask)
        return hidden, attention_mask


class PoolingHead(nn.Module):
    """Last layer of an encoder pipeline: pool the hidden states, then a linear head.

    ``pooling``: ``"mean"`` over unmasked tokens (sentence-transformers' pooling), ``"cls"`` (first token),
    ``"pooler"`` (the model's own pooler, tanh of a dense layer on the first token), or ``"none"`` for one
    output per token (word-level tasks). The model's pooler, when it has one, lives here whatever the pooling,
    so that every parameter has a layer and :func:`export_pretrained` writes the model back whole.
    """

    def __init__(self, hidden_size: int, num_outputs: int, pooling: str = "mean", pooler: nn.Module | None = None):
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"`pooling` must be one of {POOLINGS}; got {pooling!r}.")
        if pooling == "pooler" and pooler is None:
            raise ValueError('`pooling="pooler"` needs a model with a pooler (created with `add_pooling_layer=True`).')
        self.pooling = pooling
        self.pooler = pooler
        self.classifier = nn.Linear(hidden_size, num_outputs)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        hidden, attention_mask = inputs
        if self.pooling == "mean":
            weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        elif self.pooling == "cls":
            pooled = hidden[:, 0]
        elif self.pooling == "pooler":
            assert self.pooler is not None
            pooled = self.pooler(hidden)
        else:
            pooled = hidden
        return self.classifier(pooled)


def causal_lm_layers(model: PreTrainedModel) -> list[nn.Module]:
    """The pipeline layers of a causal LM, sharing its modules: an embedding layer, one layer per decoder block
    and a head (see :func:`decoder_parts` for which models are taken).

    Their composition is the model's ``forward(input_ids, attention_mask, position_ids, token_type_ids).logits``
    without a cache (only GPT-2 takes ``token_type_ids``). The model object itself is not needed afterwards (its
    modules now belong to the layers).
    """
    config = model.config
    if isinstance(model, GPT2LMHeadModel):
        if config.add_cross_attention:
            raise ValueError("GPT-2 with cross-attention (`add_cross_attention=True`) is not supported.")
        t = model.transformer
        blocks: list[nn.Module] = [GPT2DecoderBlock(block, config) for block in t.h]
        embed = CausalEmbedding(t.wte, t.wpe, t.drop, embeds_token_types=True)
        return [embed, *blocks, CausalLMHead(t.ln_f, model.lm_head)]
    parts = decoder_parts(model)
    rotary = parts.rotary_emb
    blocks = [
        # each block its own rotary embedding: no buffer is shared between stages
        DecoderBlock(layer, rotary if i == 0 else copy.deepcopy(rotary, {id(config): config}), config, i)
        for i, layer in enumerate(parts.layers)
    ]
    embed = CausalEmbedding(
        parts.embed_tokens, dropout=parts.embed_dropout, multiplier=getattr(config, "embedding_multiplier", None)
    )
    head = CausalLMHead(
        parts.norm,
        parts.lm_head,
        softcap=getattr(config, "final_logit_softcapping", None),
        logits_divisor=getattr(config, "logits_scaling", None),
        logits_multiplier=getattr(config, "logit_scale", None) if config.model_type in _LOGIT_SCALED else None,
    )
    layers = [embed, *blocks, head]
    if config.model_type not in CAUSAL_LM_FAMILIES:
        if next(model.parameters()).device.type == "meta":
            warnings.warn(
                f"`{config.model_type}` is not among the tested families ({', '.join(CAUSAL_LM_FAMILIES)}) and its"
                " weights are on the meta device, so its pipeline layers could not be checked against its own"
                " forward. Build the module once with real weights to have them checked.",
                UserWarning,
                stacklevel=2,
            )
        else:
            check_composition(model, layers)
    return layers


def encoder_layers(model: PreTrainedModel) -> list[nn.Module]:
    """The embedding and block layers of a supported encoder (see :data:`ENCODER_CLASSES`), sharing its modules.

    Their composition gives ``(last_hidden_state, attention_mask)`` from ``(input_ids, attention_mask,
    token_type_ids, position_ids)``; a head (e.g. :class:`PoolingHead`) follows.
    """
    if not isinstance(model, ENCODER_CLASSES):
        raise TypeError(
            f"lightning_bfpp's Hugging Face adapter pipelines the encoders {_names(ENCODER_CLASSES)}; got"
            f" `{type(model).__name__}`. Load the base model with `AutoModel` (for a task model such as"
            " `BertForSequenceClassification`, pass its `.bert`)."
        )
    config = model.config
    if config.is_decoder or config.add_cross_attention:
        raise ValueError("Encoders configured as decoders (`is_decoder` / `add_cross_attention`) are not supported.")
    blocks: list[nn.Module] = [EncoderBlock(layer, config) for layer in model.encoder.layer]
    return [EncoderEmbedding(model.embeddings), *blocks]


# -- initialization of meta-device layers -----------------------------------------------------------------


class _HFReset:
    """``reset_parameters()`` for a ``transformers`` submodule: the model's own ``_init_weights``.

    The strategy materializes a meta-device layer by calling ``reset_parameters()`` on each submodule that
    holds tensors; ``transformers`` modules have none (norms, ``Conv1D``, rotary embeddings, BERT's
    embeddings) or torch's (not the model's init). ``chain`` is the submodule and its ancestors inside the
    pipeline layer, nearest first, as ``transformers`` initializes children before parents (GPT-2's
    attention rescales its ``c_proj`` after the projection's own init). The model class and config are kept,
    not the model, so a layer never holds other layers' modules; and the chain by weak reference, since each of its
    modules holds this object (a cycle would keep a dropped layer's tensors until the garbage collector ran).
    """

    def __init__(self, model_class: type[PreTrainedModel], config: PreTrainedConfig, chain: list[nn.Module]) -> None:
        self.model_class = model_class
        self.config = config
        self.chain = [weakref.ref(module) for module in chain]

    def __call__(self) -> None:
        chain = [module for ref in self.chain if (module := ref()) is not None]
        _compat.init_weights_as_model(self.model_class, self.config, chain)

    def __deepcopy__(self, memo: dict[int, Any]) -> _HFReset:
        """A copied layer's resets initialize the copy's modules (a weak reference alone would be shared)."""
        copied = _HFReset.__new__(_HFReset)
        copied.model_class, copied.config = self.model_class, self.config
        copied.chain = [weakref.ref(copy.deepcopy(module, memo)) for ref in self.chain if (module := ref()) is not None]
        return copied


def _install_resets(model: PreTrainedModel, layers: list[nn.Module], hf_modules: set[int]) -> None:
    for layer in layers:
        by_name = dict(layer.named_modules())
        for name, module in by_name.items():
            if id(module) not in hf_modules:
                continue
            if not any(True for _ in (*module.parameters(recurse=False), *module.buffers(recurse=False))):
                continue
            parts = name.split(".")
            ancestors = [by_name[".".join(parts[:i])] for i in range(len(parts), 0, -1)]
            chain = [m for m in ancestors if id(m) in hf_modules]
            module.reset_parameters = _HFReset(type(model), model.config, chain)


# -- LoRA ---------------------------------------------------------------------------------------------------


def _peft() -> Any:
    try:
        import peft
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError('LoRA fine-tuning needs `peft` (>= 0.21): pip install "lightning-bfpp[lora]"') from error
    return peft


def _is_peft_model(source: Any) -> bool:
    return type(source).__module__.startswith("peft.") and hasattr(source, "peft_config")


def _lora_config(lora: Any) -> Any:
    """A ``peft.LoraConfig`` from one, or from a dict of its fields (as :func:`_lora_hparams` writes it)."""
    peft = _peft()
    if isinstance(lora, peft.LoraConfig):
        return lora
    if isinstance(lora, Mapping):
        fields = {k: v for k, v in lora.items() if k not in ("peft_type", "task_type")}
        return peft.LoraConfig(**fields)
    raise TypeError(f"`lora` must be a `peft.LoraConfig` or a dict of its fields; got {type(lora).__name__}.")


def _lora_hparams(config: Any) -> dict[str, Any]:
    """A LoRA config as plain values (saved with the checkpoint's hyper-parameters; :func:`_lora_config` reads it)."""
    import enum

    plain: dict[str, Any] = {}
    for key, value in config.to_dict().items():
        if isinstance(value, enum.Enum):
            value = value.value
        elif isinstance(value, (set, frozenset)):
            value = sorted(value)
        plain[key] = value
    return plain


def _check_lora_config(config: Any) -> None:
    """Refuse what a LoRA config asks that the pipeline does not run, whether it comes as ``lora=`` or a model."""
    if config.modules_to_save:
        raise ValueError(
            "LoRA with `modules_to_save` is not supported: unfreeze those modules with `requires_grad_(True)`"
            " instead (they then train and are saved with the model)."
        )


def _unwrap_peft(source: Any) -> tuple[PreTrainedModel, Any, str]:
    """The ``transformers`` model inside a ``PeftModel`` (its LoRA layers in place), its LoRA config and adapter."""
    peft = _peft()
    configs = dict(source.peft_config)
    if len(configs) != 1:
        raise ValueError(f"A `PeftModel` with one adapter is supported; this one has {sorted(configs)}.")
    ((adapter, config),) = configs.items()
    if not isinstance(config, peft.LoraConfig):
        raise ValueError(
            f"Of the `peft` methods, LoRA is supported (its layers are modules of the model, which the pipeline cuts);"
            f" got `{type(config).__name__}`. Prompt and prefix tuning change the inputs of every layer."
        )
    _check_lora_config(config)
    return source.base_model.model, config, adapter


def _apply_lora(model: PreTrainedModel, config: Any, adapter: str) -> None:
    """Add ``config``'s LoRA layers to ``model`` in place (its other weights frozen), as ``get_peft_model`` does."""
    peft = _peft()
    _check_lora_config(config)
    peft.get_peft_model(model, copy.deepcopy(config), adapter_name=adapter)


def _install_lora_resets(layers: list[nn.Module], init_lora_weights: Any) -> None:
    """``reset_parameters()`` for LoRA's A and B matrices: ``peft``'s own init (B zero, so a fresh adapter starts
    as the base model), not the model's or torch's, for layers materialized from the meta device."""
    from peft.tuners.lora import LoraLayer

    for layer in layers:
        for module in layer.modules():
            if isinstance(module, LoraLayer):
                for adapter in module.lora_A:
                    reset = _LoraReset(module, adapter, init_lora_weights)
                    module.lora_A[adapter].reset_parameters = reset
                    module.lora_B[adapter].reset_parameters = reset


class _LoraReset:
    """``peft``'s ``reset_lora_parameters`` of one adapter of one LoRA layer, with the init its config asks for."""

    def __init__(self, module: nn.Module, adapter: str, init_lora_weights: Any) -> None:
        self.module = module
        self.adapter = adapter
        self.init_lora_weights = init_lora_weights

    def __call__(self) -> None:
        with torch.no_grad():
            self.module.reset_lora_parameters(self.adapter, self.init_lora_weights)


# -- LightningModules -------------------------------------------------------------------------------------


def _config_from_dict(values: Mapping[str, Any]) -> PreTrainedConfig:
    values = dict(values)
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise ValueError("A config given as a dict needs its `model_type` (as `config.to_dict()` writes it).")
    return AutoConfig.for_model(model_type, **values)


def _load(
    source: Any, auto_class: Any, attn_implementation: str | None, dtype: torch.dtype | str | None
) -> tuple[PreTrainedModel, Path | None]:
    """A ``transformers`` model from a model, a config (object or dict) or a ``from_pretrained`` name/folder, and,
    for a name or folder, the folder whose safetensors hold its weights.

    A name or folder is built on the meta device, in ``dtype`` (default: the config's, as ``from_pretrained``
    takes it): nothing is allocated or read here. The weights are read where the layers are allocated: under
    ``BFPPStrategy`` each rank reads only its own stages' tensors; elsewhere :meth:`_HFPipelineModule.materialize`
    (called by ``configure_model``) reads them all.
    """
    kwargs: dict[str, Any] = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    if isinstance(source, PreTrainedModel):
        if attn_implementation is not None:
            source.set_attn_implementation(attn_implementation)
        return (source if dtype is None else source.to(_dtype(dtype))), None
    if isinstance(source, Mapping):
        source = _config_from_dict(source)
    if isinstance(source, PreTrainedConfig):
        return auto_class.from_config(source, **kwargs, **({} if dtype is None else {"dtype": _dtype(dtype)})), None
    if isinstance(source, (str, os.PathLike)):
        folder = _local_folder(source)
        config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            model = auto_class.from_config(config, dtype=_dtype(dtype or config.dtype or torch.float32), **kwargs)
        # `from_pretrained` returns the model in eval mode, and Lightning keeps each submodule's mode: fine-tune
        # with the dropout the config asks for
        return model.train(), folder
    raise TypeError(
        "Pass a `transformers` model, its config (object or `config.to_dict()`), or a name or folder for"
        f" `from_pretrained`; got {type(source).__name__}."
    )


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.bfloat16`` from itself or from ``"bfloat16"`` / ``"torch.bfloat16"`` (a config's or a YAML's)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"`dtype` must be a torch floating dtype (e.g. torch.bfloat16 or 'bfloat16'); got {dtype!r}.")
    return value


def _local_folder(source: str | os.PathLike[str]) -> Path:
    """The folder of a ``from_pretrained`` name: itself if it is one, else its files in the Hugging Face cache (the
    config and the safetensors only; downloaded unless offline)."""
    path = Path(source)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(os.fspath(source), allow_patterns=["*.json", "*.safetensors"]))


def _needs_conversion(model: PreTrainedModel, folder: Path) -> bool:
    """Whether ``folder`` stores tensors that ``transformers`` converts, several into one, as it loads ``model``
    (what a per-stage read cannot do): its stored names (the index, or the files' headers) against the model's
    conversion mapping."""
    from transformers.core_model_loading import rename_source_key

    renamings, converters, prefix, names = _weight_transforms(model)
    if not converters:
        return False
    try:
        stored = PretrainedWeights(folder).stored_names()
    except PretrainedWeightsError:
        return False  # reported, naming the folder, when the weights are read
    return any(rename_source_key(key, renamings, converters, prefix, names)[1] is not None for key in stored)


def _weight_transforms(model: PreTrainedModel) -> tuple[list[Any], list[Any], str, dict[str, Any]]:
    """What ``transformers`` renames a checkpoint's keys with as it loads ``model`` (its conversion mapping's
    renamings and conversions, the base model's prefix), and the model's own names (meta tensors: no memory)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    mapping = get_model_conversion_mapping(model)
    names = {name: tensor.to("meta") for name, tensor in model.state_dict().items()}
    return (
        [m for m in mapping if isinstance(m, WeightRenaming)],
        [m for m in mapping if isinstance(m, WeightConverter)],
        getattr(model, "base_model_prefix", "") or "",
        names,
    )


def _save_hyperparameters(module: L.LightningModule, hparams: dict[str, Any]) -> None:
    """``module.save_hyperparameters(hparams)``, given the frame to look at: left to find it, Lightning keeps a
    reference to its own frame, a cycle that holds the caller's locals (the whole ``transformers`` model) until
    the garbage collector runs, and with them the layers another pipeline rank holds."""
    module.save_hyperparameters(hparams, frame=inspect.currentframe())


def _batch_fields(batch: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """A batch as a dict: a mapping as is, a tensor as ``input_ids``, a tuple/list positionally as ``names``."""
    if isinstance(batch, Mapping):
        fields = dict(batch)
    elif isinstance(batch, torch.Tensor):
        fields = {"input_ids": batch}
    elif isinstance(batch, (tuple, list)) and len(batch) <= len(names):
        fields = dict(zip(names, batch, strict=False))
    else:
        raise TypeError(
            f"Expected a batch as a dict (`input_ids`, `attention_mask`, `labels`), a tuple in that order, or a"
            f" tensor of input ids; got {type(batch).__name__}."
        )
    if fields.get("input_ids") is None:
        raise ValueError(f"The batch has no `input_ids` (its fields: {sorted(fields)}).")
    return fields


def _forward_inputs(model: PreTrainedModel) -> tuple[str, ...]:
    """The named inputs of the model's ``forward``: what ``model(**batch)`` takes from a batch by name."""
    parameters = inspect.signature(type(model).forward).parameters.values()
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(p.name for p in parameters if p.name != "self" and p.kind in named)


def _causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``transformers``' ``ForCausalLMLoss`` (labels shifted left, ``-100`` ignored, in fp32) as a sum over the
    label tokens, normalised with :func:`~lightning_bfpp.mean_over_items`: on one device its token mean (0, not
    NaN, without label tokens), under the strategy the mean over the global batch's label tokens."""
    labels = F.pad(labels.to(logits.device), (0, 1), value=-100)[..., 1:]
    loss_sum = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return mean_over_items(loss_sum, (labels != -100).sum())


# `transformers`' tensor-parallel styles this adapter applies, as torch's parallel styles (``transformers``
# registers the same layouts in its ``ALL_PARALLEL_STYLES``)
_TP_STYLES = (
    "colwise", "rowwise", "colwise_gather_output", "colwise_rep", "rowwise_split_input", "rowwise_rep",
    "embedding_rowwise", "embedding_colwise", "replicated_with_grad_allreduce",
)  # fmt: skip


class VocabParallelEmbedding(ParallelStyle):
    """``embedding_rowwise``: an ``nn.Embedding`` split by vocabulary rows over the tensor group, as Megatron-LM's
    ``VocabParallelEmbedding``. Each rank looks up the ids its rows hold (zeros for the others) and the partial
    lookups are summed. Written here rather than taken from torch's ``RowwiseParallel`` on an embedding, whose
    backward hands the weight a gradient replicated over the group: a whole vocabulary × hidden table per rank
    (2 GiB in fp32 for 128K × 4096), where this one's gradient is the rank's rows only. A padding id's row keeps a
    zero gradient on the rank that holds it, as on one device."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor

        plain = isinstance(module, nn.Embedding) and module.max_norm is None and not module.scale_grad_by_freq
        if not plain or module.sparse:
            raise ValueError(
                "BFPPStrategy: `embedding_rowwise` splits a dense `nn.Embedding` without `max_norm` or"
                f" `scale_grad_by_freq`; got"
                f" {module!r}. Pass `parallelize_fn=` with a plan of your own."
            )
        size, rank = device_mesh.size(), device_mesh.get_local_rank()
        if module.num_embeddings % size:  # torch's Shard(0) would give the ranks unequal rows, found at wrong ids
            raise ValueError(
                f"BFPPStrategy: `embedding_rowwise` over {size} tensor ranks needs a vocabulary that {size} divides;"
                f" the embedding has {module.num_embeddings} rows. Pad the vocabulary or choose another tensor size."
            )
        rows = module.num_embeddings // size
        first = rank * rows
        pad = module.padding_idx
        local_pad = pad - first if pad is not None and first <= pad < first + rows else None
        weight = module.weight
        module.weight = nn.Parameter(
            distribute_tensor(weight.detach(), device_mesh, [Shard(0)]), requires_grad=weight.requires_grad
        )
        group = device_mesh.get_group()

        def forward(ids: torch.Tensor) -> torch.Tensor:
            table = module.weight
            local = table.to_local() if isinstance(table, DTensor) else table  # its gradient: this rank's rows
            outside = (ids < first) | (ids >= first + rows)
            found = F.embedding((ids - first).masked_fill(outside, 0), local, local_pad)
            return SumOutputs.apply(found.masked_fill(outside.unsqueeze(-1), 0.0), group)

        module.forward = forward  # type: ignore[method-assign]
        return module


class GradientsSummedOverTensorGroup(ParallelStyle):
    """``replicated_with_grad_allreduce``: a module whole on every tensor rank that sees only the rank's share
    of its input, as Qwen 3's per-head q/k norms see the heads of a column-wise projection. Its forward needs
    no collective, but each rank's gradient covers only its heads: the parameters' gradients are summed over
    the tensor group. The module's forward runs with each parameter passed through an identity whose backward
    all-reduces (``transformers`` does the same with its ``_AllReduceBackward``); whatever holds the parameter
    (FSDP2's unsharded copy during a step) gets the summed gradient and shards it as any other."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        group = device_mesh.get_group()
        forward = module.forward

        def summed_forward(*args: Any, **kwargs: Any) -> Any:
            params = {name: SumGradient.apply(p, group) for name, p in module.named_parameters(recurse=False)}
            with _compat.parameters_replaced(module, params):
                return forward(*args, **kwargs)

        module.forward = summed_forward  # type: ignore[method-assign]
        return module


def _tp_style(kind: str) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    whole = Replicate()
    return {
        "colwise": lambda: ColwiseParallel(),  # output split by heads / units, for the row-wise layer after it
        "rowwise": lambda: RowwiseParallel(),  # partial sums all-reduced
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=whole),  # e.g. the logits, gathered
        "colwise_rep": lambda: ColwiseParallel(output_layouts=whole),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=whole),  # a whole input, split here
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=whole),
        # vocabulary-parallel: each rank looks up the ids in its rows of the table, the partial lookups are summed
        "embedding_rowwise": VocabParallelEmbedding,
        "embedding_colwise": lambda: ColwiseParallel(input_layouts=whole, output_layouts=whole),
        "replicated_with_grad_allreduce": GradientsSummedOverTensorGroup,
    }[kind]()


def tensor_parallel_plan(module: _HFPipelineModule, layer: nn.Module, size: int) -> dict[str, Any]:
    """``layer``'s part of the model's own tensor-parallel plan (``config.base_model_tp_plan`` and the LM class's
    ``_tp_plan``, as :func:`~lightning_bfpp.engine._compat.model_tp_plan` resolves them), as
    ``parallelize_module`` takes it: paths inside the layer mapped to torch's parallel styles.

    Column-wise projections (q, k, v, gate, up) split their outputs, so each tensor rank computes
    ``heads / size`` attention heads (the model's attention reshapes by ``head_dim``, not by the head count) and
    ``intermediate_size / size`` MLP units; row-wise ones (o, down) all-reduce partial sums, so a block's output
    is whole on every tensor rank and crosses to the next stage as a plain tensor. ``colwise_gather_output`` (the
    LM head) gathers the logits; ``embedding_rowwise`` (the token embedding, which ``transformers`` ≥ 5 adds to
    every plan) splits the vocabulary: each rank looks up the ids its rows hold and the lookups are summed.
    Qwen 3's per-head q/k norms (``replicated_with_grad_allreduce``) stay whole with their gradients summed over
    the group (:class:`GradientsSummedOverTensorGroup`). Refused, naming the entry: a style this adapter does not
    apply (packed or expert-parallel layouts, sequence parallelism), a model without a plan, sizes that ``size``
    does not divide.
    """
    config = module.hf_config
    plan = module._tensor_plan
    if not any(k.startswith("model.layers.") for k in plan):
        raise ValueError(
            f"BFPPStrategy(tensor_parallel_size={size}): the `{config.model_type}` model declares no tensor-parallel"
            " plan for its decoder layers (`config.base_model_tp_plan`); pass `parallelize_fn=` to the strategy"
            " with your own `parallelize_module` plan, or train without tensor parallelism."
        )
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = getattr(config, field, None)
        if isinstance(value, int) and value % size:
            raise ValueError(
                f"BFPPStrategy: tensor_parallel_size={size} does not divide the model's `{field}` ({value}): each"
                f" tensor rank would hold a different share. Choose a tensor size that divides {value}."
            )
    if isinstance(layer, DecoderBlock):
        prefix, target = "model.layers.*.", "layer."
    elif isinstance(layer, CausalLMHead):
        prefix, target = "", ""
    elif isinstance(layer, CausalEmbedding):
        prefix, target = "model.", ""
    else:
        raise ValueError(
            f"BFPPStrategy: tensor parallelism from the model's plan covers decoder-only causal LMs with rotary"
            f" positions (`{type(layer).__name__}` layers have no plan here); pass `parallelize_fn=` to the strategy."
        )
    styles = {}
    for key, kind in plan.items():
        if not key.startswith(prefix) or (prefix == "" and key.startswith("model.")):
            continue
        path = target + key[len(prefix) :]
        try:
            layer.get_submodule(path)
        except AttributeError:
            continue  # e.g. the embedding's entry seen from the head
        if kind not in _TP_STYLES:
            raise ValueError(
                f"BFPPStrategy: the `{config.model_type}` model's tensor-parallel plan asks `{kind}` for `{key}`,"
                f" which this adapter does not apply (it applies {', '.join(_TP_STYLES)}); pass `parallelize_fn=`"
                " to the strategy with a plan of your own, or train without tensor parallelism."
            )
        styles[path] = _tp_style(kind)
    return styles


class _HFPipelineModule(L.LightningModule):
    """What both wrappers share: the layers, the optimizer, the names ``transformers`` gives the weights, and
    which batch fields reach ``self(...)``.

    Every field the model's ``forward`` takes and the layers implement reaches them (:attr:`batch_inputs`, in
    ``forward``'s order). A field the model's ``forward`` takes but a pipeline cannot (``inputs_embeds``, a cache,
    cross-attention inputs) is refused. A tensor field that neither the model's ``forward`` nor the loss reads
    (a misspelt name, a dataset's ``idx`` column, the flash-attention ``cu_seq_lens_*`` that
    ``DataCollatorWithFlattening`` can add and that ``position_ids`` already determine) is ignored with a
    ``UserWarning``, once per set of such fields; other values (e.g. lists of strings) are ignored.
    """

    embed: nn.Module
    blocks: nn.ModuleList
    head: nn.Module
    # BFPPStrategy balances stages by measured time unless told otherwise: a large vocabulary makes the
    # embedding heavy in parameters but cheap in compute, and the LM head the other way round
    pipeline_partition = "time"
    # the fields of a batch given as a tuple or list, in order
    positional_fields: tuple[str, ...] = ("input_ids", "attention_mask", "labels")
    # the fields the loss reads
    label_fields: tuple[str, ...] = ("labels",)

    def _adopt(self, model: PreTrainedModel, layers: list[nn.Module], head: nn.Module, inputs: tuple[str, ...]) -> None:
        """Take the model's modules as layers; ``inputs``: what ``forward`` takes, in order (some models take fewer)."""
        hf_modules = {id(m) for m in model.modules()}
        # the rotary embeddings' copies are `transformers` modules too
        hf_modules.update(
            id(m) for layer in layers for m in layer.modules() if type(m).__module__.startswith("transformers.")
        )
        _install_resets(model, [*layers, head], hf_modules)
        if self.lora_config is not None:
            _install_lora_resets([*layers, head], self.lora_config.init_lora_weights)
        self.hf_config = model.config
        self._tensor_plan = _compat.model_tp_plan(model)
        self.embed = layers[0]
        self.blocks = nn.ModuleList(layers[1:])
        self.head = head
        # `transformers` name -> this module's name, by identity (works on the meta device too): how
        # `export_pretrained` turns this module's state dict back into the model's
        owner: dict[int, str] = {}
        names_of: dict[int, list[str]] = {}
        for name, tensor in self.state_dict(keep_vars=True).items():
            owner.setdefault(id(tensor), name)
            names_of.setdefault(id(tensor), []).append(name)
        hf_state = model.state_dict(keep_vars=True)
        self.hf_names = {name: owner[id(tensor)] for name, tensor in hf_state.items()}
        self._weight_transforms = _weight_transforms(model)
        # this module's name -> the model's names of the same tensor (a tied weight has several on both sides): what
        # a checkpoint of the model holds it under, whichever of this module's names (stages) asks for it
        self._hf_sources: dict[str, list[str]] = {}
        for hf_name, tensor in hf_state.items():
            for name in names_of.get(id(tensor), ()):
                self._hf_sources.setdefault(name, []).append(hf_name)
        self._declare_pretrained()
        model_inputs = _forward_inputs(model)
        self._hf_forward = f"{type(model).__name__}.forward"
        self.batch_inputs = tuple(name for name in inputs if name in model_inputs)
        self._unsupported_inputs = tuple(
            name for name in model_inputs if name not in self.batch_inputs and name not in self.label_fields
        )
        self._warned_fields: set[tuple[str, ...]] = set()

    def _load_with_lora(
        self,
        model: Any,
        auto_class: Any,
        attn_implementation: str | None,
        lora: Any,
        adapter_name: str,
        dtype: torch.dtype | str | None,
    ) -> PreTrainedModel:
        """The ``transformers`` model (see :func:`_load`), with LoRA layers from ``lora`` or from a ``PeftModel``."""
        self.lora_config: Any = None
        self.adapter_name = adapter_name
        if _is_peft_model(model):
            if lora is not None:
                raise ValueError("Pass a `PeftModel` or `lora=` with a `transformers` model, not both.")
            model, self.lora_config, self.adapter_name = _unwrap_peft(model)
        hf_model, self._pretrained_folder = _load(model, auto_class, attn_implementation, dtype)
        if self._pretrained_folder is not None and _needs_conversion(hf_model, self._pretrained_folder):
            # stored as `transformers` converts on load (mixture-of-experts checkpoints keep one tensor per expert,
            # the model one per layer): read whole, by `transformers`, on every process
            folder, self._pretrained_folder = self._pretrained_folder, None
            hf_model = auto_class.from_pretrained(
                folder,
                dtype=_dtype(dtype or hf_model.config.dtype or torch.float32),
                **({} if attn_implementation is None else {"attn_implementation": attn_implementation}),
            ).train()
        if lora is not None:
            self.lora_config = _lora_config(lora)
            _apply_lora(hf_model, self.lora_config, adapter_name)
        return hf_model

    def _loaded_name(self, stored: str) -> str | None:
        """The name a tensor stored under ``stored`` goes by once ``transformers`` has loaded it: its checkpoint
        renamings (GPT-NeoX's ``embed_out`` is ``lm_head``), and the base model's prefix added or dropped as the
        model needs; None where a conversion of several stored tensors makes it (experts packed into one)."""
        from transformers.core_model_loading import rename_source_key

        renamings, converters, prefix, names = self._weight_transforms
        loaded, converted = rename_source_key(stored, renamings, converters, prefix, names)
        if loaded not in names and stored in names:  # as `transformers` does: the prefix alone, no renaming
            loaded, converted = rename_source_key(stored, [], [], prefix, names)
        return None if converted is not None else loaded

    def _checkpoint_names(self, name: str) -> list[str]:
        """The names a tensor of this module (``"blocks.3.self_attn.q_proj.weight"``) has in the model's checkpoint:
        every ``transformers`` name of it (a tied weight has several, the checkpoint keeps one), and a LoRA-wrapped
        layer's base weight as the base model stores it (without ``base_layer``)."""
        names = self._hf_sources.get(name, [])
        return list(dict.fromkeys([*names, *(n.replace(".base_layer.", ".") for n in names)]))

    def _declare_pretrained(self) -> None:
        """Where this module's weights come from, for the strategy (each rank its own stages) or :meth:`materialize`:
        the folder a name or folder was built from; tensors the model's checkpoint cannot hold (a task head of ours,
        LoRA adapters) keep their initialization."""
        if self._pretrained_folder is None:
            self.pipeline_pretrained = None
            return
        self.pipeline_pretrained = PretrainedWeights(
            self._pretrained_folder,
            rename=self._checkpoint_names,
            optional=lambda name: name not in self._hf_sources or ".lora_" in name,
            translate=self._loaded_name,
        )

    def configure_model(self) -> None:
        """Under another strategy than ``BFPPStrategy`` (which reads each rank's own stages when it places them), read
        the pretrained weights of a model built from a name or folder: :meth:`materialize`."""
        strategy = getattr(_lightning_compat.attached_trainer(self), "strategy", None)
        if not getattr(strategy, "fills_pretrained_per_stage", False):
            self.materialize()

    def materialize(self, device: torch.device | str = "cpu") -> None:
        """Allocate whatever of the model is on the meta device, on ``device``, and fill it: from the pretrained
        weights if the model was built from a name or folder (read whole, in the module's dtype), else as the model
        initializes itself. For use on one device; a no-op when nothing is on the meta device."""
        from lightning_bfpp.engine.layers import materialize_meta

        if not any(t.is_meta for t in (*self.parameters(), *self.buffers())):
            return
        # each module allocates its own tensors: a weight tied across modules is tied again afterwards
        places: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in self.modules():
            for name, param in _compat.parameter_slots(module).items():
                if param is not None:
                    places.setdefault(id(param), []).append((module, name))
        materialize_meta(self, torch.device(device))
        for (owner, owner_name), *others in places.values():
            for module, name in others:
                _compat.parameter_slots(module)[name] = _compat.parameter_slots(owner)[owner_name]
        if self.pipeline_pretrained is not None:
            self.pipeline_pretrained.fill_module(self)

    def _dtype_hparam(self, dtype: torch.dtype | str | None) -> dict[str, Any]:
        """``dtype`` as a hyper-parameter (a name, as YAML and checkpoints keep it), when one was given."""
        return {} if dtype is None else {"dtype": str(_dtype(dtype)).removeprefix("torch.")}

    def _lora_hparams(self) -> dict[str, Any]:
        if self.lora_config is None:
            return {}
        return {"lora": _lora_hparams(self.lora_config), "adapter_name": self.adapter_name}

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def parallelize_layer(self, layer: nn.Module, tp_mesh: Any) -> nn.Module:
        """Tensor parallelism from the model's own plan, on one pipeline layer (``BFPPStrategy`` calls this on the
        layers a rank holds when ``tensor_parallel_size > 1``; see :func:`tensor_parallel_plan`)."""
        from torch.distributed.tensor.parallel import parallelize_module

        plan = tensor_parallel_plan(self, layer, tp_mesh.size())
        if plan:
            parallelize_module(layer, tp_mesh, plan)
        return layer

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW over the parameters that train: with LoRA, or with weights frozen by hand, the frozen ones get no
        optimizer state."""
        trained = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(trained, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This module's state dict as full CPU tensors; on one process (or called on every rank alike).

        Refused while other pipeline ranks hold layers (after a multi-process ``fit``): save a checkpoint and
        pass it to :func:`export_pretrained` instead.
        """
        from torch.distributed.tensor import DTensor

        from lightning_bfpp.engine.layers import RemoteLayer

        remote = [n for n, m in self.named_modules() if isinstance(m, RemoteLayer)]
        if remote:
            raise RuntimeError(
                f"This process holds only some layers (`{remote[0]}` is on another pipeline rank). Export from a"
                " checkpoint instead: `trainer.save_checkpoint(path)`, then `export_pretrained(path, out_dir)`."
            )
        state = self.state_dict()
        return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu() for k, v in state.items()}

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights under their ``transformers`` names (see :meth:`full_state_dict`)."""
        full = self.full_state_dict()
        return {hf: full[ours] for hf, ours in self.hf_names.items()}

    def _read_batch(self, batch: Any) -> dict[str, Any]:
        """The batch as a dict of fields, refused or warned about as the class docstring says."""
        fields = _batch_fields(batch, self.positional_fields)
        unsupported = [name for name in self._unsupported_inputs if fields.get(name) is not None]
        if unsupported:
            raise ValueError(
                f"`{type(self).__name__}` cannot pass {unsupported} to its pipeline layers, which take"
                f" {list(self.batch_inputs)} of `{self._hf_forward}`'s inputs. Remove them from the batch."
            )
        known = {*self.batch_inputs, *self.label_fields}
        ignored = tuple(sorted(k for k, v in fields.items() if k not in known and isinstance(v, torch.Tensor)))
        if ignored and ignored not in self._warned_fields:
            self._warned_fields.add(ignored)
            warnings.warn(
                f"`{type(self).__name__}` ignores the batch fields {list(ignored)}: `{self._hf_forward}` does not take"
                f" them and the loss does not read them (the model's inputs are {list(self.batch_inputs)}, the"
                f" labels {list(self.label_fields)}). Rename a misspelt field, or remove the others from the batch.",
                UserWarning,
                stacklevel=3,
            )
        return fields

    def _model_args(self, fields: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        """What ``self(...)`` takes from the batch's fields, in ``forward``'s order.

        torch's pipeline takes tensors only (no None) as the first stage's input: a missing input before a given
        one becomes the tensor that means the same to the model (:meth:`_stand_in`); missing trailing ones are
        left out.
        """
        names = list(self.batch_inputs)
        while names and fields.get(names[-1]) is None:
            names.pop()
        input_ids = fields["input_ids"]
        return tuple(self._stand_in(n, input_ids) if fields.get(n) is None else fields[n] for n in names)

    def _stand_in(self, name: str, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _loss(self, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch))


class HFCausalLM(_HFPipelineModule):
    """A ``transformers`` causal LM (see :data:`CAUSAL_LM_FAMILIES`) as a pipelinable LightningModule.

    ``model``: a ``*ForCausalLM``, its config (object, or ``config.to_dict()``), a name/folder for
    ``AutoModelForCausalLM.from_pretrained``, or a ``peft`` model with one LoRA adapter. ``lora``: a
    ``peft.LoraConfig`` (or its fields) whose adapters train while the model stays frozen; ``adapter_name``
    names them. ``dtype`` (``torch.bfloat16`` or ``"bfloat16"``; default: the config's) is the dtype the weights
    are kept in, whatever the checkpoint's. A name or folder is built on the meta device and read from its
    safetensors where the layers are allocated: under ``BFPPStrategy`` each rank reads only its own stages'
    tensors; under another strategy ``configure_model`` reads them all (:meth:`materialize` outside a Trainer).
    The steps take
    batches as dicts (``input_ids``, optional ``attention_mask``, ``position_ids``, GPT-2's ``token_type_ids``,
    and ``labels``), tuples ``(input_ids, attention_mask, labels)``, or a tensor of ids; the logits are the
    model's ``model(**batch, use_cache=False)``. Packed documents (``position_ids`` restarting at 0 in each
    row, no ``attention_mask``, as ``DataCollatorWithFlattening`` makes them) attend within their document only;
    with an ``attention_mask``, even all ones, they see each other, as ``transformers`` has it.
    The loss is ``transformers``' shifted cross entropy (``labels`` default to ``input_ids`` with padding,
    and the token right after padding, ignored: that token would be predicted from a padding position), summed
    over the label tokens and divided by their count with :func:`~lightning_bfpp.mean_over_items`:
    under the strategy it is normalised over the global batch's label tokens, as on one device, however the
    batch is cut into micro-batches and replicas. The steps log ``train_loss`` / ``val_loss`` / ``test_loss``.
    """

    def __init__(
        self,
        model: Any,
        lr: float = 5e-5,
        weight_decay: float = 0.0,
        attn_implementation: str | None = None,
        lora: Any = None,
        adapter_name: str = "default",
        dtype: torch.dtype | str | None = None,
    ) -> None:
        super().__init__()
        hf_model = self._load_with_lora(model, AutoModelForCausalLM, attn_implementation, lora, adapter_name, dtype)
        layers = causal_lm_layers(hf_model)
        self._adopt(
            hf_model, layers[:-1], layers[-1], ("input_ids", "attention_mask", "position_ids", "token_type_ids")
        )
        # the config as a dict, so `load_from_checkpoint` and `export_pretrained` rebuild the same model
        _save_hyperparameters(
            self,
            {
                "model": hf_model.config.to_dict(),
                "lr": lr,
                "weight_decay": weight_decay,
                "attn_implementation": _compat.attn_implementation(hf_model.config),
                **self._dtype_hparam(dtype),
                **self._lora_hparams(),
            },
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.embed(input_ids, attention_mask, position_ids, token_type_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def _stand_in(self, name: str, input_ids: torch.Tensor) -> torch.Tensor:
        if name == "attention_mask":
            return _no_attention_mask(input_ids)
        if name == "position_ids":  # the model's own default
            return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        raise ValueError(f"No stand-in for a missing `{name}`.")

    def _loss(self, batch: Any) -> torch.Tensor:
        fields = self._read_batch(batch)
        logits = self(*self._model_args(fields))
        labels = fields.get("labels")
        if labels is None:
            input_ids, attention_mask = fields["input_ids"], fields.get("attention_mask")
            labels = input_ids
            if attention_mask is not None and attention_mask.shape == input_ids.shape:
                labels = input_ids.masked_fill(attention_mask == 0, -100)
                # a token right after padding (a left-padded sequence's first) would be predicted from a padding
                # position, whose output depends on how much padding the batch has: a batch padded to another
                # length (another replica, one device) would train on another value; it gets no label
                labels[:, 1:] = labels[:, 1:].masked_fill(attention_mask[:, :-1] == 0, -100)
        return _causal_lm_loss(logits, labels)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """The logits of a batch (its fields as the steps take them; labels are not needed)."""
        return self(*self._model_args(self._read_batch(batch)))


class HFSequenceRegressor(_HFPipelineModule):
    """A BERT-family encoder with a pooling and a linear head, for sentence- or word-level tasks.

    ``model``: a ``BertModel``/``RobertaModel``, its config, or a name/folder for ``AutoModel.from_pretrained``
    (``sentence-transformers/all-MiniLM-L6-v2`` is a ``BertModel``; a name or folder is read as
    :class:`HFCausalLM` reads one, in ``dtype``). ``num_labels=None`` is regression (one
    output, MSE against float labels); ``num_labels=k`` is classification (cross entropy against class
    indices). ``pooling`` is ``"mean"`` (default), ``"cls"``, ``"pooler"`` or ``"none"`` (one prediction per
    token; padded tokens, and class labels ``-100``, are ignored). Batches: dicts with ``input_ids``, optional
    ``attention_mask`` / ``token_type_ids`` / ``position_ids``, and ``labels`` (or ``label``), or tuples
    ``(input_ids, attention_mask, labels)``. Logs ``train_loss`` / ``val_loss`` / ``test_loss``.

    The loss is a mean over samples, or with ``pooling="none"`` over the batch's labelled tokens: summed and
    divided by their count with :func:`~lightning_bfpp.mean_over_items`, so that under the strategy it is
    normalised over the global batch's tokens, as on one device.
    """

    label_fields = ("labels", "label")

    def __init__(
        self,
        model: Any,
        num_labels: int | None = None,
        pooling: str = "mean",
        lr: float = 5e-5,
        weight_decay: float = 0.0,
        attn_implementation: str | None = None,
        lora: Any = None,
        adapter_name: str = "default",
        dtype: torch.dtype | str | None = None,
    ) -> None:
        super().__init__()
        if num_labels is not None and num_labels < 2:
            raise ValueError(f"`num_labels` must be None (regression) or at least 2 (classes); got {num_labels}.")
        hf_model = self._load_with_lora(model, AutoModel, attn_implementation, lora, adapter_name, dtype)
        layers = encoder_layers(hf_model)
        head = PoolingHead(hf_model.config.hidden_size, num_labels or 1, pooling, getattr(hf_model, "pooler", None))
        self._adopt(hf_model, layers, head, ("input_ids", "attention_mask", "token_type_ids", "position_ids"))
        self.num_labels = num_labels
        _save_hyperparameters(
            self,
            {
                "model": hf_model.config.to_dict(),
                "num_labels": num_labels,
                "pooling": pooling,
                "lr": lr,
                "weight_decay": weight_decay,
                "attn_implementation": _compat.attn_implementation(hf_model.config),
                **self._dtype_hparam(dtype),
                **self._lora_hparams(),
            },
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.embed(input_ids, attention_mask, token_type_ids, position_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def _stand_in(self, name: str, input_ids: torch.Tensor) -> torch.Tensor:
        if name == "attention_mask":  # an encoder's mask has no other meaning
            return torch.ones_like(input_ids)
        if name == "token_type_ids":  # the embeddings' own default: all of the first type
            return torch.zeros_like(input_ids)
        raise ValueError(f"No stand-in for a missing `{name}`.")

    def _loss(self, batch: Any) -> torch.Tensor:
        fields = self._read_batch(batch)
        out = self(*self._model_args(fields))
        labels = fields.get("labels", fields.get("label"))
        if labels is None:
            raise ValueError(f"`HFSequenceRegressor` needs `labels` (or `label`) in the batch; got {sorted(fields)}.")
        if self.head.pooling != "none":
            if self.num_labels is not None:
                return F.cross_entropy(out.float(), labels.reshape(-1).long())
            return F.mse_loss(out.squeeze(-1).float(), labels.float())
        attention_mask = fields.get("attention_mask")
        counted = torch.ones_like(out[..., 0], dtype=torch.bool) if attention_mask is None else attention_mask != 0
        if self.num_labels is not None:
            labels = labels.long().masked_fill(~counted, -100)
            loss_sum = F.cross_entropy(
                out.reshape(-1, self.num_labels).float(), labels.reshape(-1), ignore_index=-100, reduction="sum"
            )
            return mean_over_items(loss_sum, (labels != -100).sum())
        out = out.squeeze(-1).float()
        squared = (out - labels.to(out.dtype)) ** 2
        return mean_over_items((squared * counted.to(out.dtype)).sum(), counted.sum())

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """The head's output for a batch: one value per sample for regression (per token with ``pooling="none"``),
        class scores otherwise."""
        out = self(*self._model_args(self._read_batch(batch)))
        return out.squeeze(-1) if self.num_labels is None else out


# -- export -----------------------------------------------------------------------------------------------

TASK_HEAD_FILE = "bfpp_task_head.pt"


class _CheckpointTensors:
    """A checkpoint's model weights, read on demand: a DCP folder's ``model`` entries (never the optimizer state),
    or a ``torch.save`` file's ``state_dict``, memory-mapped. ``names``: the module names it holds (a parameter tied
    across stages under each of its names, stored once)."""

    def __init__(self, path: Path, weights_only: bool | None) -> None:
        self.path = path
        self.aliases: dict[str, str] = {}
        if path.is_dir():
            self.index = {
                key[len(MODEL_KEY) + 1 :]: meta
                for key, meta in reader(path, weights_only=weights_only).read_metadata().state_dict_metadata.items()
                if key.startswith(MODEL_KEY + ".")
            }
            self.checkpoint = load_metadata(path, weights_only=weights_only)
            self.aliases = dict(self.checkpoint.get(TIED_KEY) or {})
            self.state = None
        else:
            self.checkpoint = torch_load(path, weights_only=weights_only, mmap=True)
            self.state = self.checkpoint.get("state_dict")
        self.weights_only = weights_only
        stored = set(self.index if self.state is None else self.state)
        self.names = [*stored, *(a for a, c in self.aliases.items() if c in stored and a not in stored)]

    def layout(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """A stored tensor's dtype and shape, read from the index (nothing is loaded)."""
        if self.state is not None:
            return self.state[name].dtype, tuple(self.state[name].shape)
        meta = self.index[self.aliases.get(name, name)]
        return meta.properties.dtype, tuple(meta.size)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        if self.state is not None:
            return {name: self.state[name] for name in names}
        keys = {name: self.aliases.get(name, name) for name in names}
        request = {
            f"{MODEL_KEY}.{key}": torch.empty(self.index[key].size, dtype=self.index[key].properties.dtype)
            for key in set(keys.values())
        }
        dcp.load(request, storage_reader=reader(self.path, weights_only=self.weights_only), no_dist=True)
        return {name: request[f"{MODEL_KEY}.{key}"] for name, key in keys.items()}


def _checkpoint_tensors(path: Path, weights_only: bool | None) -> tuple[_HFPipelineModule, _CheckpointTensors]:
    """The module (built on the meta device, for its names and config) and the checkpoint's weights, unread."""
    tensors = _CheckpointTensors(path, weights_only)
    hparams = tensors.checkpoint.get("hyper_parameters") or {}
    if not tensors.names or "model" not in hparams:
        raise ValueError(
            f"{path} is not a checkpoint of an `HFCausalLM`/`HFSequenceRegressor` (it lacks the weights or the"
            " `model` hyper-parameter that holds the config)."
        )
    cls = HFSequenceRegressor if "pooling" in hparams else HFCausalLM
    with torch.device("meta"):
        module = cls(**hparams)
    return module, tensors


def _bytes(size: int | str) -> int:
    """``5_000_000``, ``"5GB"``, ``"500MB"`` or ``"2GiB"`` as bytes (``save_pretrained``'s ``max_shard_size``)."""
    if isinstance(size, int):
        return size
    text = size.strip().upper()
    for suffix, factor in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9), ("MB", 10**6),
                           ("KB", 10**3), ("B", 1)):  # fmt: skip
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(text)


def _read_in_parts(
    tensors: _CheckpointTensors, shard: list[tuple[str, str]], part_bytes: int
) -> Iterator[dict[str, torch.Tensor]]:
    """An output shard's tensors (``transformers`` name -> tensor), read from the checkpoint a part of about
    ``part_bytes`` at a time (a tensor larger than that on its own), in the shard's order."""
    part: list[tuple[str, str]] = []
    size = 0
    for hf_name, ours in [*shard, ("", "")]:
        nbytes = 0 if not ours else math.prod(tensors.layout(ours)[1]) * tensors.layout(ours)[0].itemsize
        if part and (not ours or size + nbytes > part_bytes):
            read = tensors.read([name for _, name in part])
            yield {hf: read[name] for hf, name in part}
            del read
            part, size = [], 0
        if ours:
            part.append((hf_name, ours))
            size += nbytes


def _write_shards(
    module: _HFPipelineModule, tensors: _CheckpointTensors, out: Path, max_shard_size: int | str, kwargs: dict
) -> Path:
    """A ``save_pretrained`` folder written one safetensors shard at a time, each read from the checkpoint a quarter
    shard at a time as it is written: host memory holds a part of one output shard. A tied weight is written once,
    under the model's first name for it, as ``save_pretrained`` does."""
    if kwargs:
        raise TypeError(f"export_pretrained from a checkpoint takes `max_shard_size` only; got {sorted(kwargs)}")
    out.mkdir(parents=True, exist_ok=True)
    limit, written = _bytes(max_shard_size), set()
    shards: list[list[tuple[str, str]]] = [[]]  # (transformers name, this module's name) per output shard
    size = 0
    for hf_name, ours in module.hf_names.items():
        if ours in written:
            continue
        written.add(ours)
        dtype, shape = tensors.layout(ours)
        nbytes = math.prod(shape) * dtype.itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((hf_name, ours))
        size += nbytes
    count = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        file = "model.safetensors" if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        layout = {hf_name: tensors.layout(ours) for hf_name, ours in shard}
        write_safetensors(out / file, layout, _read_in_parts(tensors, shard, limit // 4), metadata={"format": "pt"})
        total += sum(math.prod(shape) * dtype.itemsize for dtype, shape in layout.values())
        weight_map.update(dict.fromkeys(layout, file))
    if count > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config = copy.deepcopy(module.hf_config)
    with torch.device("meta"):  # the model's class, for the config's `architectures` (as `save_pretrained` sets it)
        model = (AutoModel if isinstance(module, HFSequenceRegressor) else AutoModelForCausalLM).from_config(config)
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    if isinstance(module, HFSequenceRegressor):
        names = [name for name in tensors.names if name.startswith("head.classifier.")]
        head = {k[len("head.") :]: v for k, v in tensors.read(names).items()}
        torch.save(
            {"pooling": module.hparams["pooling"], "num_labels": module.num_labels, "state_dict": head},
            out / TASK_HEAD_FILE,
        )
    return out


def export_pretrained(
    source: _HFPipelineModule | str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    merge: bool = False,
    weights_only: bool | None = None,
    **save_kwargs: Any,
) -> Path:
    """Write a trained :class:`HFCausalLM` / :class:`HFSequenceRegressor` as a ``save_pretrained`` folder.

    ``source`` is the module itself (on one process: after ``fit`` with ``strategy="auto"``, or after a
    pipelined ``fit`` of a single process), a checkpoint file (one-device, or made by
    ``python -m lightning.pytorch.utilities.consolidate_checkpoint``), or a ``BFPPStrategy`` checkpoint folder
    (read whole, on one process). ``AutoModelForCausalLM.from_pretrained(out_dir)`` (causal LMs) or
    ``AutoModel.from_pretrained(out_dir)`` (encoders) then loads the trained model; an encoder's task head,
    which ``transformers`` does not know, is saved beside it in ``bfpp_task_head.pt``
    (``{"pooling", "num_labels", "state_dict"}``). ``save_kwargs`` go to ``save_pretrained``. ``weights_only``
    for a checkpoint ``source`` as ``torch.load`` takes it (``None``: torch's default, ``True``; its hyper-parameters
    are plain values): ``False`` only for a file you trust, as unpickling it in full can run code.

    A module trained with LoRA is written as ``peft``'s adapter folder (``adapter_config.json`` and the adapter
    weights), which ``PeftModel.from_pretrained(base_model, out_dir)`` loads onto the base model; with
    ``merge=True``, as the whole model with the adapters merged into its weights (``merge_and_unload``), which
    ``from_pretrained`` loads without ``peft``.
    """
    if not isinstance(source, _HFPipelineModule):
        module, tensors = _checkpoint_tensors(Path(source), weights_only)
        if module.lora_config is None:  # the model's weights alone, one output shard at a time
            return _write_shards(module, tensors, Path(out_dir), save_kwargs.pop("max_shard_size", "5GB"), save_kwargs)
        full = {name: tensors.read([name])[name] for name in tensors.names}
    else:
        module, full = source, source.full_state_dict()
    state = {hf: full[ours] for hf, ours in module.hf_names.items()}
    config = copy.deepcopy(module.hf_config)
    auto_class = AutoModel if isinstance(module, HFSequenceRegressor) else AutoModelForCausalLM
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    model = auto_class.from_config(config, dtype=dtypes.pop() if len(dtypes) == 1 else None)
    out = Path(out_dir)
    if module.lora_config is None:
        if merge:
            raise ValueError("`merge=True` merges LoRA adapters; this module has none.")
        model.load_state_dict(state, strict=True)
        model.save_pretrained(out, **save_kwargs)
    else:
        peft_model = _peft().get_peft_model(model, copy.deepcopy(module.lora_config), adapter_name=module.adapter_name)
        model.load_state_dict(state, strict=True)
        if merge:
            peft_model.merge_and_unload().save_pretrained(out, **save_kwargs)
        else:
            peft_model.save_pretrained(out, **save_kwargs)
    if isinstance(module, HFSequenceRegressor):
        head = {k[len("head.") :]: v for k, v in full.items() if k.startswith("head.classifier.")}
        torch.save(
            {"pooling": module.head.pooling, "num_labels": module.num_labels, "state_dict": head}, out / TASK_HEAD_FILE
        )
    return out
