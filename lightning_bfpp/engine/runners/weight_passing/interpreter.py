"""Runs one rank's lowered weight-passing action list: a handler per action kind over one step's state.

Written here, not taken from torch: torch's runtime interprets actions that pass activations between ranks;
these fetch weights and recompute each chunk's forward in its backward (see
:mod:`lightning_bfpp.engine.runners.weight_passing`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_bfpp.engine._compat import tree_flatten
from lightning_bfpp.engine.random_state import RandomStateSnapshot
from lightning_bfpp.engine.runners.weight_passing.transfers import ChunkTransfers
from lightning_bfpp.plan.actions import Action, Kind


def _no_range(name: str) -> Any:
    return nullcontext()


def _requiring_grad(values: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(
        v.detach().requires_grad_(True) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for v in values
    )


def _as_args(output: Any) -> tuple[Any, ...]:
    return output if isinstance(output, tuple) else (output,)


@dataclass
class _Step:
    """One run's micro-batches and what its actions hand each other."""

    arg_mbs: list[tuple[Any, ...]]
    kwarg_mbs: list[dict[str, Any]]
    target_mbs: list[torch.Tensor]
    outputs: dict[tuple[int, int], Any] = field(default_factory=dict)  # a chunk's output, for the next's forward
    saved: dict[tuple[int, int], Any] = field(default_factory=dict)  # what a chunk's backward starts from
    grads: dict[tuple[int, int], tuple[Any, ...]] = field(default_factory=dict)  # gradients of a chunk's output
    chunk_grads: dict[int, torch.Tensor] = field(default_factory=dict)  # a backward's gradient, until REDUCE_GRAD


class WeightPassingRunner:
    """Runs one rank's lowered weight-passing action list over the caller's micro-batches.

    The interface is the one :class:`lightning_bfpp.engine.pipeline.Pipeline` uses for torch's runtime:
    ``run(arg_mbs, kwarg_mbs, targets)``, ``loss_fn(output, target)`` called on the last chunk's output
    of every micro-batch (its result, already scaled, is what the backward starts from), and
    ``last_inputs``. ``action_range(name)`` wraps each action (the trace's hook).

    Each backward's parameter gradient is handed to the chunk's owner by the action list's REDUCE_GRAD. A list
    without any (one process, which owns every chunk: nothing is sent, see ``Plan.lowered``)
    leaves the gradients accumulating in ``.grad``, as on one device.
    """

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        actions: Sequence[Action],
        num_microbatches: int,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
        transfers: ChunkTransfers,
        *,
        backward: bool,
        device: torch.device,
    ) -> None:
        self.chunks = list(chunks)
        self.actions = list(actions)
        self.num_microbatches = num_microbatches
        self.loss_fn = loss_fn
        self.transfers = transfers
        self.backward = backward
        self.device = device
        self.inferring_metadata = False  # no shape inference: nothing is sent
        self.reduces = any(action.kind is Kind.REDUCE_GRAD for action in self.actions)
        self.last_inputs: tuple[list[Any], list[Any]] | None = None
        self.action_range: Callable[[str], Any] = _no_range
        self._ready = transfers.ready
        self._last = len(self.chunks) - 1
        # the action kinds a lowered weight-passing list holds, each with its handler
        self._handlers: dict[Kind, Callable[[Action, _Step], None]] = {
            Kind.UNSHARD: lambda action, _: self.transfers.fetch(action.stage),
            Kind.RESHARD: lambda action, _: self.transfers.release(action.stage),
            Kind.REDUCE_GRAD: lambda action, step: self.transfers.reduce(
                action.stage, step.chunk_grads.pop(action.stage)
            ),
            Kind.WAIT_REDUCE_GRAD: lambda action, _: self.transfers.wait_reduced(action.stage),
            Kind.FORWARD: self._forward,
            Kind.BACKWARD: self._backward,
        }

    @contextmanager
    def hooked(
        self,
        *,
        action_range: Callable[[Callable[[str], Any]], Callable[[str], Any]],
        p2p_wait: Callable[[Callable[..., Any]], Callable[..., Any]],
        weight_wait: Callable[[Callable[..., Any]], Callable[..., Any]],
    ) -> Iterator[None]:
        """Route each action and each wait for a chunk's weights through the trace's wrappers (there are no
        point-to-point waits: ``p2p_wait`` is not used)."""
        self.action_range, self._ready = action_range(_no_range), weight_wait(self.transfers.ready)
        try:
            yield
        finally:
            self.action_range, self._ready = _no_range, self.transfers.ready

    def run(
        self,
        arg_mbs: list[tuple[Any, ...]] | None,
        kwarg_mbs: list[dict[str, Any]] | None,
        target_mbs: list[torch.Tensor],
    ) -> None:
        assert arg_mbs is not None and kwarg_mbs is not None
        step = _Step(arg_mbs, kwarg_mbs, target_mbs)
        try:
            for action in self.actions:
                with self.action_range(f"PP:{action}"):  # torch's range name, which the trace reads
                    handler = self._handlers.get(action.kind)
                    if handler is None:
                        raise ValueError(f"weight passing has no handler for the action {action}")
                    handler(action, step)
        finally:
            self.transfers.release_all()

    def _forward(self, action: Action, step: _Step) -> None:
        c, mb = action.stage, action.microbatch
        assert mb is not None
        args = step.arg_mbs[mb] if c == 0 else _as_args(step.outputs.pop((c - 1, mb)))
        kwargs = step.kwarg_mbs[mb]
        self._ready(c)
        weights = self.transfers.chunks[c]
        # the buffers this forward computes with: what its recomputation must see again, and on a borrower what
        # its forward must leave (the owner's values, see the package docstring)
        before = weights.save_buffers()
        if self.backward and c == self._last:
            inputs = _requiring_grad(args)
            output = self.chunks[c](*inputs, **kwargs)
            # a borrower's buffers are restored after the backward: its graph may hold them
            step.saved[(c, mb)] = (inputs, self.loss_fn(output, step.target_mbs[mb]), before)
        elif self.backward:
            state = RandomStateSnapshot(self.device)
            with torch.no_grad():
                step.outputs[(c, mb)] = self.chunks[c](*args, **kwargs)
            step.saved[(c, mb)] = (args, kwargs, state, before)
            if not weights.owned:
                weights.restore_buffers(before)
        else:
            with torch.no_grad():
                output = self.chunks[c](*args, **kwargs)
            if not weights.owned:
                weights.restore_buffers(before)
            if c == self._last:
                self.loss_fn(output, step.target_mbs[mb])
            else:
                step.outputs[(c, mb)] = output

    def _backward(self, action: Action, step: _Step) -> None:
        c, mb = action.stage, action.microbatch
        assert mb is not None
        self._ready(c)
        weights = self.transfers.chunks[c]
        accumulated = [p.grad for p in weights.params]
        if self.reduces:  # the owner's accumulated gradients step aside: only this backward's is sent
            for p in weights.params:
                p.grad = None
        if c == self._last:
            inputs, loss, before = step.saved.pop((c, mb))
            loss.backward()
            if not weights.owned:
                weights.restore_buffers(before)
        else:
            args, kwargs, state, before = step.saved.pop((c, mb))
            inputs = _requiring_grad(args)
            # recompute with the buffers the forward saw, and leave them as they are now: the forward's update
            # counts once
            current = weights.save_buffers()
            weights.restore_buffers(before)
            with state.restored(), torch.enable_grad():
                output = self.chunks[c](*inputs, **kwargs)
            pairs = [
                (o, g)
                for o, g in zip(tree_flatten(output)[0], step.grads.pop((c, mb)), strict=True)
                if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
            ]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            weights.restore_buffers(current)
        if c > 0:
            step.grads[(c - 1, mb)] = tuple(
                i.grad if isinstance(i, torch.Tensor) and i.requires_grad else None for i in inputs
            )
        if self.reduces:
            step.chunk_grads[c] = weights.take_gradient()
            for p, grad in zip(weights.params, accumulated, strict=True):
                p.grad = grad
