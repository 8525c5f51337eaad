"""What a model costs per layer: compute time, parameter bytes, activation bytes. Pure.

A :class:`ModelProfile` lists per-layer costs for micro-batches of ``microbatch_size`` samples; the planner
scales times and activation sizes linearly to other micro-batch sizes (an assumption: accelerators run
very small micro-batches less efficiently than linear scaling says, so profile at the size you plan for). Profiles
come from a JSON file, from :func:`gpt` (an analytic transformer model, for planning at scale), from
:func:`uniform`, or from measuring a LightningModule on this machine (:mod:`lightning_bfpp.measure.profile`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path

from lightning_bfpp.plan.partition import balance_by_weight


@dataclass(frozen=True)
class LayerCost:
    """One layer, for one micro-batch of the profile's size.

    ``output_bytes`` is what it hands the next layer (sent between pipeline ranks at a stage boundary);
    ``saved_bytes`` what it keeps for its backward (activation memory); ``param_bytes`` its weights.
    ``activation_bytes`` is what its backward needs when nothing is recomputed (``None``: ``saved_bytes``):
    under activation recomputation ``saved_bytes`` is only the layer's input, while a recomputed forward
    briefly holds ``activation_bytes`` again (weight passing recomputes whole chunks, so it needs this).
    ``backward_weight_s`` is the part of ``backward_s`` that computes weight gradients, which a zero-bubble
    schedule runs as its own ``W`` action after the input gradient ``I`` (``None``: half of ``backward_s``, as
    for a matrix product, whose two gradients cost the same); schedules with a whole backward use ``backward_s``.
    ``tensor_parallel_all_reduces``: how many all-reduces of the layer's output a tensor-parallel split of it
    costs per forward (as many again in its backward: Megatron's attention and MLP, 2 per block); 0: the layer
    is not split, every tensor rank computes it whole. ``tensor_parallel_saved_bytes``: the part of its
    activations that a split shards over the tensor group (the rest, norms' and residuals' inputs, stays whole).
    ``measured_split``: ``t > 1`` if the layer was measured already split over a tensor group of ``t``
    (:mod:`lightning_bfpp.measure.profile` with ``parallelize``): its times, bytes and activations are one
    rank's share, its times without the all-reduces, which are still charged as the cluster prices them.
    ``intermediate_grad_bytes``: what a split backward's input-gradient pass keeps for the weight pass beyond the
    saved activations (torch's ``stage_backward_input`` keeps the gradients of the intermediate outputs that feed
    the layer's weights), held from the ``I`` to the ``W``; 0 where not measured.
    """

    forward_s: float
    backward_s: float
    param_bytes: int
    output_bytes: int
    saved_bytes: int
    activation_bytes: int | None = None
    backward_weight_s: float | None = None
    tensor_parallel_all_reduces: int = 0
    tensor_parallel_saved_bytes: int = 0
    measured_split: int = 1
    intermediate_grad_bytes: int = 0
    backward_input_s: float | None = None

    @property
    def full_activation_bytes(self) -> int:
        return self.saved_bytes if self.activation_bytes is None else self.activation_bytes

    @property
    def weight_grad_s(self) -> float:
        """Time of the weight-gradient part of the backward (a ``W`` action)."""
        return self.backward_s / 2 if self.backward_weight_s is None else self.backward_weight_s

    @property
    def input_grad_s(self) -> float:
        """Time of the input-gradient part of the backward (an ``I`` action), recomputation included."""
        return self.backward_s - self.weight_grad_s if self.backward_input_s is None else self.backward_input_s

    def scaled(self, factor: float) -> LayerCost:
        return LayerCost(
            self.forward_s * factor,
            self.backward_s * factor,
            self.param_bytes,
            int(self.output_bytes * factor),
            int(self.saved_bytes * factor),
            None if self.activation_bytes is None else int(self.activation_bytes * factor),
            None if self.backward_weight_s is None else self.backward_weight_s * factor,
            self.tensor_parallel_all_reduces,
            int(self.tensor_parallel_saved_bytes * factor),
            self.measured_split,
            int(self.intermediate_grad_bytes * factor),
            None if self.backward_input_s is None else self.backward_input_s * factor,
        )

    def split_over_tensor_group(self, size: int, all_reduce_s: Callable[[int], float]) -> LayerCost:
        """What one rank of a tensor group of ``size`` pays for this layer: ``1/size`` of its compute and
        weights, the all-reduces of its output (``all_reduce_s(nbytes)``, in the forward and in the input
        gradient), and its activations less the sharded part's ``(size − 1)/size``. A layer that is not split
        costs every rank as much as before. A layer measured split (``measured_split``) only gains its
        all-reduces, and only at the size it was measured at."""
        if self.measured_split > 1:
            if size != self.measured_split:
                raise ValueError(
                    f"a layer measured split over {self.measured_split} tensor ranks cannot be planned at"
                    f" tensor_parallel_size={size}; measure the model at that size"
                )
            comm = self.tensor_parallel_all_reduces * all_reduce_s(self.output_bytes)
            return replace(
                self, forward_s=self.forward_s + comm, backward_s=self.backward_s + comm, measured_split=1,
                backward_weight_s=self.weight_grad_s, tensor_parallel_all_reduces=0,
                backward_input_s=None if self.backward_input_s is None else self.backward_input_s + comm,
            )  # fmt: skip
        if size == 1 or self.tensor_parallel_all_reduces == 0:
            return self
        comm = self.tensor_parallel_all_reduces * all_reduce_s(self.output_bytes)
        shard = self.tensor_parallel_saved_bytes * (size - 1) // size
        full = self.full_activation_bytes
        # kept whole (no recomputation), the saved activations shrink; kept as the block input only, they do not
        saved = self.saved_bytes - shard if self.saved_bytes >= full else self.saved_bytes
        return LayerCost(
            self.forward_s / size + comm,
            self.backward_s / size + comm,
            self.param_bytes // size,
            self.output_bytes,
            max(saved, 0),
            None if self.activation_bytes is None else max(full - shard, 0),
            self.weight_grad_s / size,
            # the weighted operations' output gradients are split as their outputs are (an approximation: a
            # row-parallel output is whole)
            intermediate_grad_bytes=self.intermediate_grad_bytes // size,
            backward_input_s=None if self.backward_input_s is None else self.backward_input_s / size + comm,
        )


@dataclass(frozen=True)
class ModelProfile:
    layers: tuple[LayerCost, ...]
    microbatch_size: int = 1
    name: str = "model"
    # optimizer state per byte of parameters (fp32 Adam: two moments = 2.0; SGD with momentum: 1.0)
    optimizer_state_ratio: float = 2.0
    # time of the optimizer update per parameter byte held (memory-bound elementwise update)
    optimizer_s_per_byte: float = 0.0
    # whether each layer's backward_s already includes recomputing its forward (activation recomputation);
    # weight passing always recomputes, and adds forward_s to backward_s where this is False
    recompute: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    def at_microbatch_size(self, size: int) -> list[LayerCost]:
        factor = size / self.microbatch_size
        return [layer.scaled(factor) for layer in self.layers]

    def to_json(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @staticmethod
    def from_json(path: Path) -> ModelProfile:
        raw = json.loads(Path(path).read_text())
        raw["layers"] = tuple(LayerCost(**layer) for layer in raw["layers"])
        return ModelProfile(**raw)


def uniform(
    num_layers: int,
    forward_s: float,
    backward_s: float,
    param_bytes: int,
    output_bytes: int,
    saved_bytes: int | None = None,
    microbatch_size: int = 1,
    **kwargs: object,
) -> ModelProfile:
    """``num_layers`` identical layers."""
    layer = LayerCost(
        forward_s, backward_s, param_bytes, output_bytes, output_bytes if saved_bytes is None else saved_bytes
    )
    return ModelProfile(tuple([layer] * num_layers), microbatch_size=microbatch_size, **kwargs)  # type: ignore[arg-type]


def gpt(
    num_layers: int,
    hidden: int,
    sequence: int,
    vocab: int,
    *,
    flops_per_second: float,
    microbatch_size: int = 1,
    bytes_per_value: int = 2,
    recompute: bool = False,
    flash_attention: bool = False,
    name: str = "gpt",
) -> ModelProfile:
    """A GPT decoder as pipeline layers: embedding, ``num_layers`` transformer blocks, output head.

    Compute from the standard counts (Narayanan et al. 2021): a block's forward is
    ``24·s·h² + 4·s²·h`` FLOPs per sequence, its backward twice that; the head ``2·s·h·V``.
    ``flops_per_second`` is the sustained rate (peak × achieved utilisation). Activation memory per block
    and sequence is ``s·h·(34 + 5·a·s/h)`` bytes in half precision (Korthikanti et al. 2022) with ``a = h/128``
    heads; with ``recompute`` only the block input (``2·s·h`` bytes) is kept (the full amount is still
    recorded as ``activation_bytes``, what a recomputed forward holds for a moment). ``flash_attention``
    drops the ``5·a·s/h`` term (the attention scores, softmax and dropout mask, which FlashAttention does
    not store), leaving ``34·s·h`` bytes per block and sequence.
    """
    s, h, b, v = sequence, hidden, microbatch_size, vocab
    heads = max(1, h // 128)
    block_flops = b * (24 * s * h * h + 4 * s * s * h)
    block_params = 12 * h * h + 13 * h
    full = int(b * s * h * (34 + (0 if flash_attention else 5 * heads * s / h)))
    saved = 2 * s * h * b if recompute else full
    boundary = bytes_per_value * b * s * h
    extra = block_flops / flops_per_second if recompute else 0.0  # one more forward in backward
    # the backward's two halves, input and weight gradients, cost a forward each; a recomputation precedes the first
    # split over a tensor group (Megatron's, no sequence parallelism): two all-reduces of the block's output per
    # forward and per backward; all activations but the norms' and residuals' inputs (10·s·h bytes) are sharded
    block = LayerCost(block_flops / flops_per_second, 2 * block_flops / flops_per_second + extra,
                      block_params * bytes_per_value, boundary, saved, full,
                      backward_weight_s=block_flops / flops_per_second,
                      tensor_parallel_all_reduces=2, tensor_parallel_saved_bytes=full - 10 * s * h * b)  # fmt: skip
    embed = LayerCost(0.0, 0.0, (v + s) * h * bytes_per_value, boundary, boundary)
    head_flops = 2 * b * s * h * v
    head = LayerCost(head_flops / flops_per_second, 2 * head_flops / flops_per_second, v * h * bytes_per_value,
                     b * s * v * 4, b * s * v * 4 + boundary)  # fmt: skip
    return ModelProfile((embed, *([block] * num_layers), head), microbatch_size=b, name=name, recompute=recompute)


def stage_costs(layers: Sequence[LayerCost], counts: Sequence[int]) -> list[LayerCost]:
    """Sum layer costs into stage costs (a stage's output is its last layer's)."""
    stages = []
    start = 0
    for count in counts:
        run = layers[start : start + count]
        stages.append(
            LayerCost(
                forward_s=sum(layer.forward_s for layer in run),
                backward_s=sum(layer.backward_s for layer in run),
                param_bytes=sum(layer.param_bytes for layer in run),
                output_bytes=run[-1].output_bytes,
                saved_bytes=sum(layer.saved_bytes for layer in run),
                activation_bytes=sum(layer.full_activation_bytes for layer in run),
                backward_weight_s=(
                    None
                    if all(layer.backward_weight_s is None for layer in run)
                    else sum(layer.weight_grad_s for layer in run)
                ),
                intermediate_grad_bytes=sum(layer.intermediate_grad_bytes for layer in run),
                backward_input_s=(
                    None
                    if all(layer.backward_input_s is None for layer in run)
                    else sum(layer.input_grad_s for layer in run)
                ),
            )
        )
        start += count
    return stages


def balanced_counts(weights: Sequence[int], num_stages: int) -> tuple[int, ...]:
    """:func:`~lightning_bfpp.plan.partition.balance_by_weight`, remembered: a search asks for the same cut of the
    same layers for thousands of configurations, and the exact partition is quadratic in the layers."""
    return _balanced_counts(tuple(weights), num_stages)


@lru_cache(maxsize=1024)
def _balanced_counts(weights: tuple[int, ...], num_stages: int) -> tuple[int, ...]:
    return tuple(balance_by_weight(weights, num_stages))
