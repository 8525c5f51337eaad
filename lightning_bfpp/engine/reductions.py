"""Gradient reductions that overlap the rest of the backward instead of blocking it.

Breadth-first reduces each stage's gradients once, right after the stage's last backward, while the rank
still has the backward of its earlier stages to run. torch's ``REDUCE_GRAD`` wastes that: it runs FSDP2's
post-backward and then the root's final callback, which on CUDA makes the compute stream wait for the
reduce-scatter (every later backward kernel queues behind it), and on gloo, where the reduce-scatter is a
blocking call, stops the host until the reduction is done.

:class:`GradientReductions` replaces the action (through the runtime's ``register_custom_function``):

- ``"stream"`` (CUDA): post-backward only, which issues the reduce-scatter on FSDP2's reduction stream;
  the final callbacks, where the compute stream waits, run once after the schedule's last action
  (:meth:`GradientReductions.finish`), before clipping and the optimizer step.
- ``"thread"`` (gloo and other host-blocking backends): the whole reduction runs on one communication
  thread, in the schedule's order, on a process group of its own over the same ranks (the main thread's
  gathers keep theirs, so no group sees the two interleaved differently on different ranks); ``finish``
  joins it.

The stage's ``RESHARD`` that follows ``REDUCE_GRAD`` is left to the reduction (FSDP2's post-backward
reshards), so the main thread never touches a stage whose reduction may still be running.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal

from torch import nn

from lightning_bfpp.engine._compat import fsdp_finish_backward, fsdp_post_backward

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
    """Issues stage reductions as the schedule reaches them and waits for them all at :meth:`finish`."""

    def __init__(self, stage_modules: Mapping[int, nn.Module], mode: Mode) -> None:
        self.stage_modules = dict(stage_modules)
        self.mode = mode
        self._executor: ThreadPoolExecutor | None = None  # the communication thread, started on first use
        self._pending: list[tuple[int, Future[None] | None]] = []

    def reduce(self, stage_index: int) -> bool:
        """Start reducing ``stage_index``'s gradients; returns True (the reduction reshards the stage)."""
        module = self.stage_modules[stage_index]
        if self.mode == "thread":
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="bfpp-reduce")
            self._pending.append((stage_index, self._executor.submit(fsdp_post_backward, module)))
        else:
            fsdp_post_backward(module, final=False)
            self._pending.append((stage_index, None))
        return True

    def finish(self) -> None:
        """Wait for every reduction issued since the last call; raise the first that failed."""
        pending, self._pending = self._pending, []
        error: BaseException | None = None
        for stage_index, future in pending:
            try:
                if future is None:
                    fsdp_finish_backward(self.stage_modules[stage_index])
                else:
                    future.result()
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
