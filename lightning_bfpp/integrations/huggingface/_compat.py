"""The ``transformers`` internals the Hugging Face adapter relies on, in one place (as
:mod:`lightning_bfpp.engine._compat` is for torch's): an upgrade that renames one breaks this file, and
``tests/unit/test_compat.py`` says which. They are reached through the objects the adapter passes in, so this
module does not import ``transformers`` (an optional dependency).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def attn_implementation(config: Any) -> str | None:
    """The attention implementation a ``transformers`` config selects (``"sdpa"``, ``"eager"``, …).

    ``transformers`` has a public setter (``PreTrainedModel.set_attn_implementation``) but no public getter.
    """
    return config._attn_implementation


def init_weights_as_model(model_class: type, config: Any, modules: Sequence[nn.Module]) -> None:
    """Initialize ``modules`` in order with ``model_class``'s own ``_init_weights``, as ``model_class(config)``
    does, without building the model (its other modules may be on the meta device or on other ranks)."""
    initializer = model_class.__new__(model_class)
    nn.Module.__init__(initializer)
    initializer.config = config
    with torch.no_grad():
        for module in modules:
            initializer._init_weights(module)


def model_tp_plan(model: Any) -> dict[str, str]:
    """A ``transformers`` ``*ForCausalLM``'s whole tensor-parallel plan, keyed by module paths inside it with the
    base model's written ``model.`` (``transformers`` names it ``base_model_prefix``: ``model``, ``gpt_neox``).

    ``transformers`` ≥ 5 resolves the plan on the model (``model.tp_plan``): the class's own ``_tp_plan`` (the
    LM head), the config's ``base_model_tp_plan``, and a vocabulary-parallel ``embed_tokens``
    (``embedding_rowwise``) that the base model adds whenever it has a plan. Older versions keep only the
    first two, which are read directly."""
    prefix = getattr(model, "base_model_prefix", "model") or "model"
    plan = getattr(model, "tp_plan", None)
    if not isinstance(plan, dict):
        base = getattr(model.config, "base_model_tp_plan", None) or {}
        plan = {**dict(getattr(type(model), "_tp_plan", None) or {}), **{f"{prefix}.{k}": v for k, v in base.items()}}
    return {("model." + k[len(prefix) + 1 :] if k.startswith(prefix + ".") else k): v for k, v in plan.items()}


def generation_defaults(generation_config: Any) -> dict[str, Any]:
    """The values ``transformers``' ``generate`` gives the fields neither the call nor the model's generation config
    set (``top_k=50``, ``max_length=20``, …): its private ``GenerationConfig._get_default_generation_params``,
    which ``generate`` merges under the model's config (``GenerationMixin._prepare_generation_config``)."""
    return generation_config._get_default_generation_params()
