"""Gradient reductions that overlap the rest of the backward instead of blocking it.

Breadth-first reduces each stage's gradients once, right after the stage's last backward, while the rank
still has the backward of its earlier stages to run. torch's ``REDUCE_GRAD`` wastes that: it runs FSDP2's
post-backward and then the root's final callback, which on CUDA makes the compute stream wait for the
reduce-scatter (every later backward kernel queues behind it), and on gloo, where the reduce-scatter is a
blocking call, stops the host until the reduction is done.

:class:`GradientReductions` replaces the action (through the runtime's ``register_custom_function``):

- ``"stream"`` (CUDA): ``REDUCE_GRAD`` issues the reduce-scatter on FSDP2's reduction stream and returns; the
  compute stream waits for it only at the stage's ``WAIT_REDUCE_GRAD``, which the plan puts just before the rank's
  next ``REDUCE_GRAD`` (a whole backward sweep later, under breadth-first) or at the end of the list.
- ``"thread"`` (gloo and other host-blocking backends): the whole reduction runs on one communication
  thread, in the schedule's order, on a process group of its own over the same ranks (the main thread's
  gathers keep theirs, so no group sees the two interleaved differently on different ranks); the stage's
  ``WAIT_REDUCE_GRAD`` joins it.

:meth:`GradientReductions.finish` waits for whatever is still pending when the schedule ends (before torch 2.15,
whose lists carry no wait actions, the last reduction), before clipping and the optimizer step.

The stage's ``RESHARD`` that follows ``REDUCE_GRAD`` is left to the reduction (FSDP2's post-backward
reshards), so the main thread never touches a stage whose reduction may still be running.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal

from torch import nn

from lightning_bfpp.engine._compat import reduce_gradients, start_gradient_reduction

Mode = Literal["stream", "thread"]
Setting = bool | Literal["auto", "stream", "thread"]


def asked_for(setting: Setting, device_type: str) -> bool:
    """Whether ``overlap_reductions`` asks for overlapped reductions on this device (``"auto"``: CUDA only)."""
    if setting == "auto":
        return device_type == "cuda"
    return setting is not False


def overlap_mode(setting: Setting, device_type: str, data_parallel_size: int, sharding: str) -> Mode | None:
    """How gradient reductions overlap the backward here, or None where there is nothing to overlap."""
    if not asked_for(setting, device_type) or data_parallel_size == 1:
        return None
    if sharding == "no_shard":
        return None  # replicated gradients are all-reduced by FSDP2's replicate, kept synchronous
    # hybrid_shard overlaps too: FSDP2's post-backward reduce-scatters inside the node (under "thread" on a
    # second shard group, see sharding.second_data_parallel_group) and then all-reduces across nodes
    if setting in ("stream", "thread"):
        return setting  # type: ignore[return-value]
    return "stream" if device_type == "cuda" else "thread"


class GradientReductions:
    """Issues stage reductions as the schedule reaches them and waits for each at its ``WAIT_REDUCE_GRAD``.

    ``log``, if given, receives ``"reduce <stage>"`` when a reduction starts and ``"reduced <stage>"`` when its wait
    returns (the order the tests check: no optimizer step before the last ``reduced``)."""

    def __init__(self, stage_modules: Mapping[int, nn.Module], mode: Mode, log: list[str] | None = None) -> None:
        self.stage_modules = dict(stage_modules)
        self.mode = mode
        self.log = log
        self._executor: ThreadPoolExecutor | None = None  # the communication thread, started on first use
        self._pending: dict[int, Callable[[], None]] = {}  # stage -> its wait, in the order they were issued

    def reduce(self, stage_index: int) -> bool:
        """Start reducing ``stage_index``'s gradients; returns True (the reduction reshards the stage)."""
        if stage_index in self._pending:
            raise RuntimeError(f"lightning_bfpp: stage {stage_index}'s gradients reduced twice in one step")
        module = self.stage_modules[stage_index]
        if self.log is not None:
            self.log.append(f"reduce {stage_index}")
        if self.mode == "thread":
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="bfpp-reduce")
            future: Future[None] = self._executor.submit(reduce_gradients, module)
            self._pending[stage_index] = future.result
        else:
            self._pending[stage_index] = start_gradient_reduction(module)
        return True

    def wait(self, stage_index: int) -> None:
        """Return once ``stage_index``'s reduction is complete (its ``WAIT_REDUCE_GRAD``); no-op if none is pending."""
        wait = self._pending.pop(stage_index, None)
        if wait is not None:
            wait()
            if self.log is not None:
                self.log.append(f"reduced {stage_index}")

    @property
    def pending(self) -> list[int]:
        """The stages whose reductions have started and not been waited for, in the order they started."""
        return list(self._pending)

    def finish(self) -> None:
        """Wait for every reduction still pending; raise the first that failed."""
        error: BaseException | None = None
        for stage_index in self.pending:
            try:
                self.wait(stage_index)
            except BaseException as exc:  # wait for the others before raising
                error = error or exc
        if error is not None:
            raise error

    def close(self) -> None:
        """Stop the communication thread (a later reduction starts a new one)."""
        self.finish()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
