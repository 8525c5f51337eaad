"""Saving a checkpoint atomically: a crash while saving leaves the previous one untouched.

Saving writes into ``<path>.tmp`` and swaps it in only after every rank has finished; a process killed between
the swap's two renames leaves the previous checkpoint as ``<path>.old``, which loading then falls back to (see
:func:`resolve_path`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from lightning_bfpp.engine.agreement import describe
from lightning_bfpp.engine.checkpoint.errors import CheckpointError, _dcp_failures, raise_on_every_rank
from lightning_bfpp.engine.checkpoint.names import (
    METADATA_FILENAME,
    VERSIONS_FILENAME,
    VERSIONS_KEY,
    is_sharded_checkpoint,
    written_by,
)


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
    staging, context = prepare(path, is_global_zero=is_global_zero)
    error: BaseException | None = None
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
    commit(staging, path, metadata, error, is_global_zero=is_global_zero)


def prepare(path: Path, *, is_global_zero: bool) -> tuple[Path, str]:
    """A collective before a save's writes: its staging folder ``<path>.tmp``, emptied of what a killed save left
    there and created (by global rank 0: it is there when the save returns, even before an asynchronous save's
    thread has begun), and the context its errors name."""
    staging = path.with_name(path.name + ".tmp")
    context = f"BFPPStrategy could not save the checkpoint {path}; the previous one there is unchanged"
    error: BaseException | None = None
    if is_global_zero:
        try:  # left over by a save that was killed
            _remove(staging)
            staging.mkdir(parents=True)
        except Exception as failure:  # shared with every rank below
            error = failure
    raise_on_every_rank(error, context)
    return staging, context


def commit(
    staging: Path, path: Path, metadata: dict[str, Any], error: BaseException | None, *, is_global_zero: bool
) -> None:
    """A collective after every rank's writes: ``error`` (this rank's failed write, or None) raised on every rank,
    or ``meta.pt`` written and the folder swapped in at ``path`` by global rank 0, and its failure raised on
    every rank."""
    context = f"BFPPStrategy could not save the checkpoint {path}; the previous one there is unchanged"
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


def _discard(path: Path) -> None:
    """Remove a staging folder, as far as possible: a failed save is reported as such, not as this."""
    shutil.rmtree(path, ignore_errors=True)


def _write_metadata(metadata: dict[str, Any], file: Path) -> None:
    """``meta.pt``, and the releases that wrote the folder as JSON beside it (see :func:`written_by`)."""
    versions = written_by()
    (file.parent / VERSIONS_FILENAME).write_text(json.dumps(versions) + "\n")
    torch.save({**metadata, VERSIONS_KEY: versions}, file)


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


def complete_last_checkpoints(found: Iterable[str], folder: Path, is_last: Callable[[str], bool]) -> set[str]:
    """The checkpoints a resume from "last" may choose among in ``folder``: of ``found`` (the names a checkpoint
    callback takes for its last ones), the files and the complete folders (``meta.pt`` is written last); and a
    complete ``<name>.old`` whose ``<name>`` is gone (a save killed between its two renames, which leaves the
    previous checkpoint there: without it a resume would start over, and the next save at ``<name>`` would remove
    ``.old``). A folder without ``meta.pt`` (a copy cut short, a save of another tool) is never chosen."""
    chosen = {path for path in found if not Path(path).is_dir() or is_sharded_checkpoint(Path(path))}
    if folder.is_dir():
        for old in folder.iterdir():
            name = old.name.removesuffix(".old")
            if (
                old.name.endswith(".old")
                and is_last(name)
                and not (folder / name).exists()
                and is_sharded_checkpoint(old)
            ):
                chosen.add(str(old))
    return chosen
