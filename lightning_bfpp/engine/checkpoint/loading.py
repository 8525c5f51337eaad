"""Loading a checkpoint into this rank's stages and optimizers, whatever layout wrote it.

A DCP folder records global shapes, so each rank asks for the names of its own stages, in its own sharding;
a one-device file is read whole and sliced (:mod:`lightning_bfpp.engine.checkpoint.one_device`). Both are
checked first (:mod:`lightning_bfpp.engine.checkpoint.checks`), and an optimizer state saved before the first
step, or without the group entries added since, loads as ``Optimizer.load_state_dict`` would load it on one
device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from lightning_bfpp.engine import _compat, agreement
from lightning_bfpp.engine.checkpoint.checks import (
    _EXPECTED,
    Shapes,
    _listed,
    check_full,
    check_sharded,
    local_shapes,
    read_index,
)
from lightning_bfpp.engine.checkpoint.errors import CheckpointError, _load_failure, raise_on_every_rank
from lightning_bfpp.engine.checkpoint.names import (
    _OPTIMIZER_OPTIONS,
    CURRENT_MODEL_STATE,
    METADATA_FILENAME,
    MODEL_KEY,
    from_canonical,
    optimizer_key,
    to_canonical,
)
from lightning_bfpp.engine.checkpoint.one_device import load_full_optimizer, load_full_weights
from lightning_bfpp.engine.checkpoint.saving import resolve_path
from lightning_bfpp.engine.checkpoint.unpickling import (
    _CheckedLoadPlanner,
    _CheckedWholePlanner,
    _read_metadata,
    load_metadata,
    reader,
    resolve_weights_only,
    torch_load,
)


def load(
    path: Path,
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    *,
    strict: bool,
    weights_only: bool | None = None,
    full_parameter_names: Sequence[str],
    trained_parameter_names: Sequence[str] | None = None,
    aliases: Mapping[str, str] | None = None,
    averaged: nn.Module | None = None,
) -> tuple[dict[str, Any], str | None]:
    """Load a checkpoint into this rank's stages and optimizers; return the rest of it and a warning, if any.

    ``averaged``: a module with ``module``'s names holding a running average of its weights. When the checkpoint
    has the trained weights beside the averaged ones (``CURRENT_MODEL_STATE``), they go into ``module`` and the
    averaged ones into ``averaged``; otherwise ``module`` takes the checkpoint's weights and ``averaged`` is left
    as it is.

    A collective. ``path`` is a DCP folder written by :func:`~lightning_bfpp.engine.checkpoint.saving.save` (or
    its ``.old``, see :func:`~lightning_bfpp.engine.checkpoint.saving.resolve_path`) or one ordinary file (e.g.
    from one device: each rank takes its slices). Every check runs on every rank with the same inputs and any
    failure is shared before the next step, so a bad checkpoint stops every rank with the same message and none
    waits for the others. ``aliases``: the tied parameters' other names (see :mod:`lightning_bfpp.engine.tied`),
    every copy being restored from the canonical entry.

    ``weights_only`` is Lightning's and ``torch.load``'s: ``None`` (Lightning's default) leaves it to torch,
    whose default is ``True``, and applies to every pickle of the checkpoint (``meta.pt``, a one-device file,
    DCP's ``.metadata`` and its non-tensor entries), so a checkpoint from elsewhere runs no code on load.
    ``False`` unpickles everything: the caller's choice, for a file it trusts.
    """
    aliases = aliases or {}
    context = f"BFPPStrategy could not load the checkpoint {path}"
    error: BaseException | None = None
    warning = None
    try:
        path, warning = resolve_path(path)
    except CheckpointError as failure:
        error = failure
    gathered = agreement.gather_outcomes(error, context, local_shapes(module, aliases))
    agreement.raise_shared([entry for entry, _ in gathered], error, CheckpointError)
    expected: Shapes = {name: shape for _, shapes in gathered for name, shape in shapes.items()}
    loaded: dict[str, Any] = {}
    try:
        if path.is_dir():
            check_sharded(path, expected, strict=strict, weights_only=weights_only)
            loaded = load_metadata(path, weights_only=weights_only)  # refused here, before any state changes
        else:
            loaded = _load_file(path, weights_only=weights_only)
            check_full(path, loaded["state_dict"], expected, strict=strict, aliases=aliases)
    except Exception as failure:  # shared with every rank below
        error = failure
    raise_on_every_rank(error, context)
    if path.is_dir():
        _load_sharded(
            path, module, optimizers, strict=strict, aliases=aliases, weights_only=weights_only, averaged=averaged
        )
        return loaded, warning
    try:
        if averaged is not None and CURRENT_MODEL_STATE in loaded:
            load_full_weights(module, loaded[CURRENT_MODEL_STATE], strict=strict, aliases=aliases)
            load_full_weights(averaged, loaded["state_dict"], strict=strict, aliases=aliases)
        else:
            load_full_weights(module, loaded["state_dict"], strict=strict, aliases=aliases)
        for optimizer, saved in zip(optimizers, loaded.get("optimizer_states", []), strict=False):
            load_full_optimizer(
                module,
                optimizer,
                saved,
                full_parameter_names,
                trained_parameter_names=trained_parameter_names,
                aliases=aliases,
            )
    except Exception as failure:  # shared with every rank below
        error = failure
    raise_on_every_rank(error, context)
    return loaded, warning


def _load_file(path: Path, *, weights_only: bool | None) -> dict[str, Any]:
    """A one-device checkpoint file, or one :class:`CheckpointError` saying what the file is instead."""
    where = f"BFPPStrategy cannot load {path}"
    if path.stat().st_size == 0:
        raise CheckpointError(
            f"{where}: it is an empty file (0 bytes): a save that was stopped, or a copy that failed. {_EXPECTED};"
            " resume from an earlier checkpoint."
        )
    try:
        loaded = torch_load(path, weights_only=weights_only, mmap=True)
    except CheckpointError:
        raise
    except Exception as error:  # whatever the file holds, the fix is the same
        raise CheckpointError(
            f"{where}: it is not a checkpoint (torch.load failed with {type(error).__name__}: {str(error)[:200]})."
            f" Pass a folder written by BFPPStrategy or a file from `trainer.save_checkpoint`."
        ) from None
    if not isinstance(loaded, dict) or "state_dict" not in loaded:
        if isinstance(loaded, dict) and loaded and all(isinstance(v, torch.Tensor) for v in loaded.values()):
            found = (
                f"tensors under {_listed(sorted(map(str, loaded)))}: a bare `state_dict`, not a Lightning checkpoint."
                " Load it into the module before `fit` (`model.load_state_dict(torch.load(path))`), or pass"
            )
        else:
            kind = (
                f"a dict of {_listed(sorted(map(str, loaded)))}" if isinstance(loaded, dict) else type(loaded).__name__
            )
            found = f"{kind}, no `state_dict` entry, so it is not a Lightning checkpoint. Pass"
        raise CheckpointError(
            f"{where}: it holds {found} a folder written by BFPPStrategy or a file from `trainer.save_checkpoint`."
        )
    return loaded


def _load_sharded(
    path: Path,
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    *,
    strict: bool,
    aliases: Mapping[str, str],
    weights_only: bool | None,
    averaged: nn.Module | None = None,
) -> None:
    index = _read_metadata(path, weights_only=weights_only).state_dict_metadata
    stored = {key.split(".", 1)[0] for key in index}
    targets = {MODEL_KEY: module}
    if averaged is not None and CURRENT_MODEL_STATE in stored:
        targets = {CURRENT_MODEL_STATE: module, MODEL_KEY: averaged}
    state: dict[str, Any] = {}
    model_keys = {}
    for key, target in targets.items():
        model = get_model_state_dict(target)
        if not strict:  # names the checked checkpoint lacks stay as they are
            prefix = key + "."
            names = {k[len(prefix) :] for k in index if k.startswith(prefix)}
            model = {name: value for name, value in model.items() if aliases.get(name, name) in names}
        # every copy of a tied parameter asks for the canonical entry (the only one stored)
        state[key], model_keys[key] = to_canonical(model, aliases)
    optimizer_keys = []
    live_states: dict[int, dict[str, Any]] = {}
    for i, optimizer in enumerate(optimizers):
        if optimizer_key(i) not in stored:
            raise CheckpointError(
                f"Trying to restore optimizer state but {path} holds none (saved with `save_weights_only=True`?);"
                " load it with `Trainer.validate/test`, or fit without `ckpt_path` after loading the weights."
            )
        if f"{optimizer_key(i)}.param_groups.0.params" in index:  # torch's layout: groups by position
            raise CheckpointError(
                f"BFPPStrategy cannot restore the optimizer state of {path}: `{optimizer_key(i)}` keys its parameter"
                " groups by position (`param_groups.0.params`), the layout of Lightning's FSDPStrategy; BFPPStrategy"
                " keys them by parameter name. Resume it under FSDPStrategy, or load its weights only"
                " (`Trainer.validate/test`, or fit without `ckpt_path` after loading them)."
            )
        if not optimizer.param_groups:  # nothing that trains on this rank: no state to read
            optimizer_keys.append(None)
            continue
        osd = get_optimizer_state_dict(module, optimizer, options=_OPTIMIZER_OPTIONS)
        request, keys = to_canonical(osd, aliases, optimizer=True)
        request, keys = _drop_unsaved_group_entries(optimizer, request, keys, index, optimizer_key(i))
        if not any(key.startswith(f"{optimizer_key(i)}.state.") for key in index):
            # saved before its first step (see optimizer_state): read the groups; the state is emptied after
            live_states[i] = {k: v for k, v in osd.items() if k.startswith("state.")}
            request = {k: v for k, v in request.items() if k.startswith("param_groups.")}
            keys = {key: canonical for key, canonical in keys.items() if canonical in request}
        state[optimizer_key(i)] = request
        optimizer_keys.append(keys)
    planner = _CheckedLoadPlanner() if resolve_weights_only(weights_only) else None
    try:
        dcp.load(state, storage_reader=reader(path, weights_only=weights_only), planner=planner)
    except CheckpointException as failure:  # raised on every rank alike, from the ranks' shared outcomes
        raise _load_failure(failure, path) from None
    for key, target in targets.items():
        set_model_state_dict(
            target, from_canonical(state[key], model_keys[key]), options=StateDictOptions(strict=strict)
        )
    for i, optimizer in enumerate(optimizers):
        if optimizer_keys[i] is None:
            continue
        osd = from_canonical(state[optimizer_key(i)], optimizer_keys[i])
        set_optimizer_state_dict(module, optimizer, {**live_states.get(i, {}), **osd}, options=_OPTIMIZER_OPTIONS)
        if i in live_states:  # as `Optimizer.load_state_dict` of a state saved before the first step
            optimizer.state.clear()


def _drop_unsaved_group_entries(
    optimizer: torch.optim.Optimizer,
    request: dict[str, Any],
    keys: dict[str, str],
    index: Mapping[str, Any],
    prefix: str,
) -> tuple[dict[str, Any], dict[str, str]]:
    """The load request and its keys without the parameter-group entries the checkpoint does not hold (an
    ``initial_lr`` that a scheduler added after the save, as Lightning's learning-rate finder does before restoring
    its checkpoint), each also removed from the optimizer's groups: DCP would ask for them and fail, while
    ``Optimizer.load_state_dict`` on one device replaces the groups with the saved ones, which drops them the same
    way."""
    unsaved = {key for key in request if key.startswith("param_groups.") and f"{prefix}.{key}" not in index}
    entries = {key.rsplit(".", 1)[1] for key in unsaved} - {"params"}
    if not entries:
        return request, keys
    for group in optimizer.param_groups:
        for entry in entries:
            group.pop(entry, None)
    dropped = {key for key in unsaved if key.rsplit(".", 1)[1] in entries}
    request = {k: v for k, v in request.items() if k not in dropped}
    return request, {key: canonical for key, canonical in keys.items() if canonical not in dropped}


def read_whole(folder: Path, *, weights_only: bool | None = None) -> dict[str, Any]:
    """A checkpoint folder read whole on one process, as saved (the weights under ``"model"``), with the entries
    of its ``meta.pt``: what Lightning's ``consolidate_checkpoint`` reads, with ``weights_only`` applied to every
    file (Lightning's reader unpickles ``.metadata`` and DCP's non-tensor entries in full)."""
    folder = Path(folder)
    read_index(folder, weights_only=weights_only)  # refused with the reason (a newer torch's index, no index, …)
    safe = resolve_weights_only(weights_only)
    planner = _CheckedWholePlanner() if safe else _compat.EmptyStateDictLoadPlanner()
    try:
        checkpoint = _compat.read_whole_dcp(reader(folder, weights_only=weights_only), planner)
    except CheckpointException as failure:
        raise _load_failure(failure, folder) from None
    if (folder / METADATA_FILENAME).is_file():
        checkpoint.update(load_metadata(folder, weights_only=weights_only))
    return checkpoint
