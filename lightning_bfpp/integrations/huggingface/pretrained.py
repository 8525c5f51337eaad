"""The wrappers' weights: the ``transformers`` model they are built from (with its LoRA layers), what
``transformers`` calls each of their tensors, and where pretrained values are read: per stage under
``BFPPStrategy``, whole in :meth:`_HFWeights.materialize` elsewhere.

Its own module because a model built from a name or folder stays on the meta device until its layers are placed,
so the mapping from this module's names to the checkpoint's (renamings, the base model's prefix, tied weights,
LoRA's ``base_layer``, checkpoints ``transformers`` converts as it loads them) has to outlive the model itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from transformers import PreTrainedModel

from lightning_bfpp.adapter import _lightning_compat
from lightning_bfpp.engine.pretrained import PretrainedWeights, PretrainedWeightsError
from lightning_bfpp.integrations.huggingface.loading import _dtype, _load
from lightning_bfpp.integrations.huggingface.lora import _apply_lora, _is_peft_model, _lora_config, _unwrap_peft


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


class _HFWeights(L.LightningModule):
    """What a wrapper knows of its weights beyond its own state dict: the model's names for them (``hf_names``,
    ``transformers`` name -> this module's name, which :func:`~.export.export_pretrained` writes back under) and
    where pretrained values come from (``pipeline_pretrained``, read by ``BFPPStrategy`` for each rank's stages).

    ``lora_config`` / ``adapter_name``: the model's LoRA adapters, None without.
    """

    hf_names: dict[str, str]
    pipeline_pretrained: PretrainedWeights | None

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

    def _map_names(self, model: PreTrainedModel) -> None:
        """The names of ``model``'s tensors, which this module's layers now hold: ``hf_names`` and the reverse map
        (by identity, which works on the meta device too), then where the weights come from
        (:meth:`_declare_pretrained`)."""
        # `transformers` name -> this module's name: how `export_pretrained` turns this module's state dict back into
        # the model's
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
        initializes itself, each module from the process's seed and its name (see
        :func:`~lightning_bfpp.engine.layers.materialize_meta`). For use on one device; a no-op when nothing is on the
        meta device."""
        from lightning_bfpp.engine.layers import materialize_whole

        if not any(t.is_meta for t in (*self.parameters(), *self.buffers())):
            return
        # each module from the seed and its name, as the strategy's ranks materialize theirs: LoRA adapters and a
        # new head start alike here and under any layout; a weight tied across modules is tied again afterwards
        materialize_whole(self, torch.device(device))
        if self.pipeline_pretrained is not None:
            self.pipeline_pretrained.fill_module(self)

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
