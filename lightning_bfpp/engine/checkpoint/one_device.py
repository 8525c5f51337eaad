"""A one-device checkpoint file's weights and optimizer state, sliced into this rank's stages.

Such a file holds every full tensor, and an optimizer state keyed by parameter position (torch's, from
``trainer.save_checkpoint`` under another strategy) or by parameter name (a BFPPStrategy folder consolidated into
one file, by ``python -m lightning_bfpp.consolidate`` or Lightning's tool); each rank takes the names of its own
stages and their shards of the tensors, without communication.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor


def load_full_weights(
    module: nn.Module,
    full_state: Mapping[str, torch.Tensor],
    *,
    strict: bool = True,
    aliases: Mapping[str, str] | None = None,
) -> None:
    """Copy full (single-device) tensors into this rank's parameters and buffers, slicing shards locally.

    Names of other ranks' layers are ignored; with ``strict``, every local name must be present. A tied
    parameter's copy missing under its own name is read from its canonical name.
    """
    aliases = aliases or {}
    own = module.state_dict()
    full_state = {**{a: full_state[c] for a, c in aliases.items() if c in full_state}, **full_state}
    missing = [name for name in own if name not in full_state]
    if strict and missing:
        listed = ", ".join(missing[:5]) + (" …" if len(missing) > 5 else "")
        raise RuntimeError(f"The checkpoint lacks {len(missing)} of this rank's tensors: {listed}")
    with torch.no_grad():
        for name, target in own.items():
            if name not in full_state:
                continue
            source = full_state[name].to(device=target.device, dtype=target.dtype)
            if isinstance(target, DTensor):
                # every rank holds the full tensor: slice locally (src_data_rank=None), no communication
                shard = distribute_tensor(source, target.device_mesh, target.placements, src_data_rank=None)
                target.to_local().copy_(shard.to_local())
            else:
                target.copy_(source)


def load_full_optimizer(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    saved: Mapping[str, Any],
    full_parameter_names: Sequence[str],
    *,
    trained_parameter_names: Sequence[str] | None = None,
    aliases: Mapping[str, str] | None = None,
) -> None:
    """Load a single-device optimizer state (``optimizer.state_dict()`` of the whole model) into this rank.

    torch keys such a state by parameter position; positions map to names through the whole model's
    parameter order, which is unambiguous for an optimizer with one parameter group over ``self.parameters()``
    (the common case) or over the parameters that train (``trained_parameter_names``: LoRA's and frozen layers'
    usual optimizer). Several groups are refused rather than guessed. A tied parameter's copies all take the
    state stored for it, under its canonical name.
    """
    aliases = aliases or {}
    if not optimizer.param_groups:  # nothing that trains on this rank
        return
    if is_keyed_by_name(saved):
        _load_named_optimizer(module, optimizer, saved, aliases)
        return
    groups = saved["param_groups"]
    if len(groups) != 1 or len(optimizer.param_groups) != 1:
        raise RuntimeError(
            "Resuming a single-device checkpoint's optimizer state under BFPPStrategy is supported for one"
            f" parameter group; this one has {len(groups)}. Load the weights before fitting instead"
            " (`Net.load_from_checkpoint(path)` or `model.load_state_dict(...)`), or resume from a checkpoint"
            " saved by BFPPStrategy."
        )
    positions = groups[0]["params"]
    # an optimizer over every parameter, or over those that train (`AdamW(p for p in ... if p.requires_grad)`,
    # LoRA's and frozen layers' usual optimizer), both in the module's parameter order
    names = full_parameter_names
    if len(positions) != len(names) and trained_parameter_names is not None:
        names = trained_parameter_names
    if len(positions) != len(names):
        trained = "" if trained_parameter_names is None else f" ({len(trained_parameter_names)} that train)"
        raise RuntimeError(
            f"The checkpoint's optimizer covers {len(positions)} parameters, the model has"
            f" {len(full_parameter_names)}{trained}; it was saved for a different model."
        )
    by_name = {name: saved["state"].get(pos) for name, pos in zip(names, positions, strict=True)}
    by_name.update({alias: by_name.get(canonical) for alias, canonical in aliases.items()})
    local_names = {id(p): n for n, p in module.named_parameters()}
    names = [local_names[id(p)] for p in optimizer.param_groups[0]["params"]]
    hyper = {k: v for k, v in groups[0].items() if k != "params"}
    # two local copies of a tied parameter must not share state tensors (each is updated in place)
    states = {n: _cloned(by_name[n]) if n in aliases else by_name[n] for n in names if by_name.get(n) is not None}
    osd = {
        "state": states,
        "param_groups": [{**hyper, "params": names}],
    }
    set_optimizer_state_dict(module, optimizer, osd, options=StateDictOptions(full_state_dict=True))


def is_keyed_by_name(saved: Mapping[str, Any]) -> bool:
    """Whether an optimizer state is keyed by parameter name (``state.<name>.<key>``, ``param_groups.<name>.<key>``):
    what a BFPPStrategy folder stores (see :mod:`~lightning_bfpp.engine.checkpoint.names`), and so what a file
    consolidated from one holds, by this package's tool or Lightning's; torch's own is keyed by position."""
    return "param_groups" not in saved and all(
        isinstance(key, str) and key.startswith(("state.", "param_groups.")) for key in saved
    )


def _load_named_optimizer(
    module: nn.Module, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any], aliases: Mapping[str, str]
) -> None:
    """Load an optimizer state keyed by parameter name (:func:`is_keyed_by_name`) into this rank's optimizer: each
    local parameter takes the entries stored under its (canonical) name, whatever layout or group split wrote
    them; each group's settings are its first parameter's, as torch's ``flatten_optimizer_state_dict`` reads
    them. A state saved before the first step holds group entries only and leaves the optimizer without state,
    as ``Optimizer.load_state_dict`` on one device does."""
    states: dict[str, dict[str, Any]] = {}
    settings: dict[str, dict[str, Any]] = {}
    for key, value in saved.items():
        kind, _, rest = key.partition(".")
        name, _, entry = rest.rpartition(".")
        (states if kind == "state" else settings).setdefault(name, {})[entry] = value
    local_names = {id(p): n for n, p in module.named_parameters()}
    groups, state, missing = [], {}, []
    for group in optimizer.param_groups:
        names = [local_names[id(p)] for p in group["params"]]
        stored = [aliases.get(n, n) for n in names]
        missing += [n for n in stored if n not in settings]
        if missing:
            continue
        groups.append({**settings[stored[0]], "params": names})
        for name, canonical in zip(names, stored, strict=True):
            if canonical in states:  # a tied parameter's copies must not share state tensors
                state[name] = _cloned(states[canonical]) if name in aliases else states[canonical]
    if missing:
        raise RuntimeError(
            f"The checkpoint's optimizer state has no entry for {', '.join(missing[:5])}"
            f"{' …' if len(missing) > 5 else ''}: it was saved for a different model, or an optimizer over other"
            " parameters."
        )
    set_optimizer_state_dict(
        module, optimizer, {"state": state, "param_groups": groups}, options=StateDictOptions(full_state_dict=True)
    )
    if not states:  # saved before the first step: torch filled a state on zero gradients; one device has none
        optimizer.state.clear()


def _cloned(state: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
