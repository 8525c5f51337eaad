"""LoRA through ``peft``: a ``lora=`` config or a ``PeftModel`` turned into LoRA layers inside the model, and the
config as plain hyper-parameters.

Its own module because ``peft`` is an optional dependency of its own (imported only when LoRA is asked for), and
because what the pipeline refuses of ``peft``'s methods is decided in one place.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from transformers import PreTrainedModel


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


def _split_with_base(module: Any, path: str, style: str, make_style: Any, size: int) -> dict[str, Any] | None:
    """How a LoRA layer at ``path`` splits over ``size`` tensor ranks when the model's plan splits its base layer
    with ``style``, as Megatron-LM and NeMo split adapters with their base layer; None when ``module`` is no LoRA
    layer (the base layer itself takes the plan's style).

    LoRA adds ``B(A(x)) * scaling`` to the base layer's output. A column-wise base (output split by heads or
    units) takes a column-wise B, whose output is split alike, and a whole A (``r`` columns are few): each rank
    adds its share of the update to its share of the output, and A's gradient comes summed over the group through
    B's input, as a column-wise layer's input gradient does. A row-wise base (input split, partial sums
    all-reduced) takes a row-wise A, which reads the same share of the input and all-reduces its ``r`` outputs,
    and a whole B: each rank adds the whole update to the whole output. So the adapters hold ``1/size`` of their
    split matrix per rank, and what the layer computes is the one-device sum. Refused: LoRA on a split embedding
    (its adapters are bare parameters, not layers), and LoRA variants (DoRA's norm of the merged weight needs the
    whole weight)."""
    if not type(module).__module__.startswith("peft."):
        return None
    from peft.tuners.lora import LoraLayer

    if not isinstance(module, LoraLayer):
        return None
    where = f"`{path}` (the model's tensor-parallel plan splits it `{style}`)"
    if getattr(module, "lora_variant", None):
        raise ValueError(
            f"BFPPStrategy(tensor_parallel_size={size}): LoRA variants (DoRA) on a tensor-parallel layer are not"
            f" supported: {where} is a `{type(next(iter(module.lora_variant.values()))).__name__}` adapter whose"
            " magnitude needs the whole merged weight. Use plain LoRA (`use_dora=False`), or train without tensor"
            " parallelism."
        )
    if style.startswith("embedding") or module.lora_embedding_A:
        raise ValueError(
            f"BFPPStrategy(tensor_parallel_size={size}): LoRA on a tensor-parallel embedding is not supported: {where}."
            " Leave the embedding out of `target_modules` (adapters on the attention and MLP projections are the"
            " usual choice), or train without tensor parallelism."
        )
    styles = {f"{path}.base_layer": make_style(style)}
    if style.startswith("colwise"):
        styles.update({f"{path}.lora_B.{adapter}": make_style(style) for adapter in module.lora_B})
    elif style.startswith("rowwise"):
        styles.update({f"{path}.lora_A.{adapter}": make_style(style) for adapter in module.lora_A})
    else:
        raise ValueError(
            f"BFPPStrategy(tensor_parallel_size={size}): LoRA on a layer the plan splits `{style}` is not supported:"
            f" {where}. Leave it out of `target_modules`, or train without tensor parallelism."
        )
    return styles
