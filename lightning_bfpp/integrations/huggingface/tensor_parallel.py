"""Tensor parallelism from the model's own plan: ``transformers``' tensor-parallel styles as torch's parallel styles,
and each pipeline layer's part of the plan.

Its own module because it is the only part of the adapter that runs collectives (two styles of its own whose
backward or forward sums over the tensor group), and it is used only when ``tensor_parallel_size > 1``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_bfpp.engine import _compat
from lightning_bfpp.engine.tensor_regions import SumGradient, SumOutputs
from lightning_bfpp.integrations.huggingface.blocks import CausalEmbedding, CausalLMHead, DecoderBlock
from lightning_bfpp.integrations.huggingface.lora import _split_with_base

if TYPE_CHECKING:
    from lightning_bfpp.integrations.huggingface.modules import _HFPipelineModule


# `transformers`' tensor-parallel styles this adapter applies, as torch's parallel styles (``transformers``
# registers the same layouts in its ``ALL_PARALLEL_STYLES``)
_TP_STYLES = (
    "colwise", "rowwise", "colwise_gather_output", "colwise_rep", "rowwise_split_input", "rowwise_rep",
    "embedding_rowwise", "embedding_colwise", "replicated_with_grad_allreduce",
)  # fmt: skip


class VocabParallelEmbedding(ParallelStyle):
    """``embedding_rowwise``: an ``nn.Embedding`` split by vocabulary rows over the tensor group, as Megatron-LM's
    ``VocabParallelEmbedding``. Each rank looks up the ids its rows hold (zeros for the others) and the partial
    lookups are summed. Written here rather than taken from torch's ``RowwiseParallel`` on an embedding, whose
    backward hands the weight a gradient replicated over the group: a whole vocabulary × hidden table per rank
    (2 GiB in fp32 for 128K × 4096), where this one's gradient is the rank's rows only. A padding id's row keeps a
    zero gradient on the rank that holds it, as on one device."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor

        plain = isinstance(module, nn.Embedding) and module.max_norm is None and not module.scale_grad_by_freq
        if not plain or module.sparse:
            raise ValueError(
                "BFPPStrategy: `embedding_rowwise` splits a dense `nn.Embedding` without `max_norm` or"
                f" `scale_grad_by_freq`; got"
                f" {module!r}. Pass `parallelize_fn=` with a plan of your own."
            )
        size, rank = device_mesh.size(), device_mesh.get_local_rank()
        if module.num_embeddings % size:  # torch's Shard(0) would give the ranks unequal rows, found at wrong ids
            raise ValueError(
                f"BFPPStrategy: `embedding_rowwise` over {size} tensor ranks needs a vocabulary that {size} divides;"
                f" the embedding has {module.num_embeddings} rows. Pad the vocabulary or choose another tensor size."
            )
        rows = module.num_embeddings // size
        first = rank * rows
        pad = module.padding_idx
        local_pad = pad - first if pad is not None and first <= pad < first + rows else None
        weight = module.weight
        module.weight = nn.Parameter(
            distribute_tensor(weight.detach(), device_mesh, [Shard(0)]), requires_grad=weight.requires_grad
        )
        group = device_mesh.get_group()

        def forward(ids: torch.Tensor) -> torch.Tensor:
            table = module.weight
            local = table.to_local() if isinstance(table, DTensor) else table  # its gradient: this rank's rows
            outside = (ids < first) | (ids >= first + rows)
            found = F.embedding((ids - first).masked_fill(outside, 0), local, local_pad)
            return SumOutputs.apply(found.masked_fill(outside.unsqueeze(-1), 0.0), group)

        module.forward = forward  # type: ignore[method-assign]
        return module


class GradientsSummedOverTensorGroup(ParallelStyle):
    """``replicated_with_grad_allreduce``: a module whole on every tensor rank that sees only the rank's share
    of its input, as Qwen 3's per-head q/k norms see the heads of a column-wise projection. Its forward needs
    no collective, but each rank's gradient covers only its heads: the parameters' gradients are summed over
    the tensor group. The module's forward runs with each parameter passed through an identity whose backward
    all-reduces (``transformers`` does the same with its ``_AllReduceBackward``); whatever holds the parameter
    (FSDP2's unsharded copy during a step) gets the summed gradient and shards it as any other."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        group = device_mesh.get_group()
        forward = module.forward

        def summed_forward(*args: Any, **kwargs: Any) -> Any:
            params = {name: SumGradient.apply(p, group) for name, p in module.named_parameters(recurse=False)}
            with _compat.parameters_replaced(module, params):
                return forward(*args, **kwargs)

        module.forward = summed_forward  # type: ignore[method-assign]
        return module


def _tp_style(kind: str) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    whole = Replicate()
    return {
        "colwise": lambda: ColwiseParallel(),  # output split by heads / units, for the row-wise layer after it
        "rowwise": lambda: RowwiseParallel(),  # partial sums all-reduced
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=whole),  # e.g. the logits, gathered
        "colwise_rep": lambda: ColwiseParallel(output_layouts=whole),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=whole),  # a whole input, split here
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=whole),
        # vocabulary-parallel: each rank looks up the ids in its rows of the table, the partial lookups are summed
        "embedding_rowwise": VocabParallelEmbedding,
        "embedding_colwise": lambda: ColwiseParallel(input_layouts=whole, output_layouts=whole),
        "replicated_with_grad_allreduce": GradientsSummedOverTensorGroup,
    }[kind]()


def tensor_parallel_plan(module: _HFPipelineModule, layer: nn.Module, size: int) -> dict[str, Any]:
    """``layer``'s part of the model's own tensor-parallel plan (``config.base_model_tp_plan`` and the LM class's
    ``_tp_plan``, as :func:`~lightning_bfpp.integrations.huggingface._compat.model_tp_plan` resolves them), as
    ``parallelize_module`` takes it: paths inside the layer mapped to torch's parallel styles.

    Column-wise projections (q, k, v, gate, up) split their outputs, so each tensor rank computes
    ``heads / size`` attention heads (the model's attention reshapes by ``head_dim``, not by the head count) and
    ``intermediate_size / size`` MLP units; row-wise ones (o, down) all-reduce partial sums, so a block's output
    is whole on every tensor rank and crosses to the next stage as a plain tensor. ``colwise_gather_output`` (the
    LM head) gathers the logits; ``embedding_rowwise`` (the token embedding, which ``transformers`` ≥ 5 adds to
    every plan) splits the vocabulary: each rank looks up the ids its rows hold and the lookups are summed.
    Qwen 3's per-head q/k norms (``replicated_with_grad_allreduce``) stay whole with their gradients summed over
    the group (:class:`GradientsSummedOverTensorGroup`). A projection with LoRA adapters splits its base layer by
    the plan and its adapters with it (see :func:`~lightning_bfpp.integrations.huggingface.lora._split_with_base`).
    Refused, naming the entry: a style this adapter does not
    apply (packed or expert-parallel layouts, sequence parallelism), a model without a plan, sizes that ``size``
    does not divide.
    """
    config = module.hf_config
    plan = module._tensor_plan
    if not any(k.startswith("model.layers.") for k in plan):
        raise ValueError(
            f"BFPPStrategy(tensor_parallel_size={size}): the `{config.model_type}` model declares no tensor-parallel"
            " plan for its decoder layers (`config.base_model_tp_plan`); pass `parallelize_fn=` to the strategy"
            " with your own `parallelize_module` plan, or train without tensor parallelism."
        )
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = getattr(config, field, None)
        if isinstance(value, int) and value % size:
            raise ValueError(
                f"BFPPStrategy: tensor_parallel_size={size} does not divide the model's `{field}` ({value}): each"
                f" tensor rank would hold a different share. Choose a tensor size that divides {value}."
            )
    if isinstance(layer, DecoderBlock):
        prefix, target = "model.layers.*.", "layer."
    elif isinstance(layer, CausalLMHead):
        prefix, target = "", ""
    elif isinstance(layer, CausalEmbedding):
        prefix, target = "model.", ""
    else:
        raise ValueError(
            f"BFPPStrategy: tensor parallelism from the model's plan covers decoder-only causal LMs with rotary"
            f" positions (`{type(layer).__name__}` layers have no plan here); pass `parallelize_fn=` to the strategy."
        )
    styles = {}
    for key, kind in plan.items():
        if not key.startswith(prefix) or (prefix == "" and key.startswith("model.")):
            continue
        path = target + key[len(prefix) :]
        try:
            target_module = layer.get_submodule(path)
        except AttributeError:
            continue  # e.g. the embedding's entry seen from the head
        if kind not in _TP_STYLES:
            raise ValueError(
                f"BFPPStrategy: the `{config.model_type}` model's tensor-parallel plan asks `{kind}` for `{key}`,"
                f" which this adapter does not apply (it applies {', '.join(_TP_STYLES)}); pass `parallelize_fn=`"
                " to the strategy with a plan of your own, or train without tensor parallelism."
            )
        with_lora = _split_with_base(target_module, path, kind, _tp_style, size)
        styles.update(with_lora if with_lora is not None else {path: _tp_style(kind)})
    return styles
