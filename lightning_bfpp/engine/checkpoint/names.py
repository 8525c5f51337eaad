"""The names a checkpoint stores things under, so that any layout finds them.

The top-level entries (``"model"``, ``"optimizer_<i>"``) and ``meta.pt``'s own entries are fixed here, as is
what a rank saves: its parameters and buffers under their names in the module, and its optimizer state keyed
by parameter name (``flatten_optimizer_state_dict``: torch's default optimizer state dict keys param groups by
list position, which is the same key with different contents on every pipeline rank, so DCP would keep one
rank's and lose the others').

A parameter tied across pipeline stages (see :mod:`lightning_bfpp.engine.tied`) has one copy per stage; it is stored
once, under its canonical name (the owner's, the name a one-device model's ``named_parameters()`` reports),
for its value and its optimizer state, and every copy is restored from that entry. ``aliases`` (every other
name of such a parameter -> its canonical name) says which names those are; :func:`to_canonical` and
:func:`from_canonical` turn a rank's names into the stored ones and back.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

MODEL_KEY = "model"
# the trained weights beside MODEL_KEY where MODEL_KEY holds a running average of them: Lightning's name under its
# WeightAveraging callbacks, for the folder's entry as for a one-device file's (so Lightning's consolidation keeps it)
CURRENT_MODEL_STATE = "current_model_state"
# Lightning's name for the non-tensor part (`lightning.fabric.utilities.load._METADATA_FILENAME`, checked in
# tests/unit/test_checkpoint_files.py); its consolidate tool reads it
METADATA_FILENAME = "meta.pt"
# meta.pt's entry holding every data-parallel replica's data-loader states
LOADER_STATES_KEY = "bfpp_loader_states"
# meta.pt's entry naming the tied parameters' other names and their canonical names
TIED_KEY = "bfpp_tied_parameters"
# meta.pt's entry naming the releases that wrote the checkpoint (torch's DCP index format changes between releases),
# and the same as a JSON file beside it: readable by any torch without unpickling anything
VERSIONS_KEY = "bfpp_versions"
VERSIONS_FILENAME = "bfpp_versions.json"


def written_by() -> dict[str, str]:
    """The releases a checkpoint written now records (:data:`VERSIONS_KEY`): torch's, whose DCP index an older
    torch may not read, and this package's. (Lightning records its own as ``pytorch-lightning_version``.)"""
    from importlib.metadata import PackageNotFoundError, version

    try:
        package = version("lightning-bfpp")
    except PackageNotFoundError:  # run from a source tree that was never installed
        package = "unknown"
    return {"torch": str(torch.__version__), "lightning_bfpp": package}  # str: torch's own is a str subclass


_OPTIMIZER_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


def is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / METADATA_FILENAME).is_file()


def model_state(module: nn.Module, aliases: Mapping[str, str] | None = None) -> dict[str, Any]:
    """This rank's parameters and buffers under their module names (DTensor shards, not gathered); a tied
    parameter's other names (``aliases``) are left out: its owner stores it under the canonical name."""
    state = get_model_state_dict(module)
    return {k: v for k, v in state.items() if k not in aliases} if aliases else state


def optimizer_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, aliases: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """This rank's optimizer state, keyed by parameter name, so pipeline ranks never collide (tied copies'
    other names left out, as in :func:`model_state`). Empty for an optimizer without parameter groups (a rank
    whose stages hold nothing that trains, :class:`~lightning_bfpp.engine.frozen.NothingToTrain`)."""
    if not optimizer.param_groups:
        return {}
    before_first_step = not optimizer.state
    state = get_optimizer_state_dict(module, optimizer, options=_OPTIMIZER_OPTIONS)
    if before_first_step:
        # torch fills a stateless optimizer's state with a step on zero gradients (`_init_optim_state`): SGD's
        # momentum from weight decay, Adam's step count 1. One device saves no state before the first step and
        # its next step starts from none: so here too, in the checkpoint and in the optimizer (see loading.py)
        optimizer.state.clear()
        state = {k: v for k, v in state.items() if not k.startswith("state.")}
    if not aliases:
        return state
    return {k: v for k, v in state.items() if _optimizer_key_fqn(k)[1] not in aliases}


def _optimizer_key_fqn(key: str) -> tuple[str, str, str]:
    """A flattened optimizer key ``state.<fqn>.<name>`` / ``param_groups.<fqn>.<name>`` as its three parts."""
    kind, _, rest = key.partition(".")
    fqn, _, name = rest.rpartition(".")
    return kind, fqn, name


def _canonical_key(key: str, aliases: Mapping[str, str], *, optimizer: bool) -> str:
    if not optimizer:
        return aliases.get(key, key)
    kind, fqn, name = _optimizer_key_fqn(key)
    return f"{kind}.{aliases[fqn]}.{name}" if fqn in aliases else key


def to_canonical(
    state: Mapping[str, Any], aliases: Mapping[str, str], *, optimizer: bool = False
) -> tuple[dict[str, Any], dict[str, str]]:
    """A load request under canonical names, and each original key's key in it.

    Several local names of one tied parameter (a copy on each of two local stages, or the owner's and a copy)
    become one entry, read once; :func:`from_canonical` hands the loaded value back to each of them.
    """
    request: dict[str, Any] = {}
    keys = {}
    for key, value in state.items():
        canonical = _canonical_key(key, aliases, optimizer=optimizer)
        keys[key] = canonical
        request.setdefault(canonical, value)
    return request, keys


def from_canonical(request: Mapping[str, Any], keys: Mapping[str, str]) -> dict[str, Any]:
    """The loaded ``request`` under the original keys; a value shared by several keys is cloned for each but
    the first, so that no two parameters (or optimizer states) end up sharing a tensor."""
    state: dict[str, Any] = {}
    used: set[str] = set()
    for key, canonical in keys.items():
        value = request[canonical]
        if canonical in used and isinstance(value, torch.Tensor):
            value = value.clone()
        used.add(canonical)
        state[key] = value
    return state


def with_tied_names(state_dict: dict[str, Any], aliases: Mapping[str, str]) -> dict[str, Any]:
    """Add each tied parameter's other names, pointing to the canonical entry's tensor (stored once by
    ``torch.save``): what a one-device tied model's ``load_state_dict(strict=True)`` expects."""
    for alias, canonical in aliases.items():
        if alias not in state_dict and canonical in state_dict:
            state_dict[alias] = state_dict[canonical]
    return state_dict
