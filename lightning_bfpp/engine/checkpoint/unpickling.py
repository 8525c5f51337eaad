"""Reading a checkpoint's pickles without running code from them.

A checkpoint is pickles: ``meta.pt`` and a one-device file (torch.save), DCP's ``.metadata`` index and its
non-tensor entries (an optimizer's ``lr``, ``betas``). Unpickling can call any function the file names, so a
checkpoint from elsewhere could run code. ``weights_only`` means here what it means to Lightning and
``torch.load``: ``None`` is torch's default (``True`` since torch 2.6), ``True`` admits tensors, plain Python
values and the types torch allows, ``False`` unpickles everything (the caller trusts the file). torch.load
applies it to the files it reads; DCP reads ``.metadata`` with plain ``pickle.load`` and its non-tensor entries
with ``weights_only=False`` whatever the caller asked, so with ``weights_only`` those are checked here before
DCP reads them.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import io
import os
import pathlib
import pickle
import sys
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner

from lightning_bfpp.engine import _compat
from lightning_bfpp.engine.checkpoint.errors import CheckpointError
from lightning_bfpp.engine.checkpoint.names import METADATA_FILENAME

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
