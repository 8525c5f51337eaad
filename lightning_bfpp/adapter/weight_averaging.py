"""Lightning's ``WeightAveraging`` callbacks (``EMAWeightAveraging`` among them) over the pipeline's stages.

The callback does three things with the model, and each needs the rank's stages rather than the whole model:

- at ``setup`` it deep-copies the LightningModule into an ``AveragedModel``. That runs before the strategy has
  placed the stages (a whole copy per rank; on a module built on the meta device, moving it to the device
  fails). The strategy skips that copy (:func:`defer_average_copies`, for callbacks that keep Lightning's own
  ``setup``) and, once its stages are placed and sharded, gives the callback a
  :class:`~lightning_bfpp.engine.averaging.LocalAveragedModel` of this rank's shards (:func:`attach_averages`).
  Everything else the callback does (updates after optimizer steps, swapping the weights for validation,
  copying them back when training ends, ``should_update``) then runs as Lightning wrote it, on local tensors.
- at save it puts the averaged weights under ``state_dict`` and the trained ones under ``current_model_state``:
  both are this rank's shards, stored in the distributed checkpoint (see :mod:`.checkpointing`).
- at load it reads them back from the checkpoint dict: the strategy has already loaded both in place, and hands
  the callback the live tensors (:func:`loaded_states`), so its own loading copies each onto itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MethodType
from typing import Any

import torch
from lightning.pytorch.callbacks import WeightAveraging
from torch import nn

from lightning_bfpp.adapter import _lightning_compat as lc
from lightning_bfpp.engine.averaging import LocalAveragedModel
from lightning_bfpp.engine.checkpoint import CURRENT_MODEL_STATE

# the callback's own state beside the averaged weights in a checkpoint dict (`n_averaged`)
AVERAGING_STATE = "averaging_state"


def averaging_callbacks(callbacks: Sequence[Any]) -> list[WeightAveraging]:
    return [c for c in callbacks if isinstance(c, WeightAveraging)]


def _setup_without_copy(self: WeightAveraging, trainer: Any, pl_module: Any, stage: str) -> None:
    """Lightning's ``WeightAveraging.setup`` copies the whole module; under the pipeline the strategy builds the
    average over the rank's stages at the end of its own setup instead (:func:`attach_averages`)."""


def defer_average_copies(callbacks: Sequence[Any]) -> None:
    """Before the callbacks' ``setup``: skip the whole-module copy of each averaging callback that keeps
    Lightning's ``setup`` (a subclass's own ``setup`` runs as written; its average is replaced all the same)."""
    for callback in averaging_callbacks(callbacks):
        if type(callback).setup is WeightAveraging.setup:
            callback.setup = MethodType(_setup_without_copy, callback)  # type: ignore[method-assign]


def restore_setup(callbacks: Sequence[Any]) -> None:
    """Give each averaging callback its class's ``setup`` back (the trainer may be used without the strategy)."""
    for callback in averaging_callbacks(callbacks):
        vars(callback).pop("setup", None)


def attach_averages(callbacks: Sequence[Any], module: nn.Module, device: torch.device) -> None:
    """When fitting starts, after the stages are placed: each averaging callback averages this rank's shards,
    from their current values (what Lightning's copy at ``setup`` holds on one device)."""
    for callback in averaging_callbacks(callbacks):
        where, use_buffers, kwargs = lc.averaging_arguments(callback)
        if where is not None and torch.device(where) == device:
            where = None
        lc.set_average_model(callback, LocalAveragedModel(module, device=where, use_buffers=use_buffers, **kwargs))


def average(callbacks: Sequence[Any]) -> LocalAveragedModel | None:
    """The average this rank keeps for the trainer's averaging callback, if there is one."""
    for callback in averaging_callbacks(callbacks):
        model = lc.average_model(callback)
        if isinstance(model, LocalAveragedModel):
            return model
    return None


def loaded_states(checkpoint: dict[str, Any], module: nn.Module, averaged: LocalAveragedModel) -> None:
    """After the strategy loaded a checkpoint in place: what the callback's ``on_load_checkpoint`` reads.

    A checkpoint saved with averaging: the averaged weights (``state_dict``) and the trained ones
    (``current_model_state``) as the tensors they were loaded into, so the callback's
    ``load_state_dict`` calls copy each onto itself. One saved without: ``state_dict`` is the module's
    weights, which the callback copies into the average, as on one device."""
    if AVERAGING_STATE in checkpoint:
        checkpoint["state_dict"] = averaged.module.state_dict()
        checkpoint[CURRENT_MODEL_STATE] = module.state_dict()
    else:
        checkpoint["state_dict"] = module.state_dict()
