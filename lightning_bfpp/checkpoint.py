"""Checkpoints that keep the module's own names and load under any pipeline or data-parallel layout.

A checkpoint is a ``torch.distributed.checkpoint`` (DCP) folder holding ``"model"`` (each parameter and
buffer under its fully-qualified name in the LightningModule) and ``"optimizer_<i>"`` (optimizer state
keyed by parameter name, via ``flatten_optimizer_state_dict``: torch's default optimizer state dict keys
param groups by list position, which is the same key with different contents on every pipeline rank, so
DCP would keep one rank's and lose the others'), plus ``meta.pt`` with everything else Lightning saves
(loops, callbacks, LR schedulers, hyper-parameters). DCP records global shapes, so a checkpoint written by
one layout is read by any other: each rank asks for the names of its own stages, in its own sharding.
The ``"model"`` key is the one Lightning's ``consolidate_checkpoint`` expects, so that tool turns the folder
into one ordinary checkpoint file.

Saving writes into ``<path>.tmp`` and swaps it in only after every rank has finished, so a crash while
saving leaves the previous checkpoint untouched.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_bfpp._compat import _METADATA_FILENAME

MODEL_KEY = "model"
_OPTIMIZER_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


def is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / _METADATA_FILENAME).is_file()


def model_state(module: nn.Module) -> dict[str, Any]:
    """This rank's parameters and buffers under their module names (DTensor shards, not gathered)."""
    return get_model_state_dict(module)


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's optimizer state, keyed by parameter name, so pipeline ranks never collide."""
    return get_optimizer_state_dict(module, optimizer, options=_OPTIMIZER_OPTIONS)


def save(
    path: Path,
    state: dict[str, Any],
    metadata: dict[str, Any],
    *,
    is_global_zero: bool,
    barrier: Callable[[], None],
) -> None:
    """Write ``state`` with DCP and ``metadata`` to ``meta.pt``, then atomically put the folder at ``path``."""
    staging = path.with_name(path.name + ".tmp")
    if is_global_zero and staging.exists():
        shutil.rmtree(staging)
    barrier()
    try:
        dcp.save(state, checkpoint_id=staging)
        if is_global_zero:
            torch.save(metadata, staging / _METADATA_FILENAME)
    except BaseException:
        # DCP reports a failed write on every rank, so every rank gets here; the old checkpoint is intact
        if is_global_zero:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    barrier()
    if is_global_zero:
        _swap_in(staging, path)
    barrier()


def _swap_in(staging: Path, path: Path) -> None:
    old = path.with_name(path.name + ".old")
    if old.exists():
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    if path.exists():
        path.rename(old)  # until the next line, the previous checkpoint is readable as <path>.old
    staging.rename(path)
    if old.exists():
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def checkpoint_keys(path: Path) -> set[str]:
    """The top-level keys stored in a DCP folder (``"model"``, ``"optimizer_0"``, …)."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    return {key.split(".", 1)[0] for key in metadata.state_dict_metadata}


def load_sharded(
    path: Path, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], *, strict: bool = True
) -> dict[str, Any]:
    """Load a DCP folder into this rank's stages and optimizer state; return ``meta.pt``'s contents."""
    stored = checkpoint_keys(path)
    if MODEL_KEY not in stored:
        raise RuntimeError(
            f"{path} holds no `model` entry; it was not written by BFPPStrategy or Lightning's FSDP strategies."
        )
    state: dict[str, Any] = {MODEL_KEY: model_state(module)}
    for i, optimizer in enumerate(optimizers):
        if optimizer_key(i) not in stored:
            raise KeyError(
                f"Trying to restore optimizer state but {path} holds none (saved with `save_weights_only=True`?);"
                " load it with `Trainer.validate/test`, or fit without `ckpt_path` after loading the weights."
            )
        state[optimizer_key(i)] = optimizer_state(module, optimizer)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(module, state[MODEL_KEY], options=StateDictOptions(strict=strict))
    for i, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(module, optimizer, state[optimizer_key(i)], options=_OPTIMIZER_OPTIONS)
    return torch.load(path / _METADATA_FILENAME, map_location="cpu", weights_only=False)


def load_full_weights(module: nn.Module, full_state: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
    """Copy full (single-device) tensors into this rank's parameters and buffers, slicing shards locally.

    Names of other ranks' layers are ignored; with ``strict``, every local name must be present.
    """
    own = module.state_dict()
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
) -> None:
    """Load a single-device optimizer state (``optimizer.state_dict()`` of the whole model) into this rank.

    torch keys such a state by parameter position; positions map to names through the whole model's
    parameter order, which is unambiguous for an optimizer with one parameter group over
    ``self.parameters()`` (the common case). Several groups are refused rather than guessed.
    """
    groups = saved["param_groups"]
    if len(groups) != 1 or len(optimizer.param_groups) != 1:
        raise RuntimeError(
            "Resuming a single-device checkpoint's optimizer state under BFPPStrategy is supported for one"
            f" parameter group; this one has {len(groups)}. Load the weights before fitting instead"
            " (`Net.load_from_checkpoint(path)` or `model.load_state_dict(...)`), or resume from a checkpoint"
            " saved by BFPPStrategy."
        )
    positions = groups[0]["params"]
    if len(positions) != len(full_parameter_names):
        raise RuntimeError(
            f"The checkpoint's optimizer covers {len(positions)} parameters, the model has"
            f" {len(full_parameter_names)}; it was saved for a different model."
        )
    by_name = {name: saved["state"].get(pos) for name, pos in zip(full_parameter_names, positions, strict=True)}
    local_names = {id(p): n for n, p in module.named_parameters()}
    names = [local_names[id(p)] for p in optimizer.param_groups[0]["params"]]
    hyper = {k: v for k, v in groups[0].items() if k != "params"}
    osd = {
        "state": {n: by_name[n] for n in names if by_name.get(n) is not None},
        "param_groups": [{**hyper, "params": names}],
    }
    set_optimizer_state_dict(module, optimizer, osd, options=StateDictOptions(full_state_dict=True))
