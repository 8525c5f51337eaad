"""The pipeline layers themselves: the first layer (embeddings), one layer per transformer block, and the last
(an LM head, or an encoder's pooling head).

Its own module because these classes are what crosses from ``transformers`` into the pipeline: each takes and
returns only tensors, and rebuilds what the model's forward would have handed it (masks, rotary tables) from them.
Which of a model's modules go into which layer is :mod:`.parts`'s.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedConfig
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

from lightning_bfpp.integrations.huggingface.masks import (
    _MASKS,
    _causal_mask,
    _layer_type,
    _mask_received,
    _mask_to_send,
)

POOLINGS = ("mean", "cls", "pooler", "none")


def _cache_keyword(layer: nn.Module) -> str:
    """The keyword a decoder layer takes its KV cache by: ``cache`` (``transformers`` ≥ 5.24), GPT-NeoX's
    ``layer_past``, or the older ``past_key_values``."""
    parameters = inspect.signature(layer.forward).parameters
    return next((name for name in ("cache", "layer_past", "past_key_values") if name in parameters), "cache")


def _kv_cache(cache: dict[str, Any], config: PreTrainedConfig) -> DynamicCache:
    """This block's KV cache for the group: ``transformers``' ``DynamicCache`` for the model's config (a sliding-window
    layer keeps its window only), made on first use."""
    kv = cache.get("kv")
    if kv is None:
        kv = cache["kv"] = DynamicCache(config=config)
    return kv


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

    def decode(
        self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], cache: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Generation (:class:`~lightning_bfpp.engine.generation.DecodingLayer`): the new tokens' embeddings, with
        the attention mask over the whole sequence so far and the new tokens' positions, for the blocks."""
        input_ids, attention_mask, position_ids = inputs
        hidden = self.embed_tokens(input_ids)
        if self.embed_positions is not None:
            hidden = hidden + self.embed_positions(position_ids)
        if self.multiplier is not None:
            hidden = hidden * self.multiplier
        if self.dropout is not None:
            hidden = self.dropout(hidden)
        return hidden, attention_mask, position_ids


class GPT2DecoderBlock(nn.Module):
    """One ``GPT2Block``, with the causal mask built from the 2-D attention mask as ``GPT2Model`` builds it."""

    def __init__(self, block: nn.Module, config: PreTrainedConfig) -> None:
        super().__init__()
        self.block = block
        self.config = config
        self.layer_idx = block.attn.layer_idx

    def forward(
        self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden, attention_mask, position_ids = inputs
        mask = _causal_mask(self.config, hidden, attention_mask, position_ids, sliding=False)
        hidden = self.block(hidden, attention_mask=mask, use_cache=False, position_ids=position_ids)
        return hidden, attention_mask, position_ids

    def decode(
        self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], cache: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Generation: the block with the group's KV cache (see :meth:`DecoderBlock.decode`)."""
        hidden, attention_mask, position_ids = inputs
        kv = _kv_cache(cache, self.config)
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            cache=kv,
            position_ids=position_ids,
            layer_idx=self.layer_idx,
        )
        hidden = self.block(hidden, cache=kv, attention_mask=mask, use_cache=True, position_ids=position_ids)
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
        self.layer_idx = layer_idx
        self.layer_type = _layer_type(config, layer_idx)
        self.cache_keyword = _cache_keyword(layer)
        self.rotary_by_type = "layer_type" in inspect.signature(rotary_emb.forward).parameters

    def forward(
        self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden, attention_mask, position_ids = inputs
        return (
            self._run(hidden, _mask_received(attention_mask, hidden), position_ids, None),
            attention_mask,
            position_ids,
        )

    def decode(
        self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], cache: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Generation (:class:`~lightning_bfpp.engine.generation.DecodingLayer`): the layer on the new tokens with
        the keys and values of the tokens before, as the model's forward in ``generate`` runs it. Each block keeps a
        ``DynamicCache`` per group (``transformers``' own, in which it writes its own layer's entry), and its mask
        is built for that layer (``layer_idx``): the first layer of its kind, whose entry ``transformers`` reads
        the sizes from, may be on another stage."""
        hidden, attention_mask, position_ids = inputs
        kv = _kv_cache(cache, self.config)
        return self._run(hidden, attention_mask, position_ids, kv), attention_mask, position_ids

    def _run(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor, kv: Any
    ) -> torch.Tensor:
        """The layer as the model's forward calls it: without a cache (training), or with this block's (``kv``)."""
        mask = _MASKS[self.layer_type](
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            cache=kv,
            position_ids=position_ids,
            **({} if kv is None else {"layer_idx": self.layer_idx}),
        )
        if self.rotary_by_type:
            position_embeddings = self.rotary_emb(hidden, position_ids, self.layer_type)
        else:
            position_embeddings = self.rotary_emb(hidden, position_ids)
        cached = {} if kv is None else {self.cache_keyword: kv}
        out = self.layer(
            hidden,
            attention_mask=mask,
            position_embeddings=position_embeddings,
            position_ids=position_ids,
            use_cache=kv is not None,
            **cached,
        )
        return out[0] if isinstance(out, tuple) else out


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

    def decode(self, inputs: tuple[torch.Tensor, ...], cache: dict[str, Any]) -> torch.Tensor:
        """Generation: the logits of the last position only (the one the next token is chosen from)."""
        return self.forward((inputs[0][:, -1:],))


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
