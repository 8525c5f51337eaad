"""Breadth-first with the backward split into input (``I``) and weight (``W``) gradients: validity, against our
validator and torch's, the sweeps it keeps, its lowering, and the bubble it removes (pure; no processes)."""

import itertools

import pytest
from torch.distributed.pipelining.schedules import _Action as TorchAction
from torch.distributed.pipelining.schedules import _add_send_recv, _validate_schedule
from torch.distributed.pipelining.schedules import _ComputationType as TorchKind

from lightning_bfpp.engine.torch_ir import runs_on_torch
from lightning_bfpp.plan import Cluster, LayerCost, ModelProfile, Plan, gpt, simulate, uniform
from lightning_bfpp.plan.actions import (
    REDUCE_GRAD,
    RESHARD,
    UNSHARD,
    Action,
    B,
    F,
    I,
    Kind,
    ScheduleError,
    W,
    add_sharding_actions,
    count,
    max_resident_stages,
    parse_schedule,
    validate,
)
from lightning_bfpp.plan.costs import stage_costs
from lightning_bfpp.plan.placement import LOOP
from lightning_bfpp.plan.schedules import generate, get_schedule, schedule_names
from lightning_bfpp.plan.schedules.breadth_first import breadth_first, breadth_first_zb
from lightning_bfpp.plan.schedules.weight_passing import reduce_every_visit

SIZES = [(p, v, m) for p in range(1, 5) for v in range(1, 4) for m in range(1, 2 * p + 3)]


def strings(actions):
    return [str(a) for a in actions]


def to_torch(schedule):
    """The lists in the installed torch's IR (its runtime's reduction waits exist from 2.15 on)."""
    return {
        rank: [TorchAction.from_str(str(a)) for a in actions if runs_on_torch(a)] for rank, actions in schedule.items()
    }


def test_split_backward_actions_round_trip_like_torch():
    assert Kind("I") is I is Kind.BACKWARD_INPUT and Kind("W") is W is Kind.BACKWARD_WEIGHT
    for text in ("2I0", "2W0", "13I7", "0W11"):
        action = Action.parse(text)
        assert str(action) == text and action.is_compute
        assert str(TorchAction.from_str(text)) == text
    assert TorchAction.from_str("2I0").computation_type is TorchKind.BACKWARD_INPUT
    assert TorchAction.from_str("2W0").computation_type is TorchKind.BACKWARD_WEIGHT
    assert Action.parse("2W0") == Action(2, W, 0)


def lower(schedule, sharding, m, **options):
    """Every rank's list through :func:`add_sharding_actions` (what a plan's kind does by default)."""
    return {rank: add_sharding_actions(actions, sharding, m, **options) for rank, actions in schedule.items()}


def test_registered_as_a_looped_schedule():
    kind = get_schedule("breadth_first_zb")
    assert "breadth_first_zb" in schedule_names() and kind.placement == LOOP and kind.splits_backward
    assert generate("breadth_first_zb", 2, 2, 4) == breadth_first_zb(2, 2, 4)
    with pytest.raises(ValueError, match="applies to schedule='depth_first'"):
        generate("breadth_first_zb", 2, 2, 4, microbatch_group_size=2)
    with pytest.raises(ValueError, match="positive int"):
        breadth_first_zb(2, 0, 4)


def test_golden_p2_v2_m4():
    # the forward and input-gradient sweeps of breadth-first; the weight gradients fill the waits and the
    # cool-down, the stage whose input gradients ran last (still gathered) first. Stage 0's input pass is empty
    # in torch's runtime (no input gradient to compute) and its weight pass the whole backward: its W's run
    # while rank 0 waits for the next micro-batch's gradient from rank 1
    schedule = breadth_first_zb(2, 2, 4)
    assert strings(schedule[0]) == [
        "0F0", "0F1", "0F2", "0F3", "2F0", "2F1", "2F2", "2F3",
        "2I0", "2I1", "2I2", "2I3", "0I0", "0W0", "0I1", "0I2",
        "0W1", "0I3", "0W2", "0W3", "2W0", "2W1", "2W2", "2W3",
    ]  # fmt: skip
    assert strings(lower(schedule, "full_shard", 4)[0]) == [
        "0UNSHARD", "2UNSHARD", "0F0", "0F1", "0F2", "0F3",  # both stages fit the prefetch's residency: kept
        "2F0", "2F1", "2F2", "2F3",
        "2I0", "2I1", "2I2", "2I3",
        "0I0", "0W0", "0I1", "0I2", "0W1", "0I3", "0W2", "0W3", "0REDUCE_GRAD", "0RESHARD",
        "2W0", "2W1", "2W2", "2W3", "0WAIT_REDUCE_GRAD", "2REDUCE_GRAD", "2RESHARD", "2WAIT_REDUCE_GRAD",
    ]  # fmt: skip
    # releasing after every visit the look-ahead does not reach: the same two stages at most, four gathers
    assert strings(lower(schedule, "full_shard", 4, keep=1)[0]) == [
        "0UNSHARD", "2UNSHARD", "0F0", "0F1", "0F2", "0F3", "0RESHARD",
        "2F0", "2F1", "2F2", "2F3",
        "0UNSHARD", "2I0", "2I1", "2I2", "2I3", "2RESHARD",
        "2UNSHARD", "0I0", "0W0", "0I1", "0I2", "0W1", "0I3", "0W2", "0W3", "0REDUCE_GRAD", "0RESHARD",
        "2W0", "2W1", "2W2", "2W3", "0WAIT_REDUCE_GRAD", "2REDUCE_GRAD", "2RESHARD", "2WAIT_REDUCE_GRAD",
    ]  # fmt: skip


def test_weight_gradients_fill_the_waits_between_sweeps_when_m_is_below_p():
    schedule = breadth_first_zb(4, 2, 2)
    # stage 4's input gradients come back before micro-batch 0 has gone round the ring: its W's fill the wait
    assert strings(schedule[0]) == ["0F0", "0F1", "4F0", "4F1", "4I0", "4I1", "4W0", "4W1", "0I0", "0W0", "0I1", "0W1"]


@pytest.mark.parametrize(("p", "v", "m"), SIZES)
def test_valid_for_us_and_for_torch_and_keeps_the_sweeps(p, v, m):
    schedule = breadth_first_zb(p, v, m)
    validate(schedule, p, v, m)
    # torch's own checks: counts per stage, F before I before W, each stage on one rank; and it can place the
    # sends and receives (its lowering simulates the schedule and refuses one that hangs)
    mapping = _validate_schedule(to_torch(schedule), p, p * v, m)
    assert mapping == {s: s % p for s in range(p * v)}
    lowered = lower(schedule, "full_shard", m)
    _validate_schedule(to_torch(lowered), p, p * v, m)
    _add_send_recv(to_torch(lowered), stage_to_rank=lambda s: s % p, num_stages=p * v)

    reference = breadth_first(p, v, m)
    for rank, actions in schedule.items():
        # the F and I actions are breadth-first's order, with I in place of B: each stage visited once per sweep
        sweeps = [a for a in actions if a.kind is not W]
        assert sweeps == [Action(a.stage, I if a.kind is B else a.kind, a.microbatch) for a in reference[rank]]
        for stage, kind in itertools.product({a.stage for a in actions}, (F, I)):
            where = [i for i, a in enumerate(sweeps) if a.stage == stage and a.kind is kind]
            assert where == list(range(where[0], where[0] + m)), f"rank {rank}: {stage}{kind.value} not one sweep"
        # every (stage, micro-batch) once per kind, W after its I
        position = {(a.stage, a.kind, a.microbatch): i for i, a in enumerate(actions)}
        assert len(position) == len(actions) == 3 * v * m
        for stage, mb in itertools.product({a.stage for a in actions}, range(m)):
            assert position[(stage, F, mb)] < position[(stage, I, mb)] < position[(stage, W, mb)]


@pytest.mark.parametrize(("p", "v", "m"), SIZES)
def test_lowering_gathers_for_every_compute_and_reduces_after_the_last_w(p, v, m):
    schedule = breadth_first_zb(p, v, m)
    for sharding, prefetch in itertools.product(("full_shard", "shard_grad_op", "no_shard"), (0, 1, 2)):
        lowered = lower(schedule, sharding, m, prefetch=prefetch)
        for rank, actions in lowered.items():
            resident: set[int] = set()
            for a in actions:
                if a.kind is UNSHARD:
                    assert a.stage not in resident
                    resident.add(a.stage)
                elif a.kind is RESHARD:
                    resident.remove(a.stage)
                elif a.is_compute:
                    assert a.stage in resident, f"{a} computes on a sharded stage"
            assert not resident
            assert count(actions, REDUCE_GRAD) == v
            pending = None
            for stage in sorted({a.stage for a in actions}, key=lambda s: actions.index(Action(s, REDUCE_GRAD))):
                reduce_at = actions.index(Action(stage, REDUCE_GRAD))
                last_w = max(i for i, a in enumerate(actions) if a.kind is W and a.stage == stage)
                # right after it, but for the wait of the reduction before it (one pending at a time)
                assert strings(actions[last_w + 1 : reduce_at]) in ([], [f"{pending}WAIT_REDUCE_GRAD"])
                pending = stage
            gathers = count(actions, UNSHARD)
            if sharding != "full_shard":
                assert gathers == v  # once per step, as breadth-first
            elif prefetch >= 1:
                released = add_sharding_actions(schedule[rank], sharding, m, prefetch=prefetch, keep=prefetch)
                # releasing after every visit the look-ahead does not reach: one more gather than breadth-first
                # for each stage whose W's run after a later stage's visit
                assert count(released, UNSHARD) <= 3 * v - 2
                if m >= p and prefetch == 1:  # a longer look-ahead keeps some stages between their I's and W's
                    assert count(released, UNSHARD) == 3 * v - 2
                    # kept where the prefetch's residency allows: the last two local stages, from their first
                    # visit to their last
                    assert gathers == max(3 * v - 4, v)
                assert gathers <= count(released, UNSHARD)
                assert max_resident_stages(actions) == max_resident_stages(released) <= prefetch + 1
    breadth = lower(breadth_first(p, v, m), "full_shard", m)
    assert count(breadth[0], UNSHARD) == max(2 * v - 2, v)


def test_weight_passing_lowering_reduces_only_after_visits_with_weight_gradients():
    # as schedule='weight_passing' lowers its lists: a chunk fetched for each visit (look-ahead: the prefetch)
    fetched = add_sharding_actions(breadth_first_zb(1, 2, 2)[0], "full_shard", 2, keep=1, reduce_grads=False)
    lowered = reduce_every_visit(fetched)
    assert strings(lowered) == [
        "0UNSHARD", "1UNSHARD", "0F0", "0F1", "0RESHARD", "1F0", "1F1",
        "0UNSHARD", "1I0", "1I1", "1RESHARD",  # input gradients only: nothing to reduce yet
        "1UNSHARD", "0I0", "0I1", "0W0", "0W1", "0REDUCE_GRAD", "0RESHARD",
        "1W0", "1W1", "0WAIT_REDUCE_GRAD", "1REDUCE_GRAD", "1RESHARD", "1WAIT_REDUCE_GRAD",
    ]  # fmt: skip


# --------------------------------------------------------------------------------------------------
# the bubble


DURATIONS = {F: 1, B: 2, I: 1, W: 1}  # f = i = w = 1, and breadth-first's whole backward b = i + w


def makespan(schedule, num_stages):
    """List scheduling with these unit times: each rank runs its list in order, each action as soon as its inputs
    exist (no transfer time). Returns the step time and each action's start."""
    start: dict[tuple[int, Kind, int], int] = {}
    end: dict[tuple[int, Kind, int], int] = {}
    free = dict.fromkeys(schedule, 0)
    cursor = dict.fromkeys(schedule, 0)
    while any(cursor[r] < len(schedule[r]) for r in schedule):
        progressed = False
        for rank, actions in schedule.items():
            while cursor[rank] < len(actions):
                a = actions[cursor[rank]]
                if a.kind is F:
                    needs = [] if a.stage == 0 else [(a.stage - 1, F, a.microbatch)]
                elif a.kind is W:
                    needs = [(a.stage, I, a.microbatch)]
                else:
                    downstream = (a.stage + 1, B if (a.stage + 1, B, a.microbatch) in end else I, a.microbatch)
                    needs = [(a.stage, F, a.microbatch)] + ([downstream] if a.stage + 1 < num_stages else [])
                if any(n not in end for n in needs):
                    break
                key = (a.stage, a.kind, a.microbatch)
                start[key] = max([free[rank]] + [end[n] for n in needs])
                end[key] = free[rank] = start[key] + DURATIONS[a.kind]
                cursor[rank] += 1
                progressed = True
        assert progressed, "deadlock"
    return max(free.values()), start


def bubble_ratio(p, v, m):
    zero_bubble, _ = makespan(breadth_first_zb(p, v, m), p * v)
    breadth, _ = makespan(breadth_first(p, v, m), p * v)
    return zero_bubble, breadth, zero_bubble / breadth


def test_the_split_removes_the_weight_gradients_from_the_bubble():
    p, v, m = 4, 2, 4
    zero_bubble, breadth, ratio = bubble_ratio(p, v, m)
    print(f"\np={p} v={v} m={m}: breadth_first_zb {zero_bubble} / breadth_first {breadth} = {ratio:.3f}")
    assert breadth == 3 * v * m + 3 * (p - 1)  # (p − 1)·(f + b) of bubble
    # (p − 1)·(f + i) remains: the forward fill and the first input gradient's way down, since the sweeps put every
    # forward before the first I and no W exists before it. The (p − 1)·f of 1F1B-based zero-bubble schedules
    # (27 units here, a ratio of 0.82) needs forwards after input gradients, which breaks the sweeps.
    assert zero_bubble == 3 * v * m + 2 * (p - 1)
    assert ratio == pytest.approx(10 / 11) and ratio <= 0.91
    # no W placement does better: rank 0's first I starts no earlier than with no W's at all, at v·m + 2(p − 1),
    # and 2·v·m units of its work follow it, which this schedule runs without a gap
    sweeps_only = {r: [a for a in acts if a.kind is not W] for r, acts in breadth_first_zb(p, v, m).items()}
    _, earliest = makespan(sweeps_only, p * v)
    _, start = makespan(breadth_first_zb(p, v, m), p * v)
    first_input = ((v - 1) * p, I, 0)
    assert start[first_input] == earliest[first_input] == v * m + 2 * (p - 1)
    assert start[first_input] + 2 * v * m == zero_bubble
    # the plan's simulator, with the same unit times, agrees
    profile = ModelProfile((LayerCost(1.0, 2.0, 1, 0, 0, backward_weight_s=1.0),) * (p * v))
    cluster = Cluster(1, 8, 2**40, 1e30, 1e30, latency_s=0.0)
    simulated = {
        s: simulate(Plan(s, p, 1, v, m, 1), profile, cluster).step_time for s in ("breadth_first_zb", "breadth_first")
    }
    assert simulated == {"breadth_first_zb": zero_bubble, "breadth_first": breadth}


@pytest.mark.parametrize(
    ("p", "v", "m", "expected"),
    [
        (4, 1, 4, 18 / 21),
        (8, 2, 8, 62 / 69),
        (4, 2, 2, 20 / 27),  # m < p: the W's also fill the waits between sweeps
        (4, 3, 2, 28 / 39),
        (2, 2, 4, 26 / 27),
        (4, 2, 8, 54 / 57),
    ],
)
def test_ratio_table(p, v, m, expected):
    zero_bubble, breadth, ratio = bubble_ratio(p, v, m)
    print(f"\np={p} v={v} m={m}: {zero_bubble} / {breadth} = {ratio:.3f}")
    assert ratio == pytest.approx(expected)


@pytest.mark.parametrize(("p", "v", "m"), SIZES)
def test_never_slower_than_breadth_first_and_optimal_for_m_at_least_p(p, v, m):
    zero_bubble, breadth, _ = bubble_ratio(p, v, m)
    assert zero_bubble <= breadth
    if m >= p:
        assert zero_bubble == 3 * v * m + 2 * (p - 1)


def test_costs_split_the_backward_without_changing_whole_backward_schedules():
    layer = LayerCost(1.0, 3.0, 8, 2, 2)
    assert layer.weight_grad_s == 1.5 and layer.input_grad_s == 1.5  # unmeasured: half and half
    measured = LayerCost(1.0, 3.0, 8, 2, 2, backward_weight_s=1.0)
    assert measured.input_grad_s == 2.0 and measured.scaled(2).backward_weight_s == 2.0
    assert stage_costs([layer, layer], [2])[0].backward_weight_s is None
    assert stage_costs([layer, measured], [2])[0].backward_weight_s == 2.5
    recomputed = gpt(2, 1024, 512, 100, flops_per_second=1e14, recompute=True).layers[1]
    assert recomputed.input_grad_s == pytest.approx(2 * recomputed.weight_grad_s)  # recomputation goes with I
    # a whole backward takes backward_s whatever the split
    cluster = Cluster(4, 4, 2**40, 1e11, 1e11)
    split = ModelProfile((measured,) * 4)
    config = Plan("breadth_first", 2, 2, 2, 4, 1)
    assert simulate(config, split, cluster).step_time == simulate(config, ModelProfile((layer,) * 4), cluster).step_time
    # sharded and data-parallel: the zero-bubble schedule runs in the simulator too, and is faster here
    profile = uniform(8, 1e-3, 2e-3, 2**20, 2**10, 2**10)
    times = {
        s: simulate(Plan(s, 4, 2, 2, 4, 1, "full_shard"), profile, cluster).step_time
        for s in ("breadth_first", "breadth_first_zb")
    }
    assert times["breadth_first_zb"] < times["breadth_first"]


# --------------------------------------------------------------------------------------------------
# what the validator refuses


def test_validator_refuses_a_w_before_its_i_or_a_missing_w():
    good = {r: strings(a) for r, a in breadth_first_zb(2, 1, 2).items()}
    assert good == {0: ["0F0", "0F1", "0I0", "0W0", "0I1", "0W1"], 1: ["1F0", "1F1", "1I0", "1I1", "1W0", "1W1"]}
    w_first = {0: ["0F0", "0F1", "0W0", "0I0", "0I1", "0W1"], 1: good[1]}
    with pytest.raises(ScheduleError, match=r"0W0 runs before 0I0"):
        validate(parse_schedule(w_first), 2, 1, 2)
    with pytest.raises(AssertionError, match="without first running Backward Input"):
        _validate_schedule(to_torch(parse_schedule(w_first)), 2, 2, 2)
    missing_w = {0: good[0][:-1], 1: good[1]}
    with pytest.raises(ScheduleError, match=r"0W1 0 times, expected once"):
        validate(parse_schedule(missing_w), 2, 1, 2)
    with pytest.raises(AssertionError, match="I and W must have equal counts"):
        _validate_schedule(to_torch(parse_schedule(missing_w)), 2, 2, 2)
    both = {0: [*good[0], "0B0"], 1: good[1]}
    with pytest.raises(ScheduleError, match=r"0B0 1 times, expected none beside its I and W"):
        validate(parse_schedule(both), 2, 1, 2)
    twice = {0: [*good[0], "0W0"], 1: good[1]}
    with pytest.raises(ScheduleError, match=r"0W0 2 times"):
        validate(parse_schedule(twice), 2, 1, 2)


def test_validator_makes_i_wait_for_the_next_stage_and_w_for_its_own_i_only():
    validate(parse_schedule({0: ["0F0", "0I0", "0W0"], 1: ["1F0", "1I0", "1W0"]}), 2, 1, 1)
    # a whole B downstream of an I satisfies it too, as torch's runtime allows
    validate(parse_schedule({0: ["0F0", "0I0", "0W0"], 1: ["1F0", "1B0"]}), 2, 1, 1)
    # rank 0 holds back 0F1 until its 0I0 is done, which needs rank 1's 1I0, which rank 1 runs only after 1F1: stuck
    stuck = parse_schedule(
        {0: ["0F0", "0I0", "0F1", "0I1", "0W0", "0W1"], 1: ["1F0", "1F1", "1I0", "1I1", "1W0", "1W1"]}
    )
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate(stuck, 2, 1, 2)
    # the same with rank 1 running 1I0 first: a W anywhere after its I waits for nothing else
    flowing = parse_schedule(
        {0: ["0F0", "0I0", "0F1", "0I1", "0W0", "0W1"], 1: ["1F0", "1I0", "1F1", "1W0", "1I1", "1W1"]}
    )
    validate(flowing, 2, 1, 2)
    with pytest.raises(ScheduleError, match="backward in a forward-only schedule"):
        validate(parse_schedule({0: ["0F0", "0I0"]}), 1, 1, 1, backward=False)


def test_the_planner_frees_a_micro_batchs_activations_at_its_w_not_at_its_i():
    """A ``W`` needs the layer's input: each (stage, micro-batch)'s activations are freed when its ``W`` ends,
    never when its ``I`` does, and some ``W`` comes strictly after its ``I`` (so freeing at the ``I`` would
    show here)."""
    profile = uniform(8, 1.0, 2.0, 1, 1, 100, optimizer_state_ratio=0.0)  # 1 layer per stage: 100 bytes kept
    prediction = simulate(Plan("breadth_first_zb", 4, 1, 2, 4, 1), profile, Cluster(4, 4, 2**40, 1e12, 1e12))
    later = 0
    for rank, events in enumerate(prediction.memory_events):
        backward: dict[tuple[int, int], list[float]] = {}
        for span in prediction.spans:
            if span.rank == rank and span.kind == "backward":
                backward.setdefault((span.stage, span.microbatch), []).append(span.end)
        freed = sorted(t for t, delta in events if delta == -100)
        assert freed == sorted(ends[-1] for ends in backward.values()), rank  # at every W's end, and only there
        later += sum(ends[0] < ends[-1] for (stage, _), ends in backward.items() if stage > 0)
    assert later > 0


def test_the_planners_peak_memory_for_the_split_schedule_is_never_below_breadth_firsts():
    """A ``W`` needs the layer's input, so the planner keeps each micro-batch's activations until its ``W``, not
    its ``I``. With the sweeps every forward of a rank still precedes its first ``I``, so the peak (at the end of
    the forward sweeps) is breadth-first's, plus what waits for a ``W`` when it comes later; never below it."""
    profile = uniform(8, 1.0, 2.0, 1, 1, 100, optimizer_state_ratio=0.0)
    cluster = Cluster(4, 4, 2**40, 1e12, 1e12, latency_s=0.0)
    for m in (2, 4, 8):
        looped = Plan("breadth_first", 4, 1, 2, m, 1)
        whole = simulate(looped, profile, cluster).peak_memory
        split = simulate(Plan("breadth_first_zb", 4, 1, 2, m, 1), profile, cluster).peak_memory
        assert whole >= 2 * m * 100 and split >= whole, (m, split, whole)
