"""Losses that are means over items (tokens, label positions), normalised over the global batch.

A step that averages its loss over a batch-dependent number of items — the token mean of a language model on
padded or packed sequences, a per-token regression — is a mean of means once the batch is cut into
micro-batches and spread over data-parallel replicas: every micro-batch weighs the same whatever its count.
One device divides one sum by one count. :func:`mean_over_items` lets a step say which sum and which count it
means, so :class:`~lightning_bfpp.BFPPStrategy` can do what one device does: backpropagate each micro-batch's
sum and divide the gradients (and the logged value) by the count over every micro-batch and replica of the
batch. Megatron-LM (``calculate_per_token_loss``) and torchtitan (global valid tokens) normalise the same way;
Hugging Face's Trainer passes ``num_items_in_batch`` for the same reason.

Called outside the strategy (one device, another strategy) it is simply ``loss_sum / num_items``: the step
stays single-device code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_ATTRIBUTE = "_bfpp_items"


@dataclass(frozen=True)
class ItemSum:
    """What a :func:`mean_over_items` loss is made of: the summed loss (with its graph) and the item count."""

    total: torch.Tensor
    count: torch.Tensor


def mean_over_items(loss_sum: torch.Tensor, num_items: int | torch.Tensor) -> torch.Tensor:
    """``loss_sum / num_items``, marked so that BFPPStrategy divides by the global batch's item count.

    ``loss_sum``: the loss summed over the items of this (micro-)batch, a scalar tensor; ``num_items``: how
    many items it sums (e.g. ``(labels != -100).sum()``). A batch with no items has loss 0 (and no gradient).
    Return the result from ``training_step`` (alone or as the ``"loss"`` of a dict), and log it with
    ``self.log``: under the strategy the gradients and the logged value are then the global batch's
    ``sum / count``, exactly as on one device, however the batch is cut into micro-batches and replicas.
    With ``accumulate_grad_batches`` each batch is normalised by its own count, as on one device.
    """
    if not isinstance(loss_sum, torch.Tensor) or loss_sum.numel() != 1:
        raise ValueError("mean_over_items: `loss_sum` must be a scalar tensor (the loss summed over the items).")
    count = torch.as_tensor(num_items, device=loss_sum.device).detach().reshape(())
    mean = loss_sum.reshape(()) / count.to(loss_sum.dtype).clamp(min=1)
    setattr(mean, _ATTRIBUTE, ItemSum(loss_sum.reshape(()), count.to(torch.float64)))
    return mean


def item_sum(value: object) -> ItemSum | None:
    """The sum and count behind a :func:`mean_over_items` result, or None for any other value."""
    return getattr(value, _ATTRIBUTE, None) if isinstance(value, torch.Tensor) else None


class BatchGradients:
    """Normalises one batch's gradients by its item count without touching what earlier batches accumulated.

    A :func:`mean_over_items` step backpropagates each micro-batch's *sum*; the global count is known only
    after the step's last loss, on the last stages, and reaches every rank with the step's one collective —
    after the backward. The gradients are then multiplied by ``replicas / count`` (the data-parallel
    reduction already divided by ``replicas``). Under gradient accumulation that multiplication must not
    reach the earlier batches of the window, each normalised by its own count as on one device, so their
    gradients are set aside before the batch and added back after it (:meth:`set_aside`, :meth:`finish`):
    one extra reference per parameter, and each batch's gradients reduced over the replicas on their own.
    """

    def __init__(self, parameters: list[torch.nn.Parameter]) -> None:
        self.parameters = parameters
        self._saved: list[torch.Tensor | None] | None = None

    def set_aside(self) -> None:
        """Take the accumulated gradients off the parameters (the batch's backward starts from none)."""
        self._saved = [p.grad for p in self.parameters]
        for p in self.parameters:
            p.grad = None

    def finish(self, factor: float | None) -> None:
        """Multiply this batch's gradients by ``factor`` (None: leave them), then add back what was set aside."""
        saved, self._saved = self._saved, None
        if factor is not None and factor != 1.0:
            for p in self.parameters:
                if p.grad is not None:
                    p.grad.mul_(factor)
        if saved is None:
            return
        for p, grad in zip(self.parameters, saved, strict=True):
            if grad is not None:
                p.grad = grad if p.grad is None else p.grad.add_(grad)
