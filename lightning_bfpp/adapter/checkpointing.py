"""Lightning's checkpoint hooks under the pipeline: which entries go where, and each replica's place in the data.

Lightning hands the strategy one checkpoint dict per rank (its ``state_dict`` and ``optimizer_states`` hold this
rank's shards) and expects one back on load. The files themselves — a ``torch.distributed.checkpoint`` folder
of layout-free tensors plus ``meta.pt`` — are :mod:`lightning_bfpp.engine.checkpoint`'s; what is Lightning's
here is the dict: which keys are tensors to shard, where the fit loop keeps the loaders' states (global rank 0's
dict holds only its own replica's, so every replica's is gathered into ``meta.pt``), and the names of
parameters tied across stages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn
from torch.optim import Optimizer

from lightning_bfpp.adapter._lightning_compat import attached_trainer, set_sampler_epoch
from lightning_bfpp.adapter.resumable_sampler import make_resumable
from lightning_bfpp.engine import checkpoint as files
from lightning_bfpp.engine.checkpoint import CURRENT_MODEL_STATE


@dataclass
class CheckpointPlace:
    """What a rank's checkpoint depends on: its place in the mesh, the whole model's parameter names (to read a
    one-device optimizer state), and the aliases of tied parameters (stored once, under the canonical name)."""

    data_parallel_rank: int
    data_parallel_size: int
    pipeline_rank: int
    is_global_zero: bool
    full_parameter_names: list[str] = field(default_factory=list)
    trained_parameter_names: list[str] = field(default_factory=list)
    aliases: Mapping[str, str] = field(default_factory=dict)


def parameter_names(module: nn.Module) -> tuple[list[str], list[str]]:
    """The whole model's parameter names and those that train, before the layers are split."""
    named = list(module.named_parameters())
    return [name for name, _ in named], [name for name, p in named if p.requires_grad]


def fit_loop_state(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """The fit loop's own entry of a Lightning checkpoint, where ``FitLoop.on_save_checkpoint`` keeps the
    training loaders' states (``"combined_loader"``); ``None`` in a weights-only checkpoint."""
    state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict")
    return state if isinstance(state, dict) else None


def save(
    checkpoint: dict[str, Any], path: Path, place: CheckpointPlace, write: Callable[..., None] = files.save
) -> None:
    """Write Lightning's ``checkpoint`` dict of this rank: its tensors sharded into the folder, the rest into
    ``meta.pt`` with every replica's loader states. ``write``: the engine's blocking save, or an asynchronous
    saver's (``engine.checkpoint.async_saving``)."""
    # with a weight-averaging callback, `state_dict` holds the averaged weights (what a consolidated checkpoint or
    # an export gives) and `current_model_state` the trained ones: both this rank's shards
    state = {files.MODEL_KEY: _canonical_only(checkpoint.pop("state_dict"), place.aliases)}
    if (current := checkpoint.pop(CURRENT_MODEL_STATE, None)) is not None:
        state[CURRENT_MODEL_STATE] = _canonical_only(current, place.aliases)
    for i, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
        state[files.optimizer_key(i)] = optimizer_state
    fit_state = fit_loop_state(checkpoint)
    loader_states = files.gather_loader_states(
        fit_state.get("combined_loader") if fit_state is not None else None,
        data_parallel_rank=place.data_parallel_rank,
        pipeline_rank=place.pipeline_rank,
        data_parallel_size=place.data_parallel_size,
        is_global_zero=place.is_global_zero,
    )
    if loader_states is not None:
        checkpoint[files.LOADER_STATES_KEY] = loader_states
    if place.aliases:  # stored once, under the canonical name: what `consolidate` adds back
        checkpoint[files.TIED_KEY] = dict(place.aliases)
    write(path, state, checkpoint, is_global_zero=place.is_global_zero)


def _canonical_only(state_dict: dict[str, Any], aliases: Mapping[str, str]) -> dict[str, Any]:
    """A tied parameter once, under its canonical name (a module's own ``state_dict`` has every copy)."""
    return {name: value for name, value in state_dict.items() if name not in aliases}


def load(
    path: Path,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    place: CheckpointPlace,
    *,
    strict: bool,
    weights_only: bool | None,
    warn: Callable[[str], None],
    averaged: nn.Module | None = None,
) -> dict[str, Any]:
    """Load a checkpoint (a folder from any layout, or a one-device file) into this rank's stages and
    optimizers; return the rest of Lightning's dict, with this replica's loader states in the fit loop's entry.

    ``averaged``: the module of a weight-averaging callback's average. A checkpoint saved with averaging then
    loads its averaged weights there and its trained ones into ``module``; without one, ``module`` takes the
    averaged weights (as on one device).

    ``weights_only`` as Lightning passes it (``None``: torch's default, ``True``), for every file of the
    checkpoint (see :func:`lightning_bfpp.engine.checkpoint.load`)."""
    loaded, warning = files.load(
        path,
        module,
        list(optimizers),
        strict=strict,
        weights_only=weights_only,
        full_parameter_names=place.full_parameter_names,
        trained_parameter_names=place.trained_parameter_names,
        aliases=place.aliases,
        averaged=averaged,
    )
    loaded.pop(files.TIED_KEY, None)
    loaded.pop(files.VERSIONS_KEY, None)
    if warning is not None:
        warn(warning)
    # each replica resumes its own place in the data (see engine.checkpoint.replica_loader_states)
    stored = loaded.pop(files.LOADER_STATES_KEY, None)
    fit_state = fit_loop_state(loaded)
    if fit_state is not None and fit_state.get("combined_loader"):
        states, warning = files.replica_loader_states(
            stored,
            fit_state["combined_loader"],
            data_parallel_rank=place.data_parallel_rank,
            data_parallel_size=place.data_parallel_size,
        )
        if warning is not None:
            warn(warning)
        if states is None:
            del fit_state["combined_loader"]
        else:
            fit_state["combined_loader"] = states
    return loaded


def resumable_loader(module: Any, dataloader: object) -> object:
    """``dataloader`` with its sampler set to the fit loop's epoch (the restored one after a resume), and a sampler
    Lightning wrapped made to resume in its epoch (see ``resumable_sampler``).

    Lightning creates a training loader's iterator, restoring a ``StatefulDataLoader``'s place in the epoch, before
    it sets the sampler's epoch for that epoch; a ``DistributedSampler`` (every data-parallel run has one) then
    still stands at epoch 0, and a resume in a later epoch read the rest of epoch 0's permutation instead of its
    own (under any multi-process strategy). Set here, when Lightning hands the loader to the strategy, the epoch is
    already the restored one; without a resume it is the one Lightning sets next anyway."""
    make_resumable(dataloader)
    trainer = attached_trainer(module) if module is not None else None
    if trainer is not None:
        set_sampler_epoch(dataloader, trainer.fit_loop.epoch_progress.current.processed)
    return dataloader
