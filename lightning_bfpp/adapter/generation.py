"""``lightning_bfpp.generate(module, input_ids, ...)``: a module's own layers decoding through the pipeline.

A module whose pipeline layers implement ``decode(inputs, cache)`` (the protocol of
:class:`~lightning_bfpp.engine.generation.DecodingLayer`) generates with this function, under ``BFPPStrategy``
through its pipeline and elsewhere on one process, greedily or with a token choice of its own. The Hugging Face
wrappers' ``generate`` is the same decoding with ``transformers``' own options on top.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from lightning.pytorch import LightningModule

from lightning_bfpp.adapter import _lightning_compat
from lightning_bfpp.engine.generation import Stopping, generate_in_pipeline, generate_locally
from lightning_bfpp.engine.layers import pipeline_layers


def greedy(ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The next tokens of greedy decoding: the most likely ones."""
    return torch.argmax(logits, dim=-1)


def generate(
    module: LightningModule,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    num_groups: int | None = None,
    choose: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = greedy,
) -> torch.Tensor:
    """Decode ``max_new_tokens`` after each prompt of ``input_ids`` ``[batch, length]`` (left-padded where
    ``attention_mask`` says so): the prompts and their new tokens, ``pad_token_id`` after a row's end-of-sequence
    token. ``choose(ids, logits)`` picks the next tokens ``[batch]`` from the ids so far and the last position's fp32
    logits (default: greedy). Under ``BFPPStrategy``: a collective of every rank (each pipeline's ranks pass the
    same prompts; replicas their own); ``num_groups`` groups of sequences in flight (default: the pipeline's ranks).
    Each pipeline layer needs ``decode(inputs, cache)`` (see docs/generation.md); one without it is refused."""
    eos = () if eos_token_id is None else tuple([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
    if eos and pad_token_id is None:
        pad_token_id = eos[0]
    stopping = Stopping(max_new_tokens, eos, pad_token_id)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids, dtype=torch.long)
    strategy = getattr(_lightning_compat.attached_trainer(module), "strategy", None)
    pipeline = getattr(strategy, "pipeline", None)

    def chooser_for(rows: slice) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        return choose

    if pipeline is not None:
        result = generate_in_pipeline(pipeline, input_ids, attention_mask, chooser_for, stopping, num_groups=num_groups)
    else:
        named = pipeline_layers(module)
        result = generate_locally(
            module, [layer for _, layer in named], [name for name, _ in named], input_ids, attention_mask,
            chooser_for, stopping, num_groups=num_groups or 1,
        )  # fmt: skip
    return result.sequences.to(input_ids.device)
