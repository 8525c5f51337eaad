"""Which modules of a ``transformers`` model become which pipeline layers, and for which models that is right.

Its own module because it is where the adapter knows about model families: how a causal LM's parts are found
(from its pipeline plan, or its module tree), what particular families do in their forward function
(:data:`FAMILY_CODE`), which families are tested, and the check that an untested one composes to its own logits.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.models.bert.modeling_bert import BertModel
from transformers.models.gpt2.modeling_gpt2 import GPT2LMHeadModel
from transformers.models.roberta.modeling_roberta import RobertaModel

from lightning_bfpp.integrations.huggingface.blocks import (
    CausalEmbedding,
    CausalLMHead,
    DecoderBlock,
    EncoderBlock,
    EncoderEmbedding,
    GPT2DecoderBlock,
)
from lightning_bfpp.integrations.huggingface.masks import _layer_type

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


ENCODER_CLASSES: tuple[type[PreTrainedModel], ...] = (BertModel, RobertaModel)


def _names(classes: tuple[type, ...]) -> str:
    return ", ".join(f"`{c.__name__}`" for c in classes)


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
