"""Pipeline schedules as data: per-rank ordered action lists, generated, validated and lowered. Pure.

A schedule is ``dict[pipeline_rank, list[Action]]``. Generators produce the *compute* actions (forward
``F`` and backward ``B`` of one micro-batch through one stage, or the backward split in two as zero-bubble
schedules do: ``I``, the input gradient the previous stage waits for, and ``W``, the weight gradient nobody
waits for); :func:`add_sharding_actions` then inserts the data-parallel actions (``UNSHARD`` = all-gather
a stage's weights, ``RESHARD`` = free them,
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
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    REDUCE_GRAD = "REDUCE_GRAD"


F, B = Kind.FORWARD, Kind.BACKWARD
I, W = Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT  # noqa: E741 (torch's own names for the split backward)
UNSHARD, RESHARD, REDUCE_GRAD = Kind.UNSHARD, Kind.RESHARD, Kind.REDUCE_GRAD
COMPUTE = (F, B, I, W)
BACKWARD_KINDS = (B, I, W)
GRADIENT_KINDS = (B, W)  # the actions that add to a stage's weight gradients

_ACTION_RE = re.compile(r"^(\d+)(F|B|I|W|UNSHARD|RESHARD|REDUCE_GRAD)(\d*)$")


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
# generators


def breadth_first(pipeline_parallel_size: int, stages_per_rank: int, num_microbatches: int) -> Schedule:
    """The breadth-first schedule (Lamy-Poirier, MLSys 2023) on the looping placement.

    Each rank runs every micro-batch through one local stage before moving to its next local stage, in
    stage order; then the backward visits the local stages in reverse order, again all micro-batches per
    stage. Each stage is therefore visited once per forward sweep and once per backward sweep, which is what
    lets sharded data parallelism gather its weights once per sweep and reduce its gradients once.
    """
    p, v, m = _check_sizes(pipeline_parallel_size, stages_per_rank, num_microbatches)
    return _sweeps(p, v, m, B)


def _sweeps(p: int, v: int, m: int, backward: Kind) -> Schedule:
    """Per rank: every micro-batch forward through each local stage in order, then ``backward`` (``B``, or the
    input gradient ``I``) through each in reverse order."""
    schedule: Schedule = {}
    for rank in range(p):
        stages = rank_stages(rank, p, v)
        actions = [Action(s, F, mb) for s in stages for mb in range(m)]
        actions += [Action(s, backward, mb) for s in reversed(stages) for mb in range(m)]
        schedule[rank] = actions
    return schedule


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

    Gathers per rank per step under ``full_shard`` with ``prefetch=1``: at most ``3v − 2`` against
    breadth-first's ``2v − 1``, exactly that when ``m ≥ p``: ``v`` forward visits, ``v − 1`` further
    input-gradient visits, and one more for each local stage but the first, whose input-gradient sweep is the
    last and whose ``W``'s join it (a longer look-ahead keeps some stages from their ``I``'s to their ``W``'s).
    ``shard_grad_op`` and ``no_shard`` still gather each stage once. Each stage's ``REDUCE_GRAD`` follows its
    last ``W``; a micro-batch's activations are held until its ``W``, not its ``I``.
    """
    p, v, m = _check_sizes(pipeline_parallel_size, stages_per_rank, num_microbatches)
    return _fill_with_weight_gradients(_sweeps(p, v, m, I), p * v)


def _fill_with_weight_gradients(sweeps: Schedule, num_stages: int) -> Schedule:
    """Add one ``W`` after each ``I`` of ``sweeps``: in the rank's waits (list scheduling in unit times), else at
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
    cursor = dict.fromkeys(sweeps, 0)
    free_at = dict.fromkeys(sweeps, 0)
    out: Schedule = {rank: [] for rank in sweeps}
    pending: dict[int, dict[int, list[int]]] = {rank: {} for rank in sweeps}  # rank → stage → micro-batches
    latest: dict[int, list[int]] = {rank: [] for rank in sweeps}  # stages by their latest I, most recent last
    now = 0
    while any(cursor[rank] < len(actions) for rank, actions in sweeps.items()):
        done = {key for key, at in finished_at.items() if at <= now}
        progressed = False
        for rank, actions in sweeps.items():
            while free_at[rank] <= now:
                if cursor[rank] < len(actions) and _ready(actions[cursor[rank]], done, num_stages):
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
            and all(free_at[rank] <= now for rank in sweeps)
            and max(finished_at.values(), default=0) <= now
        ):
            raise ScheduleError(
                "the sweeps deadlock before their weight gradients are placed\n" + format_schedule(sweeps)
            )
        now += 1
    for rank in sweeps:
        for stage in reversed(latest[rank]):
            out[rank] += [Action(stage, W, mb) for mb in pending[rank][stage]]
    return out


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


SCHEDULES = ("breadth_first", "depth_first", "gpipe", "1f1b", "weight_passing", "breadth_first_zb")
LOOPED_SCHEDULES = ("breadth_first", "depth_first", "breadth_first_zb")


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
    if name == "breadth_first_zb":
        return breadth_first_zb(pipeline_parallel_size, stages_per_rank, num_microbatches)
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
    exactly once: either one ``B``, or one ``I`` and, later in the same rank's list, one ``W``), on the rank
    the looping placement gives it; and executing every rank's list in order, where a forward waits for the
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
            if stage_rank(a.stage, p) != rank:
                raise ScheduleError(
                    f"rank {rank}: {a} belongs on rank {stage_rank(a.stage, p)} (stage s lives on rank s mod p)"
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
                count = seen[(s, kind, mb)]
                if count != want:
                    raise ScheduleError(
                        f"stage {s} runs {Action(s, kind, mb)} {count} times, expected"
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
    if a.kind in (B, I):  # both send the input gradient the previous stage waits for
        own_forward = (a.stage, F, a.microbatch) in done
        downstream = a.stage == num_stages - 1 or any((a.stage + 1, kind, a.microbatch) in done for kind in (B, I))
        return own_forward and downstream
    if a.kind is W:
        return (a.stage, I, a.microbatch) in done
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

    The unit is a *visit*: a maximal run of consecutive compute actions on one stage in one direction (forwards;
    or backwards, where ``B``, ``I`` and ``W`` all need the stage's weights and mix in one visit). A stage is unsharded
    (its weights all-gathered) for a visit; with ``prefetch=k`` the stages of the next ``k`` visits are
    unsharded when the current visit starts, so their gathers overlap this visit's compute (``0``: each stage
    is gathered when its visit starts), and a stage needed again within those ``k`` visits is kept rather
    than released. ``REDUCE_GRAD`` follows a stage's last gradient action (``B``, or ``W`` of a split backward).
    When a stage is released depends on ``sharding``:

    - ``"full_shard"`` (ZeRO-3): after every visit, unless one of the next ``prefetch`` visits is to the same
      stage (as with the last local stage, whose forward sweep is followed by its backward sweep).
    - ``"shard_grad_op"`` (ZeRO-2) and ``"no_shard"``: after the stage's gradients are reduced (or, without
      backward, after its last forward), so the weights are gathered once per step.

    Under breadth-first that gives ``2v − 1`` gathers per rank per step with ``full_shard``, ``v`` with
    ``shard_grad_op``, and at most ``prefetch + 1`` stages' full weights resident at once with ``full_shard``
    (:func:`breadth_first_zb`: at most ``3v − 2`` with ``full_shard``, its deferred ``W``'s gathering again).

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
    has_backward = any(a.kind in BACKWARD_KINDS for a in actions)
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
        gradients = sum(1 for a in run if a.kind in GRADIENT_KINDS)  # an I-only visit adds no weight gradient
        if kind is B and sharding == "weight_passing":
            if gradients:
                out.append(Action(stage, REDUCE_GRAD))  # per visit, whatever `reduce_grads` (the owner accumulates)
        elif kind is B:
            backward_count[stage] += gradients
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
