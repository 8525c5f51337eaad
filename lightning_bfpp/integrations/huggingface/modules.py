"""The two LightningModules, :class:`HFCausalLM` and :class:`HFSequenceRegressor`, and the base class they share.

Its own module because this is what users construct: the base class builds the layers from the model, saves the
hyper-parameters, reads batches and runs the steps alike for both; each wrapper adds its ``transformers`` model
class, its layers and head, its stand-ins for missing inputs and its loss.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from lightning_bfpp.engine.loss import mean_over_items
from lightning_bfpp.integrations.huggingface import _compat
from lightning_bfpp.integrations.huggingface.blocks import PoolingHead
from lightning_bfpp.integrations.huggingface.loading import _dtype
from lightning_bfpp.integrations.huggingface.lora import _lora_hparams
from lightning_bfpp.integrations.huggingface.masks import _no_attention_mask
from lightning_bfpp.integrations.huggingface.parts import causal_lm_layers, encoder_layers
from lightning_bfpp.integrations.huggingface.pretrained import _HFWeights
from lightning_bfpp.integrations.huggingface.resets import _install_lora_resets, _install_resets
from lightning_bfpp.integrations.huggingface.tensor_parallel import tensor_parallel_plan


def _generation_config(model: PreTrainedModel, folder: Any) -> GenerationConfig:
    """The model's generation config, as ``from_pretrained`` gives it: the folder's ``generation_config.json`` where
    it has one, else the model's own (from its config)."""
    if folder is not None and (Path(folder) / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(folder)
    config = getattr(model, "generation_config", None)  # an encoder has none
    return copy.deepcopy(config) if config is not None else GenerationConfig()


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


class _HFPipelineModule(_HFWeights):
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
    # each wrapper's: the `transformers` class that builds its model from a config, name or folder, and what its
    # `forward` (its first layer) takes, in order
    _auto_class: Any
    _layer_inputs: tuple[str, ...]

    def __init__(
        self,
        model: Any,
        make_layers: Callable[[PreTrainedModel], list[nn.Module]],
        task_hparams: dict[str, Any],
        lr: float,
        weight_decay: float,
        attn_implementation: str | None,
        lora: Any,
        adapter_name: str,
        dtype: torch.dtype | str | None,
    ) -> None:
        """The wrappers' common arguments, in their order (see :class:`HFCausalLM`); ``make_layers``: the model's
        pipeline layers, the head last; ``task_hparams``: the wrapper's own hyper-parameters, saved after the model's
        config."""
        super().__init__()
        hf_model = self._load_with_lora(model, self._auto_class, attn_implementation, lora, adapter_name, dtype)
        self._adopt(hf_model, make_layers(hf_model))
        # the config as a dict, so `load_from_checkpoint` and `export_pretrained` rebuild the same model
        hparams = {
            "model": hf_model.config.to_dict(),
            **task_hparams,
            "lr": lr,
            "weight_decay": weight_decay,
            "attn_implementation": _compat.attn_implementation(hf_model.config),
        }
        if dtype is not None:  # a name, as YAML and checkpoints keep it
            hparams["dtype"] = str(_dtype(dtype)).removeprefix("torch.")
        if self.lora_config is not None:
            hparams.update(lora=_lora_hparams(self.lora_config), adapter_name=self.adapter_name)
        _save_hyperparameters(self, hparams)

    def _adopt(self, model: PreTrainedModel, layers: list[nn.Module]) -> None:
        """Take the model's modules as layers (the head last)."""
        _install_resets(model, layers)
        if self.lora_config is not None:
            _install_lora_resets(layers, self.lora_config.init_lora_weights)
        self.hf_config = model.config
        self.generation_config = _generation_config(model, self._pretrained_folder)
        self._tensor_plan = _compat.model_tp_plan(model)
        self.embed = layers[0]
        self.blocks = nn.ModuleList(layers[1:-1])
        self.head = layers[-1]
        self._map_names(model)
        model_inputs = _forward_inputs(model)
        self._hf_forward = f"{type(model).__name__}.forward"
        self.batch_inputs = tuple(name for name in self._layer_inputs if name in model_inputs)
        self._unsupported_inputs = tuple(
            name for name in model_inputs if name not in self.batch_inputs and name not in self.label_fields
        )
        self._warned_fields: set[tuple[str, ...]] = set()

    def _run_layers(self, *inputs: torch.Tensor | None) -> torch.Tensor:
        """``forward``: the layers in order, the first on ``forward``'s arguments."""
        x = self.embed(*inputs)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

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
                stacklevel=4,  # the step that read the batch (through `_run_batch`)
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

    def _run_batch(self, batch: Any) -> tuple[dict[str, Any], torch.Tensor]:
        """The batch's fields (:meth:`_read_batch`) and the model's output for them."""
        fields = self._read_batch(batch)
        return fields, self(*self._model_args(fields))

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

    _auto_class = AutoModelForCausalLM
    _layer_inputs = ("input_ids", "attention_mask", "position_ids", "token_type_ids")

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
        super().__init__(model, causal_lm_layers, {}, lr, weight_decay, attn_implementation, lora, adapter_name, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self._run_layers(input_ids, attention_mask, position_ids, token_type_ids)

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int,
        num_groups: int | None = None,
        **options: Any,
    ) -> Any:
        """``transformers``' ``generate`` for greedy and sampling decoding, through the pipeline under
        ``BFPPStrategy``: the prompt and its new tokens, padded after each row's end-of-sequence token.

        ``options``: the ``GenerationConfig`` fields of greedy and sampling decoding (``min_new_tokens``,
        ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``, ``eos_token_id`` (one or
        several), ``pad_token_id``; ``return_dict_in_generate`` with ``output_logits``), over the model's own
        ``generation_config``, applied through ``transformers``' logits processors. Other modes (beam search,
        assisted decoding, …) are refused by name. ``num_groups``: the groups of sequences in flight through the
        pipeline (default: its ranks). Sampling draws from a copy of this process's generator (after
        ``torch.manual_seed(s)``, ``transformers``' tokens on one process), leaving the process's own stream as
        it was; in a step, from the step's own seed.

        Under ``BFPPStrategy`` every rank of the pipeline takes part (in ``validation_step``, ``test_step``,
        ``predict_step`` and the ``on_*_epoch_end`` hooks), each data-parallel replica with its own prompts, and the
        result is on every rank where the code after the call runs. Elsewhere (another strategy, no Trainer) the
        same decoding runs on this process. See docs/generation.md.
        """
        from lightning_bfpp.integrations.huggingface.generation import generate

        return generate(
            self, input_ids, attention_mask, max_new_tokens=max_new_tokens, num_groups=num_groups, **options
        )

    def _generation_pipeline(self) -> Any:
        """The pipeline this module's layers run in (BFPPStrategy's, once set up), None on one process."""
        from lightning_bfpp.adapter import _lightning_compat

        strategy = getattr(_lightning_compat.attached_trainer(self), "strategy", None)
        return getattr(strategy, "pipeline", None)

    def _stand_in(self, name: str, input_ids: torch.Tensor) -> torch.Tensor:
        if name == "attention_mask":
            return _no_attention_mask(input_ids)
        if name == "position_ids":  # the model's own default
            return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        raise ValueError(f"No stand-in for a missing `{name}`.")

    def _loss(self, batch: Any) -> torch.Tensor:
        fields, logits = self._run_batch(batch)
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
        return self._run_batch(batch)[1]


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
    _auto_class = AutoModel
    _layer_inputs = ("input_ids", "attention_mask", "token_type_ids", "position_ids")

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
        if num_labels is not None and num_labels < 2:
            raise ValueError(f"`num_labels` must be None (regression) or at least 2 (classes); got {num_labels}.")

        def layers(hf_model: PreTrainedModel) -> list[nn.Module]:
            encoder = encoder_layers(hf_model)
            pooler = getattr(hf_model, "pooler", None)
            return [*encoder, PoolingHead(hf_model.config.hidden_size, num_labels or 1, pooling, pooler)]

        task = {"num_labels": num_labels, "pooling": pooling}
        super().__init__(model, layers, task, lr, weight_decay, attn_implementation, lora, adapter_name, dtype)
        self.num_labels = num_labels

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self._run_layers(input_ids, attention_mask, token_type_ids, position_ids)

    def _stand_in(self, name: str, input_ids: torch.Tensor) -> torch.Tensor:
        if name == "attention_mask":  # an encoder's mask has no other meaning
            return torch.ones_like(input_ids)
        if name == "token_type_ids":  # the embeddings' own default: all of the first type
            return torch.zeros_like(input_ids)
        raise ValueError(f"No stand-in for a missing `{name}`.")

    def _loss(self, batch: Any) -> torch.Tensor:
        fields, out = self._run_batch(batch)
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
        out = self._run_batch(batch)[1]
        return out.squeeze(-1) if self.num_labels is None else out
