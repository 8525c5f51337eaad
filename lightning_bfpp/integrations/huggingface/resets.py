"""``reset_parameters()`` for the layers' submodules, so that layers made on the meta device come out as the model
would initialize them when the strategy materializes each rank's layers.

Its own module because neither ``transformers`` modules nor LoRA's adapters have a ``reset_parameters()`` that
does what their library does: these run the model's own ``_init_weights`` and ``peft``'s own LoRA init.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel

from lightning_bfpp.integrations.huggingface import _compat


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


def _install_resets(model: PreTrainedModel, layers: list[nn.Module]) -> None:
    """An :class:`_HFReset` on each ``transformers`` submodule of ``layers`` that holds tensors of its own."""
    hf_modules = {id(m) for m in model.modules()}
    # the rotary embeddings' copies are `transformers` modules too
    hf_modules.update(
        id(m) for layer in layers for m in layer.modules() if type(m).__module__.startswith("transformers.")
    )
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
