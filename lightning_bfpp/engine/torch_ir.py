"""A plan's action lists in the action IR of the installed torch's pipeline runtime: where torch versions differ.

The plan's lists (:meth:`lightning_bfpp.plan.plan.Plan.lowered`) hold the compute, the data-parallel actions and
each reduction's ``WAIT_REDUCE_GRAD``; the simulator times them and the tracer names their spans. What torch's
runtime needs beyond them is added here, and only here:

- the point-to-point transfers, by torch's own pass (``_add_send_recv``: a ``SEND_F`` after each forward whose
  output leaves the rank, a ``RECV_F`` before each forward whose input arrives, and the same for gradients);
- from torch 2.15 on, a ``WAIT_SEND_F`` / ``WAIT_SEND_B`` retiring each send (:func:`add_send_waits`). torch
  keeps a sent forward output alive until its wait, so where the wait stands is a memory decision: right after
  the rank's own backward of that stage and micro-batch (``B`` or ``I``), which needs the next stage's gradient
  and so proves the send was received (the point where the planner's memory model frees the output), or, where
  the list has no such backward (a forward-only step, and every backward send), at the end of the list. This is
  the rule of torch's own ``_add_wait_send``, written here so that the package's lowering owns every action it runs;
- before torch 2.15, whose runtime has no wait actions, the plan's ``WAIT_REDUCE_GRAD`` are dropped: the
  package's overlapped reductions retire the pending one before starting the next, which is where the plan puts
  the wait (:meth:`lightning_bfpp.engine._compat.PipelineRuntime.replace_gradient_reduction`), and torch's own
  ``REDUCE_GRAD`` blocks until it is done.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from lightning_bfpp.engine._compat import TORCH_WAIT_ACTIONS, TorchAction, TorchKind, add_send_recv
from lightning_bfpp.plan.actions import Action, Kind

_TO_TORCH = {
    Kind.FORWARD: TorchKind.FORWARD,
    Kind.BACKWARD: TorchKind.FULL_BACKWARD,
    Kind.BACKWARD_INPUT: TorchKind.BACKWARD_INPUT,
    Kind.BACKWARD_WEIGHT: TorchKind.BACKWARD_WEIGHT,
    Kind.UNSHARD: TorchKind.UNSHARD,
    Kind.RESHARD: TorchKind.RESHARD,
    Kind.REDUCE_GRAD: TorchKind.REDUCE_GRAD,
}
if TORCH_WAIT_ACTIONS:
    _TO_TORCH[Kind.WAIT_REDUCE_GRAD] = TorchKind.WAIT_REDUCE_GRAD


def to_torch_action(action: Action) -> TorchAction:
    """The same action in torch's IR (a ``WAIT_REDUCE_GRAD`` only where torch has one: see :func:`runs_on_torch`)."""
    return TorchAction(action.stage, _TO_TORCH[action.kind], action.microbatch)


def runs_on_torch(action: Action) -> bool:
    """Whether the installed torch's runtime executes ``action`` (before 2.15 it has no ``WAIT_REDUCE_GRAD``)."""
    return action.kind in _TO_TORCH


def torch_action_lists(
    schedule: Mapping[int, Sequence[Action]], stage_to_rank: Callable[[int], int], num_stages: int
) -> dict[int, list[TorchAction]]:
    """Every rank's list as the installed torch's runtime executes it: the plan's actions it knows, torch's
    sends and receives, and (torch ≥ 2.15) one wait per send."""
    lowered = {rank: [to_torch_action(a) for a in actions if runs_on_torch(a)] for rank, actions in schedule.items()}
    with_comms = add_send_recv(lowered, stage_to_rank=stage_to_rank, num_stages=num_stages)
    if TORCH_WAIT_ACTIONS:
        with_comms = {rank: add_send_waits(actions) for rank, actions in with_comms.items()}
    return with_comms


_SENDS = {TorchKind.SEND_F: "WAIT_SEND_F", TorchKind.SEND_B: "WAIT_SEND_B"}
_BACKWARDS = (TorchKind.FULL_BACKWARD, TorchKind.BACKWARD_INPUT)


def add_send_waits(actions: Sequence[TorchAction | None]) -> list[TorchAction]:
    """One rank's list with a wait after each send: a forward send's right after the rank's ``B`` or ``I`` of the
    same stage and micro-batch, the others at the end, in the order their sends were issued (module docstring)."""
    out: list[TorchAction] = []
    pending: dict[tuple[TorchKind, int, int | None], TorchAction] = {}
    for action in actions:
        if action is None:
            continue
        out.append(action)
        kind = action.computation_type
        if kind in _SENDS:
            key = (kind, action.stage_index, action.microbatch_index)
            if key in pending:
                raise ValueError(f"lightning_bfpp: the plan sends {action} twice")
            pending[key] = action
        elif kind in _BACKWARDS:
            sent = pending.pop((TorchKind.SEND_F, action.stage_index, action.microbatch_index), None)
            if sent is not None:
                out.append(_wait_for(sent))
    out.extend(_wait_for(sent) for sent in pending.values())
    return out


def _wait_for(send: TorchAction) -> TorchAction:
    return TorchAction(send.stage_index, TorchKind[_SENDS[send.computation_type]], send.microbatch_index)
