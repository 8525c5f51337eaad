"""The attention mask's two forms: the 2-D mask that travels between stages (with a tensor of its own for "no
mask"), and the 4-D mask each block rebuilds from it with ``transformers``' own mask functions.

Its own module because every layer reads it: the embedding sends the mask, each block receives it and builds the
mask of its attention kind, and the wrapper's batches stand a missing mask in with the same tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedConfig
from transformers.masking_utils import (
    create_causal_mask,
    create_chunked_causal_mask,
    create_sliding_window_causal_mask,
)


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
