"""Checking a checkpoint against the module before anything is loaded.

Its files must be complete and its names and global shapes must be the module's. Every rank checks the same
files against the whole module's shapes, so a bad checkpoint stops every rank with the same message, one
that says what the path holds instead and what to do, rather than DCP's per-rank failure in mid-load.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from lightning_bfpp.engine.checkpoint.errors import CheckpointError
from lightning_bfpp.engine.checkpoint.names import METADATA_FILENAME, MODEL_KEY, VERSIONS_FILENAME
from lightning_bfpp.engine.checkpoint.unpickling import _read_metadata

_LISTED = 6  # names shown per kind of mismatch

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


def read_index(path: Path, *, weights_only: bool | None = None) -> Any:
    """DCP's index (``.metadata``) of the folder ``path``, or one :class:`CheckpointError` saying why not: no index
    (what the folder holds instead), an index written by a newer torch than this one (which releases, and the ways
    forward), or an unreadable one (the folder is damaged)."""
    where = f"BFPPStrategy cannot load the checkpoint {path}"
    try:
        return _read_metadata(path, weights_only=weights_only)
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise _no_index(path, where) from None
    except Exception as error:  # any unpickling error means the same
        raise _unreadable_index(path, where, error) from None


def _release(version: str) -> tuple[int, ...]:
    """``"2.15.0+cu130"`` -> ``(2, 15, 0)``; the leading numbers only."""
    parts = []
    for part in version.split("+")[0].split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _unreadable_index(path: Path, where: str, error: Exception) -> CheckpointError:
    """The error for a ``.metadata`` this torch cannot unpickle: a newer torch's index format (told apart by the
    releases ``meta.pt`` records), or a damaged folder."""
    written = recorded_versions(path)
    found = f"{type(error).__name__}: {error}"
    running = torch.__version__
    if written is None:
        return CheckpointError(
            f"{where}: torch {running} cannot read its `.metadata` ({found}), and the folder does not record which"
            f" torch wrote it (no {VERSIONS_FILENAME}: an older lightning-bfpp wrote it)."
            " Either it was written by a newer torch, whose torch.distributed.checkpoint index"
            " an older one cannot read (resume under that torch, or consolidate it there into one file with"
            f" `python -m lightning_bfpp.consolidate {path}` and resume from that file), or the folder is truncated"
            " or corrupt (copy it again from where it was written, or resume from an earlier checkpoint)."
        )
    writer = written.get("torch", "unknown")
    if _release(writer)[:2] > _release(running)[:2]:
        release = ".".join(map(str, _release(writer)[:2]))
        return CheckpointError(
            f"{where}: it was written by torch {writer} (lightning-bfpp {written.get('lightning_bfpp', 'unknown')}),"
            f" and this process runs torch {running}, which cannot read that torch's torch.distributed.checkpoint"
            f" index (`.metadata`: {found}). The folder is not damaged. Either resume under torch {release} or newer,"
            f" or, under torch {release}, consolidate it into one file (`python -m lightning_bfpp.consolidate {path}"
            f' --output_file <file>.ckpt`) and resume from that file here (`ckpt_path="<file>.ckpt"`): a'
            " consolidated file resumes exactly, under any layout and any supported torch."
        )
    return CheckpointError(
        f"{where}: its `.metadata` is unreadable ({found}), although torch {writer}, which wrote it, is not newer than"
        f" this process's {running}: the folder is truncated or corrupt. Copy it again from where it was written, or"
        " resume from an earlier checkpoint."
    )


def recorded_versions(path: Path) -> dict[str, str] | None:
    """The releases that wrote the checkpoint folder ``path``, as its ``bfpp_versions.json`` records them (JSON: read
    without unpickling anything, by any torch); None where it has none (written before this package recorded
    them) or it cannot be read."""
    try:
        versions = json.loads((path / VERSIONS_FILENAME).read_text())
    except Exception:  # missing or unreadable: nothing to say about versions
        return None
    return {str(k): str(v) for k, v in versions.items()} if isinstance(versions, dict) else None


def check_sharded(path: Path, expected: Shapes, *, strict: bool, weights_only: bool | None = None) -> None:
    """Refuse a DCP folder that is incomplete, foreign or was saved from another model, before anything is read.

    Every rank passes the same folder and the whole module's ``expected`` shapes, so every rank raises the
    same error. DCP would otherwise fail inside its collective load with a per-rank message (an unreadable
    file) or a missing-key message that names no shape. ``weights_only`` (see
    :func:`~lightning_bfpp.engine.checkpoint.unpickling.resolve_weights_only`): whether ``.metadata`` may name
    more than DCP writes there.
    """
    where = f"BFPPStrategy cannot load the checkpoint {path}"
    metadata = read_index(path, weights_only=weights_only)
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
