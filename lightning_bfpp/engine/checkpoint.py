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
saving leaves the previous checkpoint untouched; a process killed between the swap's two renames leaves it
as ``<path>.old``, which loading then falls back to (see :func:`resolve_path`). Every step that can fail on
some ranks only (rank 0 writing ``meta.pt``, a file that one rank cannot read) shares its outcome with the
other ranks before anyone goes on, so all ranks raise the same :class:`CheckpointError` instead of some
waiting forever in the next collective. A checkpoint is checked against the module before anything is
loaded: its files must be complete and its names and global shapes must be the module's.

A parameter tied across pipeline stages (see :mod:`lightning_bfpp.engine.tied`) has one copy per stage; it is stored
once, under its canonical name (the owner's, the name a one-device model's ``named_parameters()`` reports),
for its value and its optimizer state, and every copy is restored from that entry. ``aliases`` (every other
name of such a parameter -> its canonical name) says which names those are. ``meta.pt`` records them, so
that :func:`consolidate` writes a file holding both names, as a one-device tied model's ``state_dict`` does.

Data-loader states (torchdata's ``StatefulDataLoader``) differ between data-parallel replicas, since each
reads its own share of the data; ``meta.pt`` keeps one per replica (:func:`gather_loader_states`) and each
replica gets its own back (:func:`replica_loader_states`).

This module is the engine side: it does not import Lightning; the strategy passes in what it needs.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import io
import os
import pathlib
import pickle
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_bfpp.engine import _compat, agreement
from lightning_bfpp.engine.agreement import AgreedError, describe

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
_OPTIMIZER_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_LISTED = 6  # names shown per kind of mismatch


class CheckpointError(AgreedError):
    """A checkpoint cannot be written or read; raised on every rank at the same point, with the same message
    (an agreed error: the failure watchdog does not treat it as one rank's crash)."""


def optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


def is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / METADATA_FILENAME).is_file()


# -- reading without running code -------------------------------------------------------------------
#
# A checkpoint is pickles: `meta.pt` and a one-device file (torch.save), DCP's `.metadata` index and its non-tensor
# entries (an optimizer's `lr`, `betas`). Unpickling can call any function the file names, so a checkpoint from
# elsewhere could run code. `weights_only` means here what it means to Lightning and `torch.load`: `None` is
# torch's default (`True` since torch 2.6), `True` admits tensors, plain Python values and the types torch allows,
# `False` unpickles everything (the caller trusts the file). torch.load applies it to the files it reads; DCP
# reads `.metadata` with plain `pickle.load` and its non-tensor entries with `weights_only=False` whatever the
# caller asked, so with `weights_only` those are checked here before DCP reads them.

_TRUE = ("1", "y", "yes", "true")
_WEIGHTS_ONLY_FIX = (
    "If you trust this checkpoint, allow those types with `torch.serialization.add_safe_globals([...])`, or load"
    " it with `weights_only=False`; under `trainer.fit/validate/test` set `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`"
    " instead (Lightning 2.6 does not pass their `weights_only` on to a strategy that restores after setup)."
)


def resolve_weights_only(weights_only: bool | None) -> bool:
    """What ``torch.load(..., weights_only=weights_only)`` does: ``None`` is ``True`` (torch's default since 2.6),
    and torch's ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` / ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` override it as there.
    For the files torch.load does not read (DCP's), so that one setting covers the whole checkpoint."""
    if os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE:
        return True
    if weights_only is None:
        return os.getenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() not in _TRUE
    return bool(weights_only)


def _unsafe_globals(file: Path | IO[bytes]) -> list[str]:
    """The functions and classes a ``torch.save`` file names that ``weights_only=True`` refuses (read, not run)."""
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(file)
    except Exception:  # not a torch.save zip: torch's own message is all there is
        return []


def torch_load(file: Path, *, weights_only: bool | None, mmap: bool = False) -> Any:
    """``torch.load(file)`` on the CPU, ``weights_only`` as Lightning passes it; a file that ``weights_only``
    refuses raises one :class:`CheckpointError` naming the types in it and the fix, not torch's traceback."""
    try:
        return torch.load(file, map_location="cpu", weights_only=weights_only, mmap=mmap)
    except pickle.UnpicklingError as error:
        if "weights only" not in str(error).lower():  # a corrupt file, not a refusal
            raise
        names = _unsafe_globals(file)
        found = f"`{'`, `'.join(names)}`" if names else f"a type it does not admit ({str(error).splitlines()[0]})"
        raise CheckpointError(
            f"BFPPStrategy did not load {file} with `weights_only=True` (torch's default, which Lightning keeps"
            f" when `weights_only` is not given): it holds {found}, and unpickling that could run code from the"
            f" file. {_WEIGHTS_ONLY_FIX}"
        ) from None


def _dcp_metadata_global(module: str, name: str) -> Any:
    """The object a ``.metadata`` pickle may name: DCP's own dataclasses and enums (inert to build), torch's
    sizes, dtypes and layouts, and paths (the checkpoint id); ``None`` for anything else. Only modules already
    imported are looked in: a file never makes this import anything."""
    if module.startswith("torch.distributed.checkpoint."):
        found = getattr(sys.modules.get(module), name, None)
        if dataclasses.is_dataclass(found) or (isinstance(found, type) and issubclass(found, enum.Enum)):
            return found
        return None
    if module == "torch":
        found = getattr(torch, name, None)
        return found if found is torch.Size or isinstance(found, (torch.dtype, torch.layout)) else None
    if (module, name) == ("torch.serialization", "_get_layout"):  # how a torch.layout pickles
        return getattr(torch.serialization, name)
    if module == "pathlib" and name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
        return getattr(pathlib, name)
    if (module, name) == ("collections", "OrderedDict"):
        return collections.OrderedDict
    return None


class _RefusedGlobal(pickle.UnpicklingError):
    """A name in a pickle that :func:`_dcp_metadata_global` does not admit."""


class _MetadataUnpickler(pickle.Unpickler):
    """Python's documented way to restrict what a pickle may call ("Restricting Globals")."""

    def find_class(self, module: str, name: str) -> Any:
        found = _dcp_metadata_global(module, name)
        if found is None:
            raise _RefusedGlobal(f"{module}.{name}")
        return found


class _Reader(dcp.FileSystemReader):
    """DCP's reader, with ``weights_only``: the ``.metadata`` pickle must name only what DCP writes there
    before DCP unpickles it (the index is small: read once to check, once by DCP)."""

    def __init__(self, path: Path, *, weights_only: bool) -> None:
        super().__init__(path)
        self.checked = weights_only

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if self.checked:
            rank = kwargs.get("rank")
            file = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
            try:
                with open(file, "rb") as stream:
                    _MetadataUnpickler(stream).load()
            except _RefusedGlobal as refused:
                raise CheckpointError(
                    f"BFPPStrategy did not load {file.parent} with `weights_only=True` (torch's default, which"
                    f" Lightning keeps when `weights_only` is not given): its `.metadata` names `{refused}`, which"
                    " is not a type torch.distributed.checkpoint writes there, and unpickling it could run code"
                    f" from the file. {_WEIGHTS_ONLY_FIX}"
                ) from None
        return super().read_metadata(*args, **kwargs)


class _CheckedBytes:
    """A DCP load planner whose non-tensor entries must load with ``weights_only=True`` before DCP unpickles them
    (it does so with ``weights_only=False``)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        data = value.getvalue()
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError:
            names = _unsafe_globals(io.BytesIO(data))
            found = f"`{'`, `'.join(names)}`" if names else "a type `weights_only=True` does not admit"
            raise CheckpointError(
                f"BFPPStrategy did not load the entry {read_item.dest_index.fqn} of the checkpoint with"
                f" `weights_only=True` (torch's default, which Lightning keeps when `weights_only` is not given):"
                f" it holds {found}, and unpickling that could run code from the file. {_WEIGHTS_ONLY_FIX}"
            ) from None
        super().load_bytes(read_item, io.BytesIO(data))  # type: ignore[misc]


class _CheckedLoadPlanner(_CheckedBytes, DefaultLoadPlanner):
    pass


class _CheckedWholePlanner(_CheckedBytes, _compat.EmptyStateDictLoadPlanner):
    pass


def reader(path: Path, *, weights_only: bool | None) -> dcp.FileSystemReader:
    """DCP's reader of ``path``, refusing a ``.metadata`` that names more than DCP writes unless ``weights_only``
    resolves to ``False`` (:func:`resolve_weights_only`)."""
    return _Reader(path, weights_only=resolve_weights_only(weights_only))


def _read_metadata(path: Path, *, weights_only: bool | None) -> Any:
    return reader(path, weights_only=weights_only).read_metadata()


def load_metadata(path: Path, *, weights_only: bool | None) -> dict[str, Any]:
    """``meta.pt`` of the checkpoint folder ``path`` (Lightning's non-tensor state), as ``weights_only`` allows."""
    try:
        loaded = torch_load(path / METADATA_FILENAME, weights_only=weights_only)
    except CheckpointError:
        raise
    except Exception as error:  # cut short, or not a torch.save file: the fix is the same
        raise CheckpointError(
            f"BFPPStrategy cannot load the checkpoint {path}: its {METADATA_FILENAME} is unreadable"
            f" ({type(error).__name__}: {str(error)[:200]}); the folder is truncated or corrupt. Copy it again from"
            " where it was written, or resume from an earlier checkpoint."
        ) from None
    if not isinstance(loaded, dict):
        raise CheckpointError(
            f"BFPPStrategy cannot load the checkpoint {path}: its {METADATA_FILENAME} holds a"
            f" {type(loaded).__name__}, not the dict of Lightning's state that BFPPStrategy writes there."
        )
    return loaded


def read_whole(folder: Path, *, weights_only: bool | None = None) -> dict[str, Any]:
    """A checkpoint folder read whole on one process, as saved (the weights under ``"model"``), with the entries
    of its ``meta.pt``: what Lightning's ``consolidate_checkpoint`` reads, with ``weights_only`` applied to every
    file (Lightning's reader unpickles ``.metadata`` and DCP's non-tensor entries in full)."""
    folder = Path(folder)
    safe = resolve_weights_only(weights_only)
    planner = _CheckedWholePlanner() if safe else _compat.EmptyStateDictLoadPlanner()
    try:
        checkpoint = _compat.read_whole_dcp(reader(folder, weights_only=weights_only), planner)
    except CheckpointException as failure:
        raise _load_failure(failure, folder) from None
    if (folder / METADATA_FILENAME).is_file():
        checkpoint.update(load_metadata(folder, weights_only=weights_only))
    return checkpoint


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
        # its next step starts from none: so here too, in the checkpoint and in the optimizer (see _load_sharded)
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


# -- every rank raises together ---------------------------------------------------------------------


def raise_on_every_rank(error: BaseException | None, context: str) -> None:
    """A collective: if any rank passes an error, every rank raises one :class:`CheckpointError` naming that
    rank (:func:`lightning_bfpp.engine.agreement.raise_on_every_rank`)."""
    agreement.raise_on_every_rank(error, context, CheckpointError)


# -- saving ------------------------------------------------------------------------------------------


def save(path: Path, state: dict[str, Any], metadata: dict[str, Any], *, is_global_zero: bool) -> None:
    """Write ``state`` with DCP and ``metadata`` to ``meta.pt``, then atomically put the folder at ``path``.

    A collective. ``meta.pt`` is written by global rank 0 only, after every rank's tensors are on disk, and
    its failure (or the swap's) reaches every rank through :func:`raise_on_every_rank`; before, rank 0
    raised alone and the others waited in the next barrier forever.

    A failed save removes its staging folder ``<path>.tmp`` before any rank raises. DCP raises a failed write
    (one rank's full disk) on every rank at once; re-raised as it was, it reached Lightning on every rank as one
    rank's crash, and the first rank to report it had the failure watchdog (or the launcher) stop every other
    process, global rank 0 included, possibly before it had removed the staging folder: a race that left
    ``<path>.tmp`` behind on a busy machine. Now every rank waits in :func:`raise_on_every_rank` until rank 0 has
    cleaned up, then raises the same agreed :class:`CheckpointError`, which stops nobody. A process killed
    outright (SIGKILL, a lost node) can still leave ``<path>.tmp``; nothing reads it: loading reads ``path``
    (or ``<path>.old``, :func:`resolve_path`), Lightning's ``ModelCheckpoint`` lists only ``*.ckpt`` names, and
    the next save at ``path`` removes it first.
    """
    staging = path.with_name(path.name + ".tmp")
    context = f"BFPPStrategy could not save the checkpoint {path}; the previous one there is unchanged"
    error: BaseException | None = None
    if is_global_zero:
        try:  # left over by a save that was killed
            _remove(staging)
        except Exception as failure:  # shared with every rank below
            error = failure
    raise_on_every_rank(error, context)
    try:
        dcp.save(state, checkpoint_id=staging)
    except CheckpointException as failure:  # DCP raises it on every rank, from the ranks' shared outcomes
        error = CheckpointError(f"{context}: {_dcp_failures(failure)}")
        if is_global_zero:
            _discard(staging)
    except BaseException:  # this rank's own interruption (KeyboardInterrupt): the others are not here to wait
        if is_global_zero:
            _discard(staging)
        raise
    raise_on_every_rank(error, context)  # every rank waits here until rank 0 has removed the staging folder
    if is_global_zero:
        try:
            _write_metadata(metadata, staging / METADATA_FILENAME)
            context = f"BFPPStrategy could not put the new checkpoint in place at {path}"  # the swap may be half done
            _swap_in(staging, path)
        except Exception as failure:  # shared with every rank below
            error = failure
            _discard(staging)
    raise_on_every_rank(error, context)


def _dcp_failures(failure: CheckpointException) -> str:
    """DCP's failure as one line: the first failing rank, the others named, and its error (not the tracebacks
    DCP's own message holds)."""
    failures = sorted(failure.failures.items())
    if not failures:
        return describe(failure)
    (rank, (error, _)), others = failures[0], [r for r, _ in failures[1:]]
    also = f" (and on rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))})" if others else ""
    return f"rank {rank} failed{also}: {describe(error)}"


def _load_failure(failure: CheckpointException, path: Path) -> CheckpointError:
    """DCP's failure to read ``path`` as one :class:`CheckpointError`: a refused entry's own message, as it is."""
    refused = [error for error, _ in failure.failures.values() if isinstance(error, CheckpointError)]
    if refused:
        return CheckpointError(str(refused[0]))
    return CheckpointError(f"BFPPStrategy could not load the checkpoint {path}: {_dcp_failures(failure)}")


def _discard(path: Path) -> None:
    """Remove a staging folder, as far as possible: a failed save is reported as such, not as this."""
    shutil.rmtree(path, ignore_errors=True)


def _write_metadata(metadata: dict[str, Any], file: Path) -> None:
    torch.save(metadata, file)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _old(path: Path) -> Path:
    return path.with_name(path.name + ".old")


def _swap_in(staging: Path, path: Path) -> None:
    """Replace ``path`` by ``staging`` with two renames; at every instant a complete checkpoint exists.

    A folder cannot replace a non-empty folder in one rename, so the previous checkpoint is moved to
    ``<path>.old`` first; a process killed between the renames leaves it there, and :func:`resolve_path` reads
    it. When ``path`` is missing (that kill happened before), ``<path>.old`` is the only complete checkpoint
    and is kept until the new one is in place.
    """
    old = _old(path)
    if path.exists():
        _remove(old)  # ``path`` is complete, so an older ``.old`` is not needed
        path.rename(old)  # until the next line, the previous checkpoint is readable as <path>.old
    staging.rename(path)
    try:
        _remove(old)
    except Exception as failure:  # the new checkpoint is in place: say so
        raise CheckpointError(
            f"BFPPStrategy saved the checkpoint {path}, but could not remove the previous one beside it,"
            f" {old.name} ({describe(failure)}); the next save at this path removes it, or remove it yourself."
        ) from failure


def resolve_path(path: Path) -> tuple[Path, str | None]:
    """The checkpoint to read for ``path``, and a warning when it is the one an interrupted save replaced.

    Only a swap killed between its two renames leaves ``<path>.old`` without ``path``; ``.old`` is then the
    previous checkpoint, complete. (``<path>.tmp`` may hold a newer, complete one, but nothing records that
    every rank finished it; the next save discards it.)
    """
    if path.exists():
        return path, None
    old = _old(path)
    if is_sharded_checkpoint(old):
        return old, (
            f"BFPPStrategy: {path} does not exist, but {old.name} beside it does: a save that replaced it was"
            f" interrupted between its two renames. Resuming from {old}, the previous checkpoint (complete);"
            " the next save at this path replaces it."
        )
    raise CheckpointError(f"BFPPStrategy cannot load {path}: it does not exist (nor {old.name} beside it).")


# -- checking a checkpoint against the module --------------------------------------------------------

Shapes = dict[str, tuple[int, ...] | None]


def local_shapes(module: nn.Module, aliases: Mapping[str, str] | None = None) -> Shapes:
    """Global shapes of this rank's parameters and buffers (a DTensor's ``shape`` is the global one), a tied
    parameter's copies under its canonical name."""
    aliases = aliases or {}
    return {
        aliases.get(name, name): tuple(t.shape) if isinstance(t, torch.Tensor) else None
        for name, t in get_model_state_dict(module).items()
    }


def _listed(items: Sequence[str]) -> str:
    return ", ".join(items[:_LISTED]) + (f", … ({len(items)} in all)" if len(items) > _LISTED else "")


def _name_problems(stored: Shapes, expected: Shapes, *, strict: bool) -> list[str]:
    problems = []
    if strict:
        if missing := sorted(set(expected) - set(stored)):
            problems.append(f"it lacks the module's {_listed(missing)}")
        if unexpected := sorted(set(stored) - set(expected)):
            problems.append(f"it holds {_listed(unexpected)}, which the module does not have")
    mismatched = [
        f"{name} {list(stored[name])} vs {list(shape)}"  # type: ignore[arg-type]
        for name, shape in sorted(expected.items())
        if name in stored and shape is not None and stored[name] is not None and stored[name] != shape
    ]
    if mismatched:
        problems.append(f"shapes differ (checkpoint vs module): {_listed(mismatched)}")
    return problems


_OTHER_MODEL = (
    " It was saved from a different model: resume with this model's checkpoint, or load the weights that match"
    " yourself (with `strict_loading = False` on the module, names may be missing or extra, but shapes must match)."
)


_EXPECTED = (
    "BFPPStrategy loads a folder it wrote itself (`trainer.save_checkpoint`, `ModelCheckpoint`) or a one-device"
    " checkpoint file (`trainer.save_checkpoint` under another strategy)"
)


def _listed_files(path: Path) -> str:
    return _listed(sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir()))


def _no_index(path: Path, where: str) -> CheckpointError:
    """The error for a folder without DCP's ``.metadata``, saying what it holds instead."""
    entries = list(path.iterdir())
    if not entries:
        return CheckpointError(
            f"{where}: it is an empty folder, not a checkpoint (the wrong path, or a save that was stopped before"
            f" it wrote anything). {_EXPECTED}."
        )
    if any(p.suffix == ".distcp" for p in entries):
        return CheckpointError(
            f"{where}: it holds torch.distributed.checkpoint data files but no `.metadata`, which DCP writes after"
            " every rank's data: the save did not finish, or this is an incomplete copy. Copy it again from"
            " where it was written, or resume from an earlier checkpoint."
        )
    return CheckpointError(
        f"{where}: it has no `.metadata`, so it is not a torch.distributed.checkpoint folder; it holds"
        f" {_listed_files(path)}. {_EXPECTED}."
    )


def check_sharded(path: Path, expected: Shapes, *, strict: bool, weights_only: bool | None = None) -> None:
    """Refuse a DCP folder that is incomplete, foreign or was saved from another model, before anything is read.

    Every rank passes the same folder and the whole module's ``expected`` shapes, so every rank raises the
    same error. DCP would otherwise fail inside its collective load with a per-rank message (an unreadable
    file) or a missing-key message that names no shape. ``weights_only`` (see :func:`resolve_weights_only`):
    whether ``.metadata`` may name more than DCP writes there.
    """
    where = f"BFPPStrategy cannot load the checkpoint {path}"
    try:
        metadata = _read_metadata(path, weights_only=weights_only)
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise _no_index(path, where) from None
    except Exception as error:  # any unpickling error means the same
        raise CheckpointError(
            f"{where}: its `.metadata` is unreadable ({type(error).__name__}: {error}); the folder is truncated"
            " or corrupt. Copy it again from where it was written, or resume from an earlier checkpoint."
        ) from None
    keys = {key.split(".", 1)[0] for key in metadata.state_dict_metadata}
    if MODEL_KEY not in keys:
        if "state_dict" in keys:
            raise CheckpointError(
                f"{where}: its weights are under `state_dict`, not `{MODEL_KEY}`: the layout of Lightning's"
                f" ModelParallelStrategy, not BFPPStrategy's. {_EXPECTED}; resume this one under"
                " ModelParallelStrategy, or load its weights into the module before `fit`."
            )
        raise CheckpointError(
            f"{where}: it holds {_listed(sorted(keys)) or 'no entries'} and no `{MODEL_KEY}` entry, so it was not"
            f" written by BFPPStrategy (nor by Lightning's FSDPStrategy). {_EXPECTED}."
        )
    problems = []
    if not (path / METADATA_FILENAME).is_file():
        problems.append(
            f"{METADATA_FILENAME} (Lightning's loop, callback and scheduler state, written last; a folder that"
            " torch.distributed.checkpoint wrote alone has none) is missing"
        )
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    missing_files, short_files = [], []
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            missing_files.append(name)
        elif (have := file.stat().st_size) < size:
            short_files.append(f"{name} ({have} of at least {size} bytes)")
    if missing_files:
        problems.append(f"data files missing: {_listed(missing_files)}")
    if short_files:
        problems.append(f"data files cut short: {_listed(short_files)}")
    if problems:
        raise CheckpointError(
            f"{where}: the folder is incomplete: {'; '.join(problems)}. It was copied or written only in part;"
            " copy it again from where it was written, or resume from an earlier checkpoint."
        )
    prefix = MODEL_KEY + "."
    stored: Shapes = {
        key[len(prefix) :]: tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(prefix)
    }
    if problems := _name_problems(stored, expected, strict=strict):
        raise CheckpointError(f"{where}: {'; '.join(problems)}.{_OTHER_MODEL}")


def check_full(
    path: Path,
    state_dict: Mapping[str, Any],
    expected: Shapes,
    *,
    strict: bool,
    aliases: Mapping[str, str] | None = None,
) -> None:
    """Refuse a single-file checkpoint saved from another model (names, shapes), on every rank alike.

    A one-device tied model's file holds a tied parameter under each of its names; they count as the canonical
    one."""
    aliases = aliases or {}
    stored: Shapes = {
        aliases.get(name, name): tuple(t.shape) if isinstance(t, torch.Tensor) else None
        for name, t in state_dict.items()
    }
    if problems := _name_problems(stored, expected, strict=strict):
        raise CheckpointError(f"BFPPStrategy cannot load the checkpoint {path}: {'; '.join(problems)}.{_OTHER_MODEL}")


def checkpoint_keys(path: Path, *, weights_only: bool | None = None) -> set[str]:
    """The top-level keys stored in a DCP folder (``"model"``, ``"optimizer_0"``, …)."""
    metadata = _read_metadata(path, weights_only=weights_only)
    return {key.split(".", 1)[0] for key in metadata.state_dict_metadata}


# -- loading -----------------------------------------------------------------------------------------


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

    A collective. ``path`` is a DCP folder written by :func:`save` (or its ``.old``, see
    :func:`resolve_path`) or one ordinary file (e.g. from one device: each rank takes its slices). Every
    check runs on every rank with the same inputs and any failure is shared before the next step, so a bad
    checkpoint stops every rank with the same message and none waits for the others. ``aliases``: the tied
    parameters' other names (see :mod:`lightning_bfpp.engine.tied`), every copy being restored from the canonical entry.

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
        _drop_unsaved_group_entries(optimizer, module, index, optimizer_key(i), aliases)
        osd = get_optimizer_state_dict(module, optimizer, options=_OPTIMIZER_OPTIONS)
        request, keys = to_canonical(osd, aliases, optimizer=True)
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
    module: nn.Module,
    index: Mapping[str, Any],
    prefix: str,
    aliases: Mapping[str, str],
) -> None:
    """Remove the parameter-group entries the checkpoint does not hold (an ``initial_lr`` that a scheduler added
    after the save, as Lightning's learning-rate finder does before restoring its checkpoint): DCP would ask
    for them and fail, while ``Optimizer.load_state_dict`` on one device replaces the groups with the saved
    ones, which drops them the same way."""
    osd = get_optimizer_state_dict(module, optimizer, options=_OPTIMIZER_OPTIONS)
    request, _ = to_canonical(osd, aliases, optimizer=True)
    unsaved = {
        key.rsplit(".", 1)[1] for key in request if key.startswith("param_groups.") and f"{prefix}.{key}" not in index
    }
    for group in optimizer.param_groups:
        for entry in unsaved - {"params"}:
            group.pop(entry, None)


# -- data-loader states ------------------------------------------------------------------------------


def gather_loader_states(
    local: Any, *, data_parallel_rank: int, pipeline_rank: int, data_parallel_size: int, is_global_zero: bool
) -> dict[str, Any] | None:
    """Every data-parallel replica's loader states, on global rank 0 (``None`` elsewhere, or if there are none).

    A collective. A replica's pipeline ranks read the same batches, so its pipeline rank 0 speaks for it.
    Replicas differ: a sampler or an ``IterableDataset`` sharded by replica, or a dataset with its own state
    (an augmentation generator, a shuffle buffer), is at another place in the data on each, so restoring
    global rank 0's state everywhere would hand every replica rank 0's share.
    """
    entry = (data_parallel_rank, pipeline_rank, local)
    if not (dist.is_available() and dist.is_initialized()):
        gathered = [entry]
    else:
        gathered = [None] * dist.get_world_size() if is_global_zero else None
        dist.gather_object(entry, gathered, dst=0)
    if not is_global_zero or gathered is None:
        return None
    states: list[Any] = [None] * data_parallel_size
    for replica, stage_rank, replica_states in gathered:
        if stage_rank == 0:
            states[replica] = replica_states
    if all(not replica_states for replica_states in states):
        return None
    return {"data_parallel_size": data_parallel_size, "states": states}


def replica_loader_states(
    stored: Mapping[str, Any] | None, saved_by_rank_zero: Any, *, data_parallel_rank: int, data_parallel_size: int
) -> tuple[Any, str | None]:
    """This replica's loader states to restore (``None``: restore none), and a warning when none can be.

    ``stored`` is what :func:`gather_loader_states` kept; without it (a checkpoint file from one process, or
    from an older version) there is only ``saved_by_rank_zero``, one process's states. A state belongs to one
    replica's share of the data under one replica count and cannot be split or merged for another, so under
    another ``data_parallel_size`` nothing is restored and the epoch's data starts over, as with a plain
    DataLoader, and the warning says so.
    """
    if not saved_by_rank_zero:
        return None, None
    if stored is None:
        if data_parallel_size == 1:
            return saved_by_rank_zero, None
        saved, origin = 1, "one process's data-loader state (a single-file checkpoint)"
    else:
        saved = int(stored["data_parallel_size"])
        if saved == data_parallel_size:
            return stored["states"][data_parallel_rank], None
        origin = f"one data-loader state per replica for data_parallel_size={saved}"
    return None, (
        f"BFPPStrategy: the checkpoint holds {origin}; this run has data_parallel_size={data_parallel_size}."
        f" Each state is one replica's place in its share of the data and cannot be split or merged for"
        f" {data_parallel_size} replicas, so the loader states are not restored: resumed mid-epoch, the epoch's"
        " data starts over from its beginning, as with a plain DataLoader (Lightning still counts the batches"
        " already trained, so the epoch ends that many batches early). Resume with"
        f" data_parallel_size={saved} for an exact resume."
    )


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


def _cloned(state: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
