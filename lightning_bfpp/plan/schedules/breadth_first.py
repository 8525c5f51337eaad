"""Breadth-first (Lamy-Poirier, MLSys 2023) and breadth-first with a split backward. Pure.

Both keep the paper's sweeps on the looping placement: per rank, every micro-batch through one local stage
before the next, stage by stage, then the backward in reverse stage order, again all micro-batches per stage.
Each stage is therefore visited once per forward sweep and once per backward sweep, which is what lets sharded
data parallelism gather its weights once per sweep and reduce its gradients once.
"""

from __future__ import annotations

from lightning_bfpp.plan.actions import Action, B, I, Kind, Schedule, ScheduleError, W, format_schedule, ready
from lightning_bfpp.plan.schedules import register
from lightning_bfpp.plan.schedules.base import ScheduleKind, check_sizes, sweeps


def breadth_first(pipeline_parallel_size: int, stages_per_rank: int, num_microbatches: int) -> Schedule:
    """The breadth-first schedule on the looping placement (see the module docstring)."""
    p, v, m = check_sizes(pipeline_parallel_size, stages_per_rank, num_microbatches)
    return sweeps(p, v, m, B)


def breadth_first_zb(pipeline_parallel_size: int, stages_per_rank: int, num_microbatches: int) -> Schedule:
    """Breadth-first with the backward split into input gradients ``I`` and weight gradients ``W`` (zero bubble).

    The ``F`` and ``I`` actions keep breadth-first's sweeps and order: per rank, every micro-batch's forward
    through one local stage, stage by stage, then every micro-batch's input gradient through one local stage,
    in reverse stage order, so each stage is still gathered once per sweep. Only ``I`` is on the critical path
    (the previous stage waits for it), so the ``W`` actions are moved where the rank would otherwise wait: a
    list-scheduling pass with unit times (``f = i = w``) runs a pending ``W`` whenever the rank's next ``F``
    or ``I`` has not arrived, taking only ``W``'s of the stage whose ``I`` ran last on the rank (still
    gathered, so they join that stage's visit), lowest micro-batch first; the rest follow the last sweep,
    stage by stage, most recently visited stage first, each stage's ``W``'s together.

    With unit times and ``m ≥ p`` a step takes ``3vm + 2(p − 1)`` units against breadth-first's
    ``3vm + 3(p − 1)`` (``b = i + w``): the forward fill and the descent of the first input gradient remain,
    since no ``W`` exists before the first ``I`` and all forwards precede it, so this is the least any order
    that keeps the sweeps can reach; the ``W``'s fill the cool-down. With ``m < p`` they also fill the waits
    between input-gradient sweeps.

    Gathers per rank per step under ``full_shard`` with ``prefetch=1``: ``max(3v − 4, v)`` against
    breadth-first's ``max(2v − 2, v)`` when ``m ≥ p`` (at most that below): ``v`` forward visits, ``v − 2``
    input-gradient visits (the last two local stages stay gathered from their forwards) and ``v − 2``
    weight-gradient visits (the first local stage's ``W``'s join its input-gradient visit, and the second stays
    gathered from its ``I``'s to its ``W``'s, which follow next).
    ``shard_grad_op`` and ``no_shard`` still gather each stage once. Each stage's ``REDUCE_GRAD`` follows its
    last ``W``; a micro-batch's activations are held until its ``W``, not its ``I``.
    """
    p, v, m = check_sizes(pipeline_parallel_size, stages_per_rank, num_microbatches)
    return fill_with_weight_gradients(sweeps(p, v, m, I), p * v)


def fill_with_weight_gradients(sweeps_: Schedule, num_stages: int) -> Schedule:
    """Add one ``W`` after each ``I`` of ``sweeps_``: in the rank's waits (list scheduling in unit times), else at
    the end.

    A wait is filled only with ``W``'s of the stage of the rank's latest ``I``: that stage is gathered, so under
    full sharding the filling costs no gather, and each stage's remaining ``W``'s form one run at the end.
    Stage 0's ``I`` takes no time and its ``W`` two units, as torch's runtime runs them: the first stage has no
    input gradient to compute, so its whole backward happens in ``W`` (``PipelineStage.backward_one_chunk``
    skips the input pass there).
    """

    def duration(a: Action) -> int:
        if a.stage == 0 and a.kind in (I, W):
            return 0 if a.kind is I else 2
        return 1

    finished_at: dict[tuple[int, Kind, int | None], int] = {}
    cursor = dict.fromkeys(sweeps_, 0)
    free_at = dict.fromkeys(sweeps_, 0)
    out: Schedule = {rank: [] for rank in sweeps_}
    pending: dict[int, dict[int, list[int]]] = {rank: {} for rank in sweeps_}  # rank → stage → micro-batches
    latest: dict[int, list[int]] = {rank: [] for rank in sweeps_}  # stages by their latest I, most recent last
    now = 0
    while any(cursor[rank] < len(actions) for rank, actions in sweeps_.items()):
        done = {key for key, at in finished_at.items() if at <= now}
        progressed = False
        for rank, actions in sweeps_.items():
            while free_at[rank] <= now:
                if cursor[rank] < len(actions) and ready(actions[cursor[rank]], done, num_stages):
                    a = actions[cursor[rank]]
                    cursor[rank] += 1
                    if a.kind is I and a.microbatch is not None:
                        pending[rank].setdefault(a.stage, []).append(a.microbatch)
                        if a.stage in latest[rank]:
                            latest[rank].remove(a.stage)
                        latest[rank].append(a.stage)
                elif latest[rank] and pending[rank][latest[rank][-1]]:
                    stage = latest[rank][-1]
                    a = Action(stage, W, pending[rank][stage].pop(0))
                else:
                    break  # the rank waits
                out[rank].append(a)
                finished_at[(a.stage, a.kind, a.microbatch)] = now + duration(a)
                free_at[rank] = now + duration(a)
                progressed = True
                if duration(a):
                    break
                done.add((a.stage, a.kind, a.microbatch))
        if (
            not progressed
            and all(free_at[rank] <= now for rank in sweeps_)
            and max(finished_at.values(), default=0) <= now
        ):
            raise ScheduleError(
                "the sweeps deadlock before their weight gradients are placed\n" + format_schedule(sweeps_)
            )
        now += 1
    for rank in sweeps_:
        for stage in reversed(latest[rank]):
            out[rank] += [Action(stage, W, mb) for mb in pending[rank][stage]]
    return out


class BreadthFirst(ScheduleKind):
    name = "breadth_first"
    summary = "all micro-batches through one local stage before the next; backward in reverse (the default)"

    def generate(self, p: int, v: int, m: int, *, microbatch_group_size: int | None = None) -> Schedule:
        return breadth_first(p, v, m)


class BreadthFirstZeroBubble(ScheduleKind):
    name = "breadth_first_zb"
    summary = (
        "breadth-first's sweeps with the backward split into input and weight gradients, the weight gradients"
        " where the rank would wait"
    )
    splits_backward = True

    def generate(self, p: int, v: int, m: int, *, microbatch_group_size: int | None = None) -> Schedule:
        return breadth_first_zb(p, v, m)


register(BreadthFirst())
register(BreadthFirstZeroBubble())
