"""The schedule generators, validator and data-parallel lowering, as pure functions (no processes)."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_bfpp.plan import Plan
from lightning_bfpp.plan.actions import (
    REDUCE_GRAD,
    RESHARD,
    UNSHARD,
    WAIT_REDUCE_GRAD,
    Action,
    B,
    F,
    Kind,
    ScheduleError,
    add_sharding_actions,
    count,
    format_schedule,
    max_resident_stages,
    parse_schedule,
    validate,
)
from lightning_bfpp.plan.schedules import generate, get_schedule, schedule_names
from lightning_bfpp.plan.schedules.breadth_first import breadth_first
from lightning_bfpp.plan.schedules.depth_first import depth_first
from lightning_bfpp.plan.schedules.single_stage import gpipe, one_f_one_b


def strings(actions):
    return [str(a) for a in actions]


def test_action_string_form_round_trips_like_torch():
    assert str(Action(2, F, 0)) == "2F0"
    assert str(Action(1, UNSHARD)) == "1UNSHARD"
    assert str(Action(3, REDUCE_GRAD)) == "3REDUCE_GRAD"
    for text in ("2F0", "13B7", "0UNSHARD", "4RESHARD", "5REDUCE_GRAD"):
        assert str(Action.parse(text)) == text
    with pytest.raises(ValueError, match="not an action"):
        Action.parse("2X0")


def test_breadth_first_golden_p2_v2_m4():
    # every micro-batch through one local stage before the next; backward in reverse stage order
    schedule = breadth_first(2, 2, 4)
    assert strings(schedule[0]) == [
        "0F0", "0F1", "0F2", "0F3", "2F0", "2F1", "2F2", "2F3",
        "2B0", "2B1", "2B2", "2B3", "0B0", "0B1", "0B2", "0B3",
    ]  # fmt: skip
    assert strings(schedule[1]) == [
        "1F0", "1F1", "1F2", "1F3", "3F0", "3F1", "3F2", "3F3",
        "3B0", "3B1", "3B2", "3B3", "1B0", "1B1", "1B2", "1B3",
    ]  # fmt: skip
    validate(schedule, 2, 2, 4)


def forward_only(p, v, m):
    return get_schedule("breadth_first").evaluation(p, v, m)


def lower(schedule, sharding, m, **options):
    """Every rank's list through :func:`add_sharding_actions` (what a plan's kind does by default)."""
    return {rank: add_sharding_actions(actions, sharding, m, **options) for rank, actions in schedule.items()}


def test_forward_only_has_no_backward_and_validates_as_such():
    schedule = forward_only(2, 2, 2)
    assert strings(schedule[1]) == ["1F0", "1F1", "3F0", "3F1"]
    validate(schedule, 2, 2, 2, backward=False)
    with pytest.raises(ScheduleError, match="expected once"):
        validate(schedule, 2, 2, 2, backward=True)


def test_full_shard_lowering_gathers_once_per_sweep_and_prefetches():
    lowered = add_sharding_actions(breadth_first(2, 3, 2)[0], "full_shard", 2)
    assert strings(lowered) == [
        "0UNSHARD", "2UNSHARD",  # stage 2's gather is issued before stage 0 computes: prefetch
        "0F0", "0F1", "0RESHARD", "4UNSHARD",
        "2F0", "2F1",  # kept to its backward sweep: with stage 4 that is the two stages the prefetch holds anyway
        "4F0", "4F1",  # last local stage: kept from its forward sweep to its backward sweep
        "4B0", "4B1", "4REDUCE_GRAD", "4RESHARD",
        "0UNSHARD",  # prefetch stage 0 for its backward sweep
        "2B0", "2B1", "4WAIT_REDUCE_GRAD", "2REDUCE_GRAD", "2RESHARD",  # one reduction pending at a time
        "0B0", "0B1", "2WAIT_REDUCE_GRAD", "0REDUCE_GRAD", "0RESHARD",
        "0WAIT_REDUCE_GRAD",  # the step's gradients are complete here
    ]  # fmt: skip
    # releasing after every visit but the turn's holds no fewer stages at once and gathers stage 2 twice
    released = add_sharding_actions(breadth_first(2, 3, 2)[0], "full_shard", 2, keep=1)
    assert max_resident_stages(released) == max_resident_stages(lowered) == 2
    assert (count(released, UNSHARD), count(lowered, UNSHARD)) == (5, 4)
    assert strings(released)[strings(released).index("4F1") + 1] == "2UNSHARD"


def test_full_shard_keeps_every_stage_gathered_where_the_prefetch_holds_them_all():
    """v = 2 with ``prefetch=1``: both local stages are resident during the first forward anyway, so each is
    gathered once per step (as ``shard_grad_op`` would), not the first twice."""
    lowered = add_sharding_actions(breadth_first(2, 2, 4)[0], "full_shard", 4)
    assert strings(lowered) == [
        "0UNSHARD", "2UNSHARD", "0F0", "0F1", "0F2", "0F3", "2F0", "2F1", "2F2", "2F3",
        "2B0", "2B1", "2B2", "2B3", "2REDUCE_GRAD", "2RESHARD",
        "0B0", "0B1", "0B2", "0B3", "2WAIT_REDUCE_GRAD", "0REDUCE_GRAD", "0RESHARD", "0WAIT_REDUCE_GRAD",
    ]  # fmt: skip


@pytest.mark.parametrize("prefetch", [0, 1, 2, 3])
def test_prefetch_bounds_the_stages_held_at_once(prefetch):
    for rank, actions in breadth_first(2, 4, 4).items():
        lowered = add_sharding_actions(actions, "full_shard", 4, prefetch=prefetch)
        assert max_resident_stages(lowered) == prefetch + 1
        # 2v − (prefetch + 1) gathers per step: the last `prefetch + 1` local stages stay gathered from their
        # forwards to their backwards, within the residency the prefetch already needs
        assert count(lowered, UNSHARD) == {0: 7, 1: 6, 2: 5, 3: 4}[prefetch]
        # releasing after every visit unless the next `prefetch` visits need the stage: more gathers, same peak
        released = add_sharding_actions(actions, "full_shard", 4, prefetch=prefetch, keep=prefetch)
        assert count(released, UNSHARD) == {0: 8, 1: 7, 2: 7, 3: 6}[prefetch]
        assert max_resident_stages(released) == max_resident_stages(lowered)
        if prefetch == 0:  # every gather is issued right before its own stage computes
            for action, after in itertools.pairwise(lowered):
                if action.kind is UNSHARD:
                    assert after.is_compute and after.stage == action.stage, (rank, strings(lowered))
    with pytest.raises(ValueError, match="non-negative int"):
        add_sharding_actions(breadth_first(2, 2, 2)[0], "full_shard", 2, prefetch=-1)


def test_shard_grad_op_gathers_once_per_step():
    lowered = add_sharding_actions(breadth_first(2, 3, 2)[1], "shard_grad_op", 2)
    assert count(lowered, UNSHARD) == 3
    for stage in (1, 3, 5):
        assert count(lowered, UNSHARD, stage) == 1
        assert count(lowered, REDUCE_GRAD, stage) == 1
        # released only after its gradients are reduced
        assert strings(lowered).index(f"{stage}RESHARD") == strings(lowered).index(f"{stage}REDUCE_GRAD") + 1


def test_forward_only_lowering_releases_after_last_forward():
    lowered = add_sharding_actions(forward_only(2, 2, 2)[0], "full_shard", 2)
    assert strings(lowered) == ["0UNSHARD", "2UNSHARD", "0F0", "0F1", "0RESHARD", "2F0", "2F1", "2RESHARD"]
    assert count(lowered, REDUCE_GRAD) == 0


def test_validate_rejects_wrong_rank_missing_work_and_deadlock():
    good = breadth_first(2, 1, 2)
    bad_rank = {0: list(good[0]), 1: list(good[1])}
    bad_rank[0][0] = Action(1, F, 0)
    with pytest.raises(ScheduleError, match="belongs on rank 1"):
        validate(bad_rank, 2, 1, 2)
    missing = {0: good[0][:-1], 1: good[1]}
    with pytest.raises(ScheduleError, match="0 times"):
        validate(missing, 2, 1, 2)
    # rank 1 runs backward of micro-batch 1 before the forward of micro-batch 1 arrives: fine;
    # but rank 0 waiting for a backward before sending the forward it depends on deadlocks
    deadlock = parse_schedule({0: ["0F0", "0B0", "0F1", "0B1"], 1: ["1F0", "1F1", "1B1", "1B0"]})
    with pytest.raises(ScheduleError, match="deadlocks") as excinfo:
        validate(deadlock, 2, 1, 2)
    assert "rank 0:" in str(excinfo.value)  # the whole schedule is printed


def test_format_schedule_prints_one_row_per_rank():
    text = format_schedule(breadth_first(2, 1, 2))
    assert text.splitlines()[0].split() == ["rank", "0:", "0F0", "0F1", "0B0", "0B1"]


sizes = st.tuples(st.integers(1, 6), st.integers(1, 4), st.integers(1, 9))


@settings(max_examples=150, deadline=None)
@given(sizes)
def test_breadth_first_is_valid_for_any_sizes(pvm):
    p, v, m = pvm
    schedule = breadth_first(p, v, m)
    validate(schedule, p, v, m)
    for rank, actions in schedule.items():
        # breadth-first: each local stage is visited exactly once per direction
        visits = [a.stage for i, a in enumerate(actions) if i == 0 or actions[i - 1].stage != a.stage]
        assert len(visits) == 2 * v - 1  # the last local stage's two sweeps are adjacent
        assert {a.stage for a in actions} == {rank + k * p for k in range(v)}


@settings(max_examples=150, deadline=None)
@given(sizes, st.sampled_from(["full_shard", "shard_grad_op", "no_shard"]))
def test_lowering_is_consistent_for_any_sizes(pvm, sharding):
    p, v, m = pvm
    lowered = Plan("breadth_first", p, 2, v, m, sharding=sharding).lowered()
    for actions in lowered.values():
        resident: set[int] = set()
        used_since_unshard: set[int] = set()
        for a in actions:
            if a.kind is UNSHARD:
                assert a.stage not in resident
                resident.add(a.stage)
            elif a.kind is RESHARD:
                assert a.stage in resident and a.stage in used_since_unshard  # never gather for nothing
                resident.remove(a.stage)
                used_since_unshard.discard(a.stage)
            elif a.kind in (F, B):
                assert a.stage in resident, f"{a} computes on a sharded stage"
                used_since_unshard.add(a.stage)
        assert not resident
        gathers = count(actions, UNSHARD)
        assert gathers == (max(2 * v - 2, v) if sharding == "full_shard" else v)
        assert count(actions, REDUCE_GRAD) == v
        assert max_resident_stages(actions) <= (min(v, 2) if sharding == "full_shard" else v)


@settings(max_examples=60, deadline=None)
@given(sizes, st.integers(0, 2), st.sampled_from(["breadth_first", "depth_first", "breadth_first_zb", "gpipe"]))
def test_full_shard_keeps_a_stage_only_where_the_peak_does_not_grow(pvm, prefetch, name):
    """The default look-ahead holds no more stages at once than releasing after every visit it does not reach
    (``keep=prefetch``), and of all look-aheads that hold no more it gathers the fewest times."""
    p, v, m = pvm
    if name == "gpipe":
        v = 1
    if name == "depth_first":  # whole groups of p micro-batches, as depth-first asks
        m = p * -(-m // p)
    for actions in generate(name, p, v, m).values():
        lowered = add_sharding_actions(actions, "full_shard", m, prefetch=prefetch)
        by_keep = [add_sharding_actions(actions, "full_shard", m, prefetch=prefetch, keep=k)
                   for k in range(prefetch, len(actions) + 1)]  # fmt: skip
        peak = max_resident_stages(by_keep[0])
        assert max_resident_stages(lowered) == peak <= prefetch + 1
        fewest = min(count(other, UNSHARD) for other in by_keep if max_resident_stages(other) <= peak)
        assert count(lowered, UNSHARD) == fewest <= count(by_keep[0], UNSHARD)


def test_lowering_rejects_non_compute_input():
    with pytest.raises(ValueError, match="compute"):
        add_sharding_actions([Action(0, Kind.UNSHARD)], "full_shard", 1)


# --------------------------------------------------------------------------------------------------
# the schedule family


def test_depth_first_golden_matches_megatrons_order():
    # Megatron's docstring, PP=2, VP=2, N=2, M=4: "rank 0 | 0 1 0 1 2 3 2 3" (forward micro-batch ids)
    schedule = depth_first(2, 2, 4)
    assert [a.microbatch for a in schedule[0] if a.kind is F] == [0, 1, 0, 1, 2, 3, 2, 3]
    assert strings(schedule[0]) == [
        "0F0", "0F1", "2F0", "2F1", "0F2", "2B0", "0F3", "2B1",
        "2F2", "0B0", "2F3", "0B1", "2B2", "2B3", "0B2", "0B3",
    ]  # fmt: skip


def test_one_f_one_b_golden():
    schedule = one_f_one_b(4, 1, 4)
    assert strings(schedule[1]) == ["1F0", "1F1", "1F2", "1B0", "1F3", "1B1", "1B2", "1B3"]
    assert strings(schedule[3]) == ["3F0", "3B0", "3F1", "3B1", "3F2", "3B2", "3F3", "3B3"]


def test_gpipe_is_breadth_first_without_loops():
    assert gpipe(3, 1, 4) == breadth_first(3, 1, 4)
    with pytest.raises(ValueError, match="non-looped"):
        gpipe(2, 2, 4)
    with pytest.raises(ValueError, match="non-looped"):
        one_f_one_b(2, 2, 4)


def test_group_size_moves_depth_first_towards_breadth_first():
    p, v, m = 2, 3, 8
    visits = {n: len(_visit_list(depth_first(p, v, m, n)[0])) for n in (2, 4, 8)}
    assert visits[2] > visits[4] > visits[8]
    # at N = m every stage's forwards run as one visit, as in breadth-first
    forwards = [a for a in depth_first(p, v, m, m)[0] if a.kind is F]
    assert [a for a in breadth_first(p, v, m)[0] if a.kind is F] == forwards


def test_group_size_errors():
    with pytest.raises(ValueError, match=r"must lie in \[pipeline_parallel_size, num_microbatches\]"):
        depth_first(4, 2, 8, 2)
    with pytest.raises(ValueError, match="last group of 2"):
        depth_first(4, 2, 10, 8)
    with pytest.raises(ValueError, match="needs num_microbatches ≥ pipeline_parallel_size"):
        depth_first(4, 2, 3)
    with pytest.raises(ValueError, match="applies to schedule='depth_first'"):
        generate("breadth_first", 2, 2, 4, microbatch_group_size=2)


def _visit_list(actions):
    return [a.stage for i, a in enumerate(actions) if i == 0 or actions[i - 1].stage != a.stage]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(1, 12), st.data())
def test_every_schedule_is_valid_for_any_sizes(p, v, m, data):
    """Every registered kind (weight passing, which has no pipeline, aside) at every size it accepts: valid on its
    placement, lowered with one reduction per stage and as many releases as gathers, and torch can place its sends
    and receives."""
    from lightning_bfpp.engine import _compat
    from lightning_bfpp.engine.torch_ir import torch_action_lists

    candidates = []
    for name in schedule_names():
        kind = get_schedule(name)
        if kind.runner != "stages" or (kind.stages_per_rank_choices and v not in kind.stages_per_rank_choices):
            continue
        group = None
        if "microbatch_group_size" in kind.options and m >= p:
            group = data.draw(st.integers(p, m))
        candidates.append((name, group))
    for name, n in candidates:
        try:
            plan = Plan(name, p, 2, v, m, microbatch_group_size=n)
            schedule = plan.compute  # generated and validated on the kind's placement
        except ValueError as error:
            # the kind refuses this size up front, with a message (depth_first: m < p, a short last group;
            # interleaved_zb: m not a multiple of its rounds)
            assert name in ("depth_first", "interleaved_zb"), (name, p, v, m, n, error)
            continue
        validate(schedule, p, v, m, placement=plan.placement)
        for sharding in ("full_shard", "shard_grad_op"):
            for actions in Plan(name, p, 2, v, m, sharding=sharding, microbatch_group_size=n).lowered().values():
                assert count(actions, REDUCE_GRAD) == v
                assert count(actions, UNSHARD) == count(actions, RESHARD)
        # torch can place the sends and receives of every schedule we generate, and (torch ≥ 2.15) its runtime's
        # own checks accept every wait we place
        lists = torch_action_lists(plan.lowered(), plan.stage_to_rank().__getitem__, p * v)
        if _compat.TORCH_WAIT_ACTIONS:
            from torch.distributed.pipelining.schedules import _add_wait_send, _validate_send_waits

            _validate_send_waits(lists)
            assert_one_reduction_pending(lists)
            without = {r: [a for a in acts if "WAIT_SEND" not in str(a)] for r, acts in lists.items()}
            assert {r: [str(a) for a in acts] for r, acts in _add_wait_send(without).items()} == {
                r: [str(a) for a in acts] for r, acts in lists.items()
            }  # our rule is torch's own


def assert_one_reduction_pending(lists):
    """torch ≥ 2.15's rule: each REDUCE_GRAD waited for by a later WAIT_REDUCE_GRAD of its stage, before the rank's
    next REDUCE_GRAD."""
    for rank, actions in lists.items():
        pending = None
        for a in map(str, actions):
            if a.endswith("WAIT_REDUCE_GRAD"):
                assert pending is not None and a == f"{pending}WAIT_REDUCE_GRAD", (rank, actions)
                pending = None
            elif a.endswith("REDUCE_GRAD"):
                assert pending is None, (rank, actions)
                pending = a[: -len("REDUCE_GRAD")]
        assert pending is None, (rank, actions)


def test_depth_first_gathers_more_than_breadth_first_under_full_shard():
    p, v, m = 4, 4, 16
    gathers = {
        name: count(lower(generate(name, p, v, m), "full_shard", m)[0], UNSHARD)
        for name in ("breadth_first", "depth_first")
    }
    assert gathers["breadth_first"] == 2 * v - 2
    assert gathers["depth_first"] >= 4 * gathers["breadth_first"]  # about m/N per stage and direction
    # with two stages per rank the prefetch holds both anyway: each is gathered once per step, in either order
    for name in ("breadth_first", "depth_first"):
        assert count(lower(generate(name, p, 2, m), "full_shard", m)[0], UNSHARD) == 2


def test_a_schedule_inside_an_accumulation_window_has_no_reductions_but_the_same_gathers():
    plan = Plan("breadth_first", 2, 2, 2, 4)
    compute = plan.compute
    with_reduce = plan.lowered()
    without = plan.lowered(reduce_grads=False)
    for rank in compute:
        assert [a for a in with_reduce[rank] if a.kind not in (REDUCE_GRAD, WAIT_REDUCE_GRAD)] == without[rank]
        assert sum(a.kind is REDUCE_GRAD for a in with_reduce[rank]) == 2
