"""Pipeline ranks whose stages hold no parameter that trains.

With LoRA on some layers, or layers frozen by hand, a pipeline rank can hold only frozen weights (an embedding
and a head, frozen). The user's ``configure_optimizers`` then builds its optimizer over an empty list
(``AdamW(p for p in self.parameters() if p.requires_grad)``) and torch refuses it, on that rank alone — the
failure DeepSpeed users report with empty optimizer groups. The rank still runs its stages' forward and
backward (the gradients flow through frozen layers to the trained ones); it has nothing to update.
:class:`NothingToTrain` stands in for its optimizer: no parameter groups, an empty state, and a ``step`` that
runs the closure, so Lightning's loop, clipping and checkpoints run unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["NothingToTrain", "holds_trained_parameters", "is_empty_parameter_list", "set_up_unless_all_frozen"]


def holds_trained_parameters(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def is_empty_parameter_list(error: BaseException) -> bool:
    """Whether ``error`` is torch's refusal of an optimizer over no parameters."""
    return isinstance(error, ValueError) and "empty parameter list" in str(error)


def set_up_unless_all_frozen(set_up: Callable[[], Any], module: nn.Module) -> bool:
    """Run the user's optimizer set-up; False where it refused an empty parameter list because this rank's
    layers hold no parameter that trains (then :class:`NothingToTrain` stands in). Any other error is raised."""
    try:
        set_up()
    except ValueError as error:
        if holds_trained_parameters(module) or not is_empty_parameter_list(error):
            raise
        return False
    return True


class NothingToTrain(torch.optim.Optimizer):
    """The optimizer of a rank with no parameter that trains: no parameter groups, no state; ``step`` runs the
    closure (the rank's part of the pipeline step) and updates nothing."""

    def __init__(self) -> None:
        # torch's constructor refuses an empty list: build with a placeholder, then hold no group at all
        super().__init__([torch.zeros(0, requires_grad=True)], {})
        self.param_groups = []
        self.state.clear()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def __repr__(self) -> str:
        return "NothingToTrain (this pipeline rank's stages hold no parameter that trains)"
