"""``HFCausalLM.generate``: ``transformers``' greedy and sampling decoding, through the pipeline under BFPPStrategy.

Its own module because it is where ``transformers``' generation semantics are kept: the generation config merged
as ``generate`` merges it (the call's arguments over the model's ``generation_config`` over ``transformers``'
defaults), the logits processors ``generate`` would apply, in its order (repetition penalty, minimum new tokens,
then temperature, top-k and top-p when sampling), the attention mask it infers, the padding after a row's end and
the draw (``torch.multinomial`` over a group's rows per step). The decoding itself (the ring of stages, a KV cache
per stage and group, when a row stops) is the engine's (:mod:`lightning_bfpp.engine.generation`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig
from transformers.generation import GenerateDecoderOnlyOutput, GenerationMode
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lightning_bfpp.engine.generation import (
    Generated,
    Stopping,
    TokenChooser,
    generate_in_pipeline,
    generate_locally,
    sampling_generator,
)
from lightning_bfpp.integrations.huggingface import _compat

if TYPE_CHECKING:
    from lightning_bfpp.integrations.huggingface.modules import _HFPipelineModule

# the `generate` arguments this decoding takes; every other one is refused by name
DECODING_OPTIONS = (
    "max_new_tokens",
    "min_new_tokens",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "eos_token_id",
    "pad_token_id",
    "return_dict_in_generate",
    "output_logits",
)
# what `generate` would do with a field set away from its default (in the call or the model's generation config),
# and what to use instead
_OTHER_MODES = {
    "num_beams": "beam search",
    "num_beam_groups": "diverse beam search",
    "penalty_alpha": "contrastive search",
    "dola_layers": "DoLa decoding",
    "assistant_model": "assisted decoding",
    "prompt_lookup_num_tokens": "prompt-lookup decoding",
    "num_return_sequences": "several sequences per prompt (repeat the prompts instead: `ids.repeat_interleave(n, 0)`)",
    "constraints": "constrained beam search",
    "force_words_ids": "constrained beam search",
    "streamer": "streaming",
    "logits_processor": "logits processors of your own",
    "stopping_criteria": "stopping criteria of your own",
    "prefix_allowed_tokens_fn": "prefix-constrained decoding",
}
_INSTEAD = (
    " Under BFPPStrategy `generate` decodes greedily (`do_sample=False`) or by sampling (`do_sample=True` with"
    " `temperature`, `top_k`, `top_p`), with `repetition_penalty`, `min_new_tokens`, `eos_token_id` and"
    " `pad_token_id`; for other modes export the model (`export_pretrained`) and run `transformers`' `generate` on"
    " one device."
)
_SUPPORTED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)
# the generation config's fields that change which tokens greedy or sampling decoding gives (a processor, a
# stopping rule, an output), other than those this decoding applies: refused when set away from their defaults
_CHANGES_THE_TOKENS = (
    "min_length",
    "no_repeat_ngram_size",
    "bad_words_ids",
    "sequence_bias",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
    "guidance_scale",
    "min_p",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "top_h",
    "watermarking_config",
    "renormalize_logits",
    "stop_strings",
    "max_time",
    "output_scores",
    "output_attentions",
    "output_hidden_states",
)


def generation_config(base: GenerationConfig, options: dict[str, Any]) -> GenerationConfig:
    """The config ``transformers``' ``generate`` would decode with: ``options`` over the model's ``base`` config
    over ``transformers``' defaults; refused, naming the field, where it asks for a decoding other than greedy or
    sampling, or for a field this decoding does not apply."""
    for name in options:
        if name in _OTHER_MODES:
            raise ValueError(f"`generate({name}=...)` asks for {_OTHER_MODES[name]}, which is not supported.{_INSTEAD}")
        if name not in DECODING_OPTIONS:
            raise ValueError(f"`generate({name}=...)` is not supported.{_INSTEAD}")
    config = GenerationConfig()
    config.update(**copy.deepcopy(base).to_dict(), defaults_only=True, allow_custom_entries=True)
    config.update(**_compat.generation_defaults(base), defaults_only=True)
    config.update(**options)
    mode = config.get_generation_mode()
    if mode not in _SUPPORTED_MODES:
        raise ValueError(
            f"`generate` would run {mode.value.replace('_', ' ')} here (the model's generation config or the call"
            f" sets it: num_beams={config.num_beams}).{_INSTEAD} Pass `num_beams=1` where the model's config sets more."
        )
    for field in _CHANGES_THE_TOKENS:
        value = getattr(config, field, None)
        if not _inactive(field, value):
            raise ValueError(
                f"`generate` under BFPPStrategy does not apply `{field}={value!r}` (set by the call or the model's"
                f" generation config).{_INSTEAD}"
            )
    return config


def _inactive(field: str, value: Any) -> bool:
    """Whether a field of :data:`_CHANGES_THE_TOKENS` leaves decoding as it is (unset, zero, off, or a factor of 1)."""
    if value is None or value is False or (isinstance(value, (int, float)) and value == 0):
        return True
    return field in ("typical_p", "guidance_scale") and value == 1.0


def _special_tokens(config: GenerationConfig) -> tuple[tuple[int, ...], int | None]:
    """``eos_token_id`` as a tuple, and the padding token (the first end-of-sequence token where none is set, as
    ``generate`` takes it)."""
    eos = config.eos_token_id
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]))
    pad = config.pad_token_id
    if pad is None and eos_ids:
        pad = eos_ids[0]
    return eos_ids, (None if pad is None else int(pad))


def attention_mask_for(input_ids: torch.Tensor, pad: int | None, eos: tuple[int, ...]) -> torch.Tensor:
    """The mask ``generate`` infers without one: the tokens other than padding where padding is present and is not
    an end-of-sequence token, else every token."""
    if pad is not None and pad not in eos and bool((input_ids == pad).any()):
        return input_ids.ne(pad).long()
    return torch.ones_like(input_ids, dtype=torch.long)


def chooser_factory(
    config: GenerationConfig,
    attention_mask: torch.Tensor,
    eos: tuple[int, ...],
    generator: torch.Generator | None,
) -> Callable[[slice], TokenChooser]:
    """For a group's rows, the next-token choice ``generate`` makes: its logits processors for those rows, then the
    argmax, or ``torch.multinomial`` from ``generator`` when sampling."""
    prompt_length = attention_mask.shape[1]

    def chooser_for(rows: slice) -> TokenChooser:
        processors = LogitsProcessorList()
        device = attention_mask.device
        if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
            padding = (attention_mask[rows] != 0).int().argmax(dim=1)
            processors.append(RepetitionPenaltyLogitsProcessor(config.repetition_penalty, prompt_ignore_length=padding))
        if config.min_new_tokens and eos:
            eos_tensor = torch.tensor(eos, device=device)
            processors.append(
                MinNewTokensLengthLogitsProcessor(prompt_length, config.min_new_tokens, eos_tensor, device=str(device))
            )
        if config.do_sample:
            if config.temperature is not None and config.temperature != 1.0:
                processors.append(TemperatureLogitsWarper(config.temperature))
            if config.top_k is not None and config.top_k != 0:
                processors.append(TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
            if config.top_p is not None and config.top_p < 1.0:
                processors.append(TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))

        def choose(ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
            scores = processors(ids, logits)
            if config.do_sample:
                probs = torch.nn.functional.softmax(scores, dim=-1)
                return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
            return torch.argmax(scores, dim=-1)

        return choose

    return chooser_for


def generate(
    module: _HFPipelineModule,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    max_new_tokens: int,
    num_groups: int | None = None,
    **options: Any,
) -> torch.Tensor | GenerateDecoderOnlyOutput:
    """See :meth:`~lightning_bfpp.integrations.huggingface.HFCausalLM.generate`."""
    config = generation_config(module.generation_config, {"max_new_tokens": max_new_tokens, **options})
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"`input_ids` must be a 2-D tensor [batch, prompt length]; got {type(input_ids).__name__}.")
    if input_ids.shape[1] == 0:
        raise ValueError("`input_ids` must hold at least one prompt token per row (a BOS token will do).")
    eos, pad = _special_tokens(config)
    if attention_mask is None:
        attention_mask = attention_mask_for(input_ids, pad, eos)
    elif attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"`attention_mask` must have the shape of `input_ids` {tuple(input_ids.shape)}; got"
            f" {tuple(attention_mask.shape)}."
        )
    stopping = Stopping(int(config.max_new_tokens), eos, pad)
    pipeline = module._generation_pipeline()
    device = pipeline.device if pipeline is not None else next(module.parameters()).device
    generator = sampling_generator(device) if config.do_sample else None
    chooser_for = chooser_factory(config, attention_mask.to(device), eos, generator)
    record = bool(config.return_dict_in_generate and config.output_logits)
    if pipeline is not None:
        result = generate_in_pipeline(
            pipeline, input_ids, attention_mask, chooser_for, stopping,
            num_groups=num_groups, generator=generator, record_logits=record,
        )  # fmt: skip
    else:
        layers = module.pipeline_layers()
        names = [f"layer {i}" for i in range(len(layers))]
        result = generate_locally(
            module, layers, names, input_ids, attention_mask, chooser_for, stopping,
            num_groups=num_groups or 1, record_logits=record,
        )  # fmt: skip
    return _returned(result, input_ids.device, config)


def _returned(result: Generated, device: torch.device, config: GenerationConfig) -> Any:
    sequences = result.sequences.to(device)
    if not config.return_dict_in_generate:
        return sequences
    logits = tuple(step.to(device) for step in result.logits) if config.output_logits else None
    return GenerateDecoderOnlyOutput(sequences=sequences, logits=logits)
