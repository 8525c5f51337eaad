"""Pipeline schedules as data: per-rank ordered action lists, validated and lowered. Pure.

A schedule is ``dict[pipeline_rank, list[Action]]``. A schedule kind (:mod:`lightning_bfpp.plan.schedules`)
generates the *compute* actions: forward ``F`` and backward ``B`` of one micro-batch through one stage, or the
backward split in two as zero-bubble schedules do: ``I``, the input gradient the previous stage waits for, and
``W``, the weight gradient nobody waits for. :func:`add_sharding_actions` then inserts the data-parallel
actions (``UNSHARD`` = all-gather a stage's weights, ``RESHARD`` = free them, ``REDUCE_GRAD`` = start reducing
its gradients, ``WAIT_REDUCE_GRAD`` = the point by which that reduction has completed); the execution half turns
the result into the installed torch's action IR (:mod:`lightning_bfpp.engine.torch_ir`: the point-to-point
sends and receives, and on torch ≥ 2.15 a wait retiring each send, a forward's right after the rank's own backward
of it). Nothing here imports ``torch``: a schedule is generated, checked and printed in microseconds, and the same
lists are what the runtime executes and the simulator times.

The string form is torch's: ``2F0`` is stage 2, forward, micro-batch 0; ``1UNSHARD`` acts on stage 1.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from lightning_bfpp.plan.placement import LOOP, StagePlacement


class Kind(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    REDUCE_GRAD = "REDUCE_GRAD"
    WAIT_REDUCE_GRAD = "WAIT_REDUCE_GRAD"


F, B = Kind.FORWARD, Kind.BACKWARD
I, W = Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT  # noqa: E741 (torch's own names for the split backward)
UNSHARD, RESHARD, REDUCE_GRAD = Kind.UNSHARD, Kind.RESHARD, Kind.REDUCE_GRAD
WAIT_REDUCE_GRAD = Kind.WAIT_REDUCE_GRAD
COMPUTE = (F, B, I, W)
BACKWARD_KINDS = (B, I, W)
GRADIENT_KINDS = (B, W)  # the actions that add to a stage's weight gradients

_ACTION_RE = re.compile(r"^(\d+)(F|B|I|W|UNSHARD|RESHARD|WAIT_REDUCE_GRAD|REDUCE_GRAD)(\d*)$")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank: ``kind`` on ``stage`` (for compute actions, on ``microbatch``)."""

    stage: int
    kind: Kind
    microbatch: int | None = None

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{'' if self.microbatch is None else self.microbatch}"

    __repr__ = __str__

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    @staticmethod
    def parse(text: str) -> Action:
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(f"not an action: {text!r} (expected e.g. '2F0', '1B3', '2I0', '2W0', '0UNSHARD')")
        stage, kind, mb = match.groups()
        return Action(int(stage), Kind(kind), int(mb) if mb else None)


Schedule = dict[int, list[Action]]


def parse_schedule(rows: Mapping[int, Iterable[str]] | Sequence[Iterable[str]]) -> Schedule:
    """Build a schedule from strings, e.g. ``{0: ["0F0", "0F1"], 1: [...]}`` or a list of rows."""
    items = rows.items() if isinstance(rows, Mapping) else enumerate(rows)
    return {rank: [Action.parse(a) for a in row] for rank, row in items}


# --------------------------------------------------------------------------------------------------
# validation


class ScheduleError(ValueError):
    """A schedule that would compute something twice, miss something, or deadlock."""


def validate(
    schedule: Mapping[int, Sequence[Action]],
    pipeline_parallel_size: int,
    stages_per_rank: int,
    num_microbatches: int,
    *,
    backward: bool = True,
    placement: StagePlacement = LOOP,
) -> None:
    """Check a compute-only schedule: complete, placed correctly, and executable without deadlock.

    Rules: every stage runs every micro-batch's forward exactly once (and, if ``backward``, its backward
    exactly once: either one ``B``, or one ``I`` and, later in the same rank's list, one ``W``), on the rank
    ``placement`` gives it; and executing every rank's list in order, where a forward waits for the
    previous stage's forward of the same micro-batch, a ``B`` or ``I`` waits for its own forward and the next
    stage's ``B`` or ``I``, and a ``W`` for its own ``I``, finishes. Raises :class:`ScheduleError` with the
    whole schedule printed on failure.
    """
    p, v, m = pipeline_parallel_size, stages_per_rank, num_microbatches
    num_stages = p * v
    if sorted(schedule) != list(range(p)):
        raise ScheduleError(f"schedule must have ranks 0..{p - 1}, has {sorted(schedule)}")
    seen: Counter[tuple[int, Kind, int | None]] = Counter()
    for rank, actions in schedule.items():
        inputs_done: set[tuple[int, int | None]] = set()
        for a in actions:
            if not a.is_compute:
                raise ScheduleError(f"rank {rank}: {a} is not a compute action; validate before lowering")
            if not 0 <= a.stage < num_stages:
                raise ScheduleError(f"rank {rank}: {a} names stage {a.stage}; there are {num_stages}")
            if placement.rank_of(a.stage, p) != rank:
                raise ScheduleError(
                    f"rank {rank}: {a} belongs on rank {placement.rank_of(a.stage, p)} (the {placement.name} placement)"
                )
            if a.microbatch is None or not 0 <= a.microbatch < m:
                raise ScheduleError(f"rank {rank}: {a} names micro-batch {a.microbatch}; there are {m}")
            if a.kind in BACKWARD_KINDS and not backward:
                raise ScheduleError(f"rank {rank}: {a} is a backward in a forward-only schedule")
            if a.kind is I:
                inputs_done.add((a.stage, a.microbatch))
            elif a.kind is W and (a.stage, a.microbatch) not in inputs_done:
                raise ScheduleError(
                    f"rank {rank}: {a} runs before {Action(a.stage, I, a.microbatch)}; a weight gradient needs the"
                    " output gradient its input gradient received\n" + format_schedule(schedule)
                )
            seen[(a.stage, a.kind, a.microbatch)] += 1
    for s in range(num_stages):
        for mb in range(m):
            expected = {F: 1}
            if backward and (seen[(s, I, mb)] or seen[(s, W, mb)]):
                expected |= {B: 0, I: 1, W: 1}  # a split backward: one I and one W instead of the B
            elif backward:
                expected |= {B: 1}
            for kind, want in expected.items():
                found = seen[(s, kind, mb)]
                if found != want:
                    raise ScheduleError(
                        f"stage {s} runs {Action(s, kind, mb)} {found} times, expected"
                        f" {'once' if want else 'none beside its I and W'}\n" + format_schedule(schedule)
                    )
    last_forwards = [
        a.microbatch for acts in schedule.values() for a in acts if a.stage == num_stages - 1 and a.kind is F
    ]
    if last_forwards != sorted(last_forwards):
        raise ScheduleError(
            f"the last stage must run its forwards in micro-batch order (torch's runtime keeps losses by arrival),"
            f" got {last_forwards}\n" + format_schedule(schedule)
        )
    _check_executable(schedule, num_stages)


def _check_executable(schedule: Mapping[int, Sequence[Action]], num_stages: int) -> None:
    done: set[tuple[int, Kind, int | None]] = set()
    cursor = dict.fromkeys(schedule, 0)
    remaining = sum(len(a) for a in schedule.values())
    while remaining:
        progress = False
        for rank, actions in schedule.items():
            while cursor[rank] < len(actions) and ready(actions[cursor[rank]], done, num_stages):
                a = actions[cursor[rank]]
                done.add((a.stage, a.kind, a.microbatch))
                cursor[rank] += 1
                remaining -= 1
                progress = True
        if not progress:
            blocked = ", ".join(
                f"rank {r} waits at {acts[cursor[r]]}" for r, acts in schedule.items() if cursor[r] < len(acts)
            )
            raise ScheduleError(f"schedule deadlocks: {blocked}\n" + format_schedule(schedule))


def ready(a: Action, done: set[tuple[int, Kind, int | None]], num_stages: int) -> bool:
    """Whether ``a`` can run once the actions in ``done`` (``(stage, kind, micro-batch)``) have."""
    if a.kind is F:
        return a.stage == 0 or (a.stage - 1, F, a.microbatch) in done
    if a.kind in (B, I):  # both send the input gradient the previous stage waits for
        own_forward = (a.stage, F, a.microbatch) in done
        downstream = a.stage == num_stages - 1 or any((a.stage + 1, kind, a.microbatch) in done for kind in (B, I))
        return own_forward and downstream
    if a.kind is W:
        return (a.stage, I, a.microbatch) in done
    return True


# --------------------------------------------------------------------------------------------------
# lowering: data-parallel actions

SHARDED = ("full_shard", "shard_grad_op", "no_shard")


def add_sharding_actions(
    actions: Sequence[Action],
    sharding: str,
    num_microbatches: int,
    *,
    prefetch: int = 1,
    reduce_grads: bool = True,
    keep: int | None = None,
) -> list[Action]:
    """Given one rank's compute actions, add UNSHARD / RESHARD / REDUCE_GRAD for sharded data parallelism.

    The unit is a *visit*: a maximal run of consecutive compute actions on one stage in one direction (forwards;
    or backwards, where ``B``, ``I`` and ``W`` all need the stage's weights and mix in one visit). A stage is
    unsharded (its weights all-gathered) for a visit; with ``prefetch=k`` the stages of the next ``k`` visits are
    unsharded when the current visit starts, so their gathers overlap this visit's compute (``0``: each stage
    is gathered when its visit starts), and a stage needed again within the next ``keep`` visits is kept rather
    than released. ``REDUCE_GRAD`` follows a stage's last gradient action (``B``, or ``W`` of a split
    backward). When a stage is released depends on ``sharding``:

    - ``"full_shard"`` (ZeRO-3): after every visit, unless one of the next ``keep`` visits is to the same stage
      (as with the last local stage, whose forward sweep is followed by its backward sweep).
    - ``"shard_grad_op"`` (ZeRO-2) and ``"no_shard"``: after the stage's gradients are reduced (or, without
      backward, after its last forward), so the weights are gathered once per step.

    ``keep=None`` (the default) under ``full_shard`` takes the longest look-ahead that holds no more stages
    gathered at once than ``keep=prefetch`` does: a stage is released only where the memory it frees is needed
    at the peak. Under breadth-first with ``prefetch=1`` that holds at most two stages' full weights and
    gathers ``2v − 2`` times per rank per step (``v`` forward visits and ``v − 2`` more in the backward sweep:
    the last two local stages stay gathered from their forwards to their backwards), ``v`` for ``v ≤ 2``,
    where releasing after every visit unless the next one is to the same stage costs ``2v − 1`` for the same
    peak (depth-first at p=4, v=4, m=16: 25 gathers against 75); ``shard_grad_op``
    gathers ``v`` times. A schedule that switches stages at every action (the interleaved zero-bubble ones)
    asks for a ``keep`` as long as its list, so that ``full_shard`` gathers each stage once per step and
    releases it after its last action, as torch's lowering does for up to three stages.

    Each ``REDUCE_GRAD`` only starts the reduction; its ``WAIT_REDUCE_GRAD`` comes as late as it can while at
    most one reduction is pending per rank (the rule torch ≥ 2.15's runtime enforces): just before the rank's next
    ``REDUCE_GRAD``, or at the end of the list. The backward in between (a whole sweep of the next stage, under
    breadth-first) is what the reduction overlaps; the list's last wait is where the step's gradients are complete.

    ``reduce_grads=False`` leaves the ``REDUCE_GRAD`` actions out: for the batches of a gradient-accumulation
    window before its last, whose gradients FSDP2 keeps unsharded and adds to until the last batch's
    reduction (one reduction per optimizer step instead of one per batch).

    Written here rather than taken from torch's ``_add_unshard_reshard`` because that pass keeps up to three
    stages unsharded (a fixed look-ahead of three distinct stages), which for ``v ≤ 3`` never reshards at all
    and gives up ZeRO-3's memory saving under breadth-first, and it has no ZeRO-2 variant.
    """
    if sharding not in SHARDED:
        raise ValueError(f"unknown sharding {sharding!r}; choose one of {', '.join(SHARDED)}")
    for name, value in (("prefetch", prefetch), ("keep", prefetch if keep is None else keep)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int (visits looked ahead), got {value!r}")
    visits = _visits(actions)

    def lower(look_ahead: int) -> list[Action]:
        return _lower_visits(visits, sharding, num_microbatches, prefetch, max(prefetch, look_ahead),
                             reduce_grads=reduce_grads)  # fmt: skip

    if keep is not None or sharding != "full_shard":
        return lower(prefetch if keep is None else keep)
    # the longest look-ahead whose list holds no more stages gathered at once than `prefetch` alone does: the
    # residency only grows with the look-ahead (a longer one releases a subset), so bisect on it
    lowest = lower(prefetch)
    peak = max_resident_stages(lowest)
    best, lo, hi = lowest, prefetch + 1, len(visits)
    while lo <= hi:
        mid = (lo + hi) // 2
        candidate = lower(mid)
        if max_resident_stages(candidate) <= peak:
            best, lo = candidate, mid + 1
        else:
            hi = mid - 1
    return best


def _lower_visits(
    visits: list[tuple[int, Kind, list[Action]]],
    sharding: str,
    num_microbatches: int,
    prefetch: int,
    keep: int,
    *,
    reduce_grads: bool,
) -> list[Action]:
    """:func:`add_sharding_actions` for one look-ahead ``keep``."""
    has_backward = any(kind is B for _, kind, _ in visits)
    last_forward_visit = {v_stage: i for i, (v_stage, kind, _) in enumerate(visits) if kind is F}
    next_visit: dict[int, int] = {}  # visit index -> the index of the next visit to the same stage, if any
    following: dict[int, int] = {}
    for i in reversed(range(len(visits))):
        if visits[i][0] in following:
            next_visit[i] = following[visits[i][0]]
        following[visits[i][0]] = i
    backward_count: Counter[int] = Counter()
    out: list[Action] = []
    active: list[int] = []
    pending: list[int] = []  # the stage whose reduction is under way, if any

    def reduce(stage: int) -> None:
        if pending:
            out.append(Action(pending.pop(), WAIT_REDUCE_GRAD))
        out.append(Action(stage, REDUCE_GRAD))
        pending.append(stage)

    def unshard(stage: int) -> None:
        active.append(stage)
        out.append(Action(stage, UNSHARD))

    def reshard(stage: int) -> None:
        active.remove(stage)
        out.append(Action(stage, RESHARD))

    for i, (stage, kind, run) in enumerate(visits):
        if stage not in active:
            unshard(stage)
        for upcoming, _, _ in visits[i + 1 : i + 1 + prefetch]:  # the next `prefetch` visits' stages
            if upcoming not in active:
                unshard(upcoming)
        out.extend(run)
        finished = False
        gradients = sum(1 for a in run if a.kind in GRADIENT_KINDS)  # an I-only visit adds no weight gradient
        if kind is B:
            backward_count[stage] += gradients
            if backward_count[stage] == num_microbatches:
                if reduce_grads:
                    reduce(stage)
                finished = True
        elif not has_backward and last_forward_visit[stage] == i:
            finished = True
        if i in next_visit and next_visit[i] - i <= keep:
            continue  # needed again within `keep` visits: keep it rather than gather it again
        if sharding == "full_shard" or finished:
            reshard(stage)
    for stage in list(active):
        reshard(stage)
    if pending:
        out.append(Action(pending.pop(), WAIT_REDUCE_GRAD))
    return out


def _visits(actions: Sequence[Action]) -> list[tuple[int, Kind, list[Action]]]:
    """Runs of one stage in one direction, each as ``(stage, F or B, actions)``: ``I`` and ``W`` count as ``B``."""
    visits: list[tuple[int, Kind, list[Action]]] = []
    for a in actions:
        if not a.is_compute:
            raise ValueError(f"{a} is not a compute action; lower a compute-only schedule")
        direction = F if a.kind is F else B
        if visits and visits[-1][0] == a.stage and visits[-1][1] is direction:
            visits[-1][2].append(a)
        else:
            visits.append((a.stage, direction, [a]))
    return visits


# --------------------------------------------------------------------------------------------------
# inspection


def count(actions: Iterable[Action], kind: Kind, stage: int | None = None) -> int:
    return sum(1 for a in actions if a.kind is kind and (stage is None or a.stage == stage))


def max_resident_stages(actions: Sequence[Action]) -> int:
    """The largest number of stages whose full weights are held at once on this rank."""
    resident = peak = 0
    for a in actions:
        if a.kind is UNSHARD:
            resident += 1
            peak = max(peak, resident)
        elif a.kind is RESHARD:
            resident -= 1
    return peak


def format_schedule(schedule: Mapping[int, Sequence[Action]]) -> str:
    """One row per rank, one column per step, as torch and the paper draw schedules."""
    width = max((len(str(a)) for acts in schedule.values() for a in acts), default=3)
    rows = []
    for rank in sorted(schedule):
        cells = " ".join(f"{a!s:>{width}}" for a in schedule[rank])
        rows.append(f"rank {rank}: {cells}")
    return "\n".join(rows)
