"""Pipeline schedules as data: per-rank ordered action lists, generated, validated and lowered. Pure.

A schedule is ``dict[pipeline_rank, list[Action]]``. Generators produce the *compute* actions (forward
``F`` and backward ``B`` of one micro-batch through one stage); :func:`add_sharding_actions` then inserts
the data-parallel actions (``UNSHARD`` = all-gather a stage's weights, ``RESHARD`` = free them,
``REDUCE_GRAD`` = reduce its gradients); the execution half turns the result into torch's own action IR
and lets torch add the point-to-point sends and receives. Nothing here imports ``torch``: a schedule is
generated, checked and printed in microseconds, and the same lists are what the runtime executes.

The string form is torch's: ``2F0`` is stage 2, forward, micro-batch 0; ``1UNSHARD`` acts on stage 1.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from lightning_bfpp.plan.partition import rank_stages, stage_rank


class Kind(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    REDUCE_GRAD = "REDUCE_GRAD"


F, B = Kind.FORWARD, Kind.BACKWARD
UNSHARD, RESHARD, REDUCE_GRAD = Kind.UNSHARD, Kind.RESHARD, Kind.REDUCE_GRAD
COMPUTE = (F, B)

_ACTION_RE = re.compile(r"^(\d+)(F|B|UNSHARD|RESHARD|REDUCE_GRAD)(\d*)$")


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
            raise ValueError(f"not an action: {text!r} (expected e.g. '2F0', '1B3', '0UNSHARD')")
        stage, kind, mb = match.groups()
        return Action(int(stage), Kind(kind), int(mb) if mb else None)


Schedule = dict[int, list[Action]]


def parse_schedule(rows: Mapping[int, Iterable[str]] | Sequence[Iterable[str]]) -> Schedule:
    """Build a schedule from strings, e.g. ``{0: ["0F0", "0F1"], 1: [...]}`` or a list of rows."""
    items = rows.items() if isinstance(rows, Mapping) else enumerate(rows)
    return {rank: [Action.parse(a) for a in row] for rank, row in items}


# --------------------------------------------------------------------------------------------------
# generators


def breadth_first(pipeline_parallel_size: int, stages_per_rank: int, num_microbatches: int) -> Schedule:
    """The breadth-first schedule (Lamy-Poirier, MLSys 2023) on the looping placement.

    Each rank runs every micro-batch through one local stage before moving to its next local stage, in
    stage order; then the backward visits the local stages in reverse order, again all micro-batches per
    stage. Each stage is therefore visited once per forward sweep and once per backward sweep, which is what
    lets sharded data parallelism gather its weights once per sweep and reduce its gradients once.
    """
    p, v, m = _check_sizes(pipeline_parallel_size, stages_per_rank, num_microbatches)
    schedule: Schedule = {}
    for rank in range(p):
        stages = rank_stages(rank, p, v)
        actions = [Action(s, F, mb) for s in stages for mb in range(m)]
        actions += [Action(s, B, mb) for s in reversed(stages) for mb in range(m)]
        schedule[rank] = actions
    return schedule


def gpipe(pipeline_parallel_size: int, stages_per_rank: int, num_microbatches: int) -> Schedule:
    """GPipe (Huang et al. 2019): every forward, then every backward, one stage per rank.

    On a looped placement this order is breadth-first, so ``gpipe`` is kept to its own, non-looped case.
    """
    _require_one_stage("gpipe", stages_per_rank)
    return breadth_first(pipeline_parallel_size, 1, num_microbatches)


def one_f_one_b(pipeline_parallel_size: int, stages_per_rank: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush, DAPPLE): ``p − r − 1`` warm-up forwards, then alternate one forward and one backward.

    Same bubble as GPipe, but a rank holds at most ``p − r`` micro-batches' activations instead of ``m``.
    """
    _require_one_stage("1f1b", stages_per_rank)
    return _interleaved(pipeline_parallel_size, 1, num_microbatches, group_size=num_microbatches, one_chunk=True)


def depth_first(
    pipeline_parallel_size: int,
    stages_per_rank: int,
    num_microbatches: int,
    microbatch_group_size: int | None = None,
) -> Schedule:
    """Interleaved 1F1B in Megatron-LM's order (its "virtual pipeline"), the paper's depth-first baseline.

    Micro-batches go in groups of ``N = microbatch_group_size`` (Megatron's
    ``microbatch_group_size_per_vp_stage``): a rank runs a group through one local stage, then the same group
    through its next local stage, and so on; after ``2(p − r − 1) + (v − 1)·N`` warm-up forwards it alternates
    one forward and one backward. ``N = p`` (the default) is depth-first; larger ``N`` holds more
    micro-batches per stage visit, and ``N = m`` visits each stage once per direction during warm-up and
    cool-down, as breadth-first does (Llama 3 tunes ``N`` between the two). Requires ``p ≤ N ≤ m``.
    """
    p, v, m = _check_sizes(pipeline_parallel_size, stages_per_rank, num_microbatches)
    n = p if microbatch_group_size is None else microbatch_group_size
    if m < p:
        raise ValueError(
            f"depth_first needs num_microbatches ≥ pipeline_parallel_size ({m} < {p}); raise num_microbatches"
            " or use schedule='breadth_first'."
        )
    if not p <= n <= m:
        raise ValueError(
            f"microbatch_group_size must lie in [pipeline_parallel_size, num_microbatches] = [{p}, {m}], got {n}."
        )
    if m % n and m % n < p:
        raise ValueError(
            f"microbatch_group_size={n} leaves a last group of {m % n} micro-batches, fewer than"
            f" pipeline_parallel_size={p}, which stalls the pipeline; choose a group size that divides"
            f" num_microbatches={m} or leaves at least {p}."
        )
    return _interleaved(p, v, m, group_size=n)


def _interleaved(p: int, v: int, m: int, *, group_size: int, one_chunk: bool = False) -> Schedule:
    schedule: Schedule = {}
    for rank in range(p):
        stages = rank_stages(rank, p, v)
        groups = [range(start, min(start + group_size, m)) for start in range(0, m, group_size)]
        forwards = [Action(stages[k], F, mb) for g in groups for k in range(v) for mb in g]
        backwards = [Action(stages[k], B, mb) for g in groups for k in reversed(range(v)) for mb in g]
        # Megatron's warm-up counts: non-interleaved 1F1B, and interleaved with groups of N
        warmup = min(m, p - rank - 1) if one_chunk else min(v * m, 2 * (p - rank - 1) + (v - 1) * group_size)
        actions = forwards[:warmup]
        for i in range(v * m - warmup):
            actions += [forwards[warmup + i], backwards[i]]
        actions += backwards[v * m - warmup :]
        schedule[rank] = actions
    return schedule


def _require_one_stage(name: str, stages_per_rank: int) -> None:
    if stages_per_rank != 1:
        raise ValueError(
            f"schedule={name!r} is a non-looped schedule: it needs stages_per_rank=1 (got {stages_per_rank});"
            " for several stages per rank use 'breadth_first' or 'depth_first'."
        )


def weight_passing(num_chunks: int, num_microbatches: int) -> Schedule:
    """Weight passing (WeiPipe, PPoPP 2025; TawPipe, AAAI 2026): one rank's order, the same on every rank.

    Every rank runs its own micro-batches through the whole model, one micro-batch at a time: forward
    through chunks ``0 … n−1``, then backward through ``n−1 … 0``. The chunks' weights travel to the rank
    instead of its activations to other ranks, so there is no pipeline (``pipeline_parallel_size=1``, all
    ``n`` chunks "local") and every rank's list is this one.
    """
    _, n, m = _check_sizes(1, num_chunks, num_microbatches)
    actions: list[Action] = []
    for mb in range(m):
        actions += [Action(c, F, mb) for c in range(n)]
        actions += [Action(c, B, mb) for c in reversed(range(n))]
    return {0: actions}


def forward_only(pipeline_parallel_size: int, stages_per_rank: int, num_microbatches: int) -> Schedule:
    """Breadth-first forwards without backward: the evaluation schedule (validation, test, predict)."""
    p, v, m = _check_sizes(pipeline_parallel_size, stages_per_rank, num_microbatches)
    return {r: [Action(s, F, mb) for s in rank_stages(r, p, v) for mb in range(m)] for r in range(p)}


SCHEDULES = ("breadth_first", "depth_first", "gpipe", "1f1b", "weight_passing")
LOOPED_SCHEDULES = ("breadth_first", "depth_first")


def generate(
    name: str,
    pipeline_parallel_size: int,
    stages_per_rank: int,
    num_microbatches: int,
    microbatch_group_size: int | None = None,
) -> Schedule:
    """The compute-only training schedule called ``name`` (one of :data:`SCHEDULES`)."""
    if microbatch_group_size is not None and name != "depth_first":
        raise ValueError(f"microbatch_group_size applies to schedule='depth_first', not {name!r}")
    if name == "breadth_first":
        return breadth_first(pipeline_parallel_size, stages_per_rank, num_microbatches)
    if name == "depth_first":
        return depth_first(pipeline_parallel_size, stages_per_rank, num_microbatches, microbatch_group_size)
    if name == "gpipe":
        return gpipe(pipeline_parallel_size, stages_per_rank, num_microbatches)
    if name == "1f1b":
        return one_f_one_b(pipeline_parallel_size, stages_per_rank, num_microbatches)
    if name == "weight_passing":
        if pipeline_parallel_size != 1:
            raise ValueError(
                "schedule='weight_passing' moves weights, not activations: it needs pipeline_parallel_size=1"
                f" (got {pipeline_parallel_size}); its chunks are the stages of that one rank."
            )
        return weight_passing(stages_per_rank, num_microbatches)
    raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")


def _check_sizes(p: int, v: int, m: int) -> tuple[int, int, int]:
    for name, value in (("pipeline_parallel_size", p), ("stages_per_rank", v), ("num_microbatches", m)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return p, v, m


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
) -> None:
    """Check a compute-only schedule: complete, placed correctly, and executable without deadlock.

    Rules: every stage runs every micro-batch's forward exactly once (and, if ``backward``, its backward
    exactly once), on the rank the looping placement gives it; and executing every rank's list in order,
    where a forward waits for the previous stage's forward of the same micro-batch and a backward waits for
    its own forward and the next stage's backward, finishes. Raises :class:`ScheduleError` with the whole
    schedule printed on failure.
    """
    p, v, m = pipeline_parallel_size, stages_per_rank, num_microbatches
    num_stages = p * v
    if sorted(schedule) != list(range(p)):
        raise ScheduleError(f"schedule must have ranks 0..{p - 1}, has {sorted(schedule)}")
    seen: Counter[tuple[int, Kind, int | None]] = Counter()
    for rank, actions in schedule.items():
        for a in actions:
            if not a.is_compute:
                raise ScheduleError(f"rank {rank}: {a} is not a compute action; validate before lowering")
            if not 0 <= a.stage < num_stages:
                raise ScheduleError(f"rank {rank}: {a} names stage {a.stage}; there are {num_stages}")
            if stage_rank(a.stage, p) != rank:
                raise ScheduleError(
                    f"rank {rank}: {a} belongs on rank {stage_rank(a.stage, p)} (stage s lives on rank s mod p)"
                )
            if a.microbatch is None or not 0 <= a.microbatch < m:
                raise ScheduleError(f"rank {rank}: {a} names micro-batch {a.microbatch}; there are {m}")
            if a.kind is B and not backward:
                raise ScheduleError(f"rank {rank}: {a} is a backward in a forward-only schedule")
            seen[(a.stage, a.kind, a.microbatch)] += 1
    kinds = (F, B) if backward else (F,)
    for s in range(num_stages):
        for kind in kinds:
            for mb in range(m):
                count = seen[(s, kind, mb)]
                if count != 1:
                    raise ScheduleError(
                        f"stage {s} runs {Action(s, kind, mb)} {count} times, expected once\n"
                        + format_schedule(schedule)
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
            while cursor[rank] < len(actions) and _ready(actions[cursor[rank]], done, num_stages):
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


def _ready(a: Action, done: set[tuple[int, Kind, int | None]], num_stages: int) -> bool:
    if a.kind is F:
        return a.stage == 0 or (a.stage - 1, F, a.microbatch) in done
    if a.kind is B:
        own_forward = (a.stage, F, a.microbatch) in done
        downstream = a.stage == num_stages - 1 or (a.stage + 1, B, a.microbatch) in done
        return own_forward and downstream
    return True


# --------------------------------------------------------------------------------------------------
# lowering: data-parallel actions

Sharding = str  # "full_shard" | "shard_grad_op" | "no_shard" | "weight_passing"


def add_sharding_actions(
    actions: Sequence[Action],
    sharding: Sharding,
    num_microbatches: int,
    *,
    prefetch: int = 1,
    reduce_grads: bool = True,
) -> list[Action]:
    """Given one rank's compute actions, add UNSHARD / RESHARD / REDUCE_GRAD for sharded data parallelism.

    The unit is a *visit*: a maximal run of consecutive compute actions on one stage. A stage is unsharded
    (its weights all-gathered) for a visit; with ``prefetch=k`` the stages of the next ``k`` visits are
    unsharded when the current visit starts, so their gathers overlap this visit's compute (``0``: each stage
    is gathered when its visit starts), and a stage needed again within those ``k`` visits is kept rather
    than released. ``REDUCE_GRAD`` follows a stage's last backward. When a stage is released depends on ``sharding``:

    - ``"full_shard"`` (ZeRO-3): after every visit, unless one of the next ``prefetch`` visits is to the same
      stage (as with the last local stage, whose forward sweep is followed by its backward sweep).
    - ``"shard_grad_op"`` (ZeRO-2) and ``"no_shard"``: after the stage's gradients are reduced (or, without
      backward, after its last forward), so the weights are gathered once per step.

    Under breadth-first that gives ``2v − 1`` gathers per rank per step with ``full_shard``, ``v`` with
    ``shard_grad_op``, and at most ``prefetch + 1`` stages' full weights resident at once with ``full_shard``.

    - ``"weight_passing"``: like ``"full_shard"`` (a chunk's weights are fetched for a visit and freed after
      it), but its gradients are reduced to their owner after *every* backward visit: a rank holds no
      gradients of chunks it does not own beyond one micro-batch's.

    ``reduce_grads=False`` leaves the ``REDUCE_GRAD`` actions out: for the batches of a gradient-accumulation
    window before its last, whose gradients FSDP2 keeps unsharded and adds to until the last batch's
    reduction (one reduction per optimizer step instead of one per batch).

    Written here rather than taken from torch's ``_add_unshard_reshard`` because that pass keeps up to three
    stages unsharded (a fixed look-ahead of three distinct stages), which for ``v ≤ 3`` never reshards at all
    and gives up ZeRO-3's memory saving, and it has no ZeRO-2 variant.
    """
    if sharding not in ("full_shard", "shard_grad_op", "no_shard", "weight_passing"):
        raise ValueError(f"unknown sharding {sharding!r}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be a non-negative int (stages gathered ahead), got {prefetch!r}")
    visits = _visits(actions)
    has_backward = any(a.kind is B for a in actions)
    last_forward_visit = {v_stage: i for i, (v_stage, kind, _) in enumerate(visits) if kind is F}
    backward_count: Counter[int] = Counter()
    out: list[Action] = []
    active: list[int] = []

    def unshard(stage: int) -> None:
        active.append(stage)
        out.append(Action(stage, UNSHARD))

    def reshard(stage: int) -> None:
        active.remove(stage)
        out.append(Action(stage, RESHARD))

    for i, (stage, kind, run) in enumerate(visits):
        if stage not in active:
            unshard(stage)
        ahead = [upcoming for upcoming, _, _ in visits[i + 1 : i + 1 + prefetch]]  # the next `prefetch` visits'
        for upcoming in ahead:
            if upcoming not in active:
                unshard(upcoming)
        out.extend(run)
        finished = False
        if kind is B and sharding == "weight_passing":
            out.append(Action(stage, REDUCE_GRAD))  # per visit, whatever `reduce_grads` (the owner accumulates)
        elif kind is B:
            backward_count[stage] += len(run)
            if backward_count[stage] == num_microbatches:
                if reduce_grads:
                    out.append(Action(stage, REDUCE_GRAD))
                finished = True
        elif not has_backward and last_forward_visit[stage] == i:
            finished = True
        if stage in ahead:
            continue  # needed again within the look-ahead: keep it rather than gather it again
        if sharding in ("full_shard", "weight_passing") or finished:
            reshard(stage)
    for stage in list(active):
        reshard(stage)
    return out


def lower(
    schedule: Mapping[int, Sequence[Action]],
    sharding: Sharding,
    num_microbatches: int,
    *,
    reduce_grads: bool = True,
    prefetch: int = 1,
) -> Schedule:
    """:func:`add_sharding_actions` applied to every rank."""
    return {
        r: add_sharding_actions(a, sharding, num_microbatches, reduce_grads=reduce_grads, prefetch=prefetch)
        for r, a in schedule.items()
    }


def _visits(actions: Sequence[Action]) -> list[tuple[int, Kind, list[Action]]]:
    visits: list[tuple[int, Kind, list[Action]]] = []
    for a in actions:
        if not a.is_compute:
            raise ValueError(f"{a} is not a compute action; lower a compute-only schedule")
        if visits and visits[-1][0] == a.stage and visits[-1][1] is a.kind:
            visits[-1][2].append(a)
        else:
            visits.append((a.stage, a.kind, [a]))
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
