"""Saves that do not stop training: the files are written while the steps go on, and the checkpoint counts only
once every rank has finished writing.

A save copies this rank's tensors to host memory (the only part that stops the step) and hands them to DCP's
``async_save``, whose thread writes them into ``<path>.tmp`` on a process group of its own. DCP ends a save with a
collective in which the coordinator (global rank 0) learns every rank's outcome and writes ``.metadata``; so when
global rank 0's write has succeeded, every rank's has, and its writer thread commits the checkpoint there and
then: ``meta.pt`` written, the folder swapped in at ``path``, and only then the removals its callback asked for
(the previous checkpoint, say). Until then the previous checkpoint stays the newest complete one, and nothing
removes it. The training thread learns the outcome at a step boundary: while a save is in flight each boundary
asks all ranks with one small all-reduce whether their part has settled, and once all have, every rank raises
the same error there if any rank's write (or the commit) failed, naming the rank and the checkpoint. At most one
save is in flight: the next save (and the end of training) waits for the one before.

Written here, not taken from torch: DCP's ``async_save`` returns a future per rank, and nothing in torch commits
the folder once every rank has written, agrees on the outcome at the same step everywhere, or holds back a
checkpoint callback's removal of the previous checkpoint until the new one is in place (torchtitan waits for its
own future at the next save and writes no commit).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from lightning_bfpp.engine.checkpoint.errors import CheckpointError, _dcp_failures, raise_on_every_rank
from lightning_bfpp.engine.checkpoint.names import METADATA_FILENAME
from lightning_bfpp.engine.checkpoint.saving import _discard, _swap_in, _write_metadata, prepare


@dataclass
class _InFlight:
    path: Path
    staging: Path
    metadata: dict[str, Any]
    is_global_zero: bool
    context: str  # what an error says happened; the commit's differs from the write's
    error: BaseException | None = None
    committed: bool = False
    removals: list[Callable[[], None]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    settled: threading.Event = field(default_factory=threading.Event)  # this rank's part done, outcome recorded


class AsyncSaver:
    """One process's asynchronous saves. ``group``: a gloo process group for DCP's collectives in the writer
    thread (its own: collectives of two threads on one group would interleave); ``device``: where the step
    boundary's agreement runs on the default group (the accelerator under NCCL)."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.group, self.device = group, device
        self.in_flight: _InFlight | None = None

    def save(self, path: Path, state: dict[str, Any], metadata: dict[str, Any], *, is_global_zero: bool) -> None:
        """A collective: start writing ``state`` for ``path`` (after settling the save still in flight)."""
        self.finish()
        staging, context = prepare(path, is_global_zero=is_global_zero)
        # the loops' and callbacks' states as they are now, not when the commit writes them
        flight = _InFlight(path, staging, copy.deepcopy(metadata), is_global_zero, context)
        written = dcp.async_save(state, checkpoint_id=staging, process_group=self.group)
        self.in_flight = flight
        written.add_done_callback(partial(_settle_in_writer, flight))

    def at_step_boundary(self) -> None:
        """A collective while a save is in flight (on every rank, or on none: saves are collectives): once every
        rank's part has settled, raise the save's error on every rank, if there is one."""
        if self.in_flight is None:
            return
        unsettled = torch.tensor([0 if self.in_flight.settled.is_set() else 1], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(unsettled, op=dist.ReduceOp.MAX)
        if int(unsettled.item()) == 0:
            self._agree()

    def finish(self) -> None:
        """A collective: wait for the save in flight, if any, and raise its error on every rank, if there is one."""
        if self.in_flight is not None:
            self.in_flight.settled.wait()
            self._agree()

    def remove_after_commit(self, remove: Callable[[], None]) -> bool:
        """Hold back ``remove`` (a checkpoint callback's removal of an older checkpoint) until the save in flight
        is in place (dropped if it fails); False (nothing held: remove now) when none is in flight or it is in
        place already."""
        flight = self.in_flight
        if flight is None:
            return False
        with flight.lock:
            if not flight.committed:
                flight.removals.append(remove)
                return True
        return False

    def _agree(self) -> None:
        assert self.in_flight is not None
        flight, self.in_flight = self.in_flight, None
        raise_on_every_rank(flight.error, flight.context)


def _settle_in_writer(flight: _InFlight, written: Future) -> None:
    """In the writer thread, when this rank's write has ended: record its outcome and, on global rank 0 after a
    write that succeeded everywhere, commit the checkpoint (what :func:`commit` does for a blocking save)."""
    try:
        try:
            written.result()
        except CheckpointException as failure:  # DCP's, with every failing rank's error
            flight.error = CheckpointError(f"{flight.context}: {_dcp_failures(failure)}")
        except Exception as failure:
            flight.error = failure
        if not flight.is_global_zero:
            return
        if flight.error is not None:
            _discard(flight.staging)
            return
        try:
            _write_metadata(flight.metadata, flight.staging / METADATA_FILENAME)
            flight.context = f"BFPPStrategy could not put the new checkpoint in place at {flight.path}"
            _swap_in(flight.staging, flight.path)
        except Exception as failure:
            flight.error = failure
            _discard(flight.staging)
            return
        with flight.lock:
            flight.committed = True
        flight.context = f"BFPPStrategy saved the checkpoint {flight.path}, but could not remove an older one"
        for remove in flight.removals:  # only once the new checkpoint is in place
            remove()
    except BaseException as failure:  # whatever happens here is this rank's error, raised at the boundary
        flight.error = failure
    finally:
        flight.settled.set()
