"""Schedules as registered kinds: the registry, torch's two zero-bubble orders as kinds, their lowering and
placement, and a new kind added with its own module and one registration line (pure; no processes)."""

from __future__ import annotations

import ast
import itertools
import types
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed.pipelining.schedules as torch_schedules
from torch import nn
from torch.distributed.pipelining.schedules import _Action as TorchAction
from torch.distributed.pipelining.schedules import _validate_schedule

from lightning_bfpp.plan import Cluster, LayerCost, ModelProfile, Plan, SearchSpace, search, simulate, uniform
from lightning_bfpp.plan.actions import (
    REDUCE_GRAD,
    RESHARD,
    UNSHARD,
    WAIT_REDUCE_GRAD,
    Action,
    B,
    F,
    I,
    W,
    count,
    max_resident_stages,
    validate,
)
from lightning_bfpp.plan.config import ConfigRules, PipelineConfig, config_rules
from lightning_bfpp.plan.mesh import MeshShape
from lightning_bfpp.plan.placement import LOOP, V
from lightning_bfpp.plan.schedules import ScheduleKind, generate, get_schedule, register, schedule_names, unregister
from lightning_bfpp.plan.schedules.base import sweeps
from lightning_bfpp.plan.schedules.zero_bubble import interleaved_zero_bubble, zbv_zero_bubble
from lightning_bfpp.plan.simulate import PlannerModel, planner_model


def strings(schedule):
    return {rank: [str(a) for a in actions] for rank, actions in schedule.items()}


def torch_order(schedule_class, p, v, m):
    """torch's own per-rank lists for a schedule class, without building stages: its generator method on an object
    that holds what the method reads, idle slots (None) dropped."""
    rounds = max(1, m // p)
    holder = types.SimpleNamespace(
        n_local_stages=v, pp_group_size=p, _n_microbatches=m, num_stages=p * v,
        number_of_rounds=rounds, microbatches_per_round=m // rounds,
    )  # fmt: skip
    return {
        r: [str(a) for a in schedule_class._calculate_single_rank_operations(holder, r) if a is not None]
        for r in range(p)
    }


def test_the_registry_names_every_kind_and_refuses_unknown_and_duplicate_names():
    assert schedule_names() == (
        "breadth_first", "breadth_first_zb", "depth_first", "gpipe", "1f1b", "interleaved_zb", "zbv", "weight_passing",
    )  # fmt: skip
    for name in schedule_names():
        kind = get_schedule(name)
        assert kind.name == name and kind.summary and kind.runner in ("stages", "weight_passing")
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'; choose one of breadth_first"):
        get_schedule("zigzag")
    with pytest.raises(ValueError, match="registered already"):
        register(get_schedule("zbv"))
    assert get_schedule("zbv").placement == V and get_schedule("interleaved_zb").placement == LOOP
    assert {n for n in schedule_names() if get_schedule(n).splits_backward} == {
        "breadth_first_zb", "interleaved_zb", "zbv",
    }  # fmt: skip


@pytest.mark.parametrize(("p", "v", "m"), [(p, v, m) for p in range(1, 6) for v in range(1, 5) for m in range(1, 13)])
def test_interleaved_zero_bubble_is_torchs_order(p, v, m):
    if m % max(1, m // p):
        with pytest.raises(ValueError, match="multiple of"):
            interleaved_zero_bubble(p, v, m)
        return
    ours = interleaved_zero_bubble(p, v, m)
    assert strings(ours) == torch_order(torch_schedules.ScheduleInterleavedZeroBubble, p, v, m)
    validate(ours, p, v, m, placement=LOOP)
    mapping = _validate_schedule({r: [TorchAction.from_str(str(a)) for a in acts] for r, acts in ours.items()},
                                 p, p * v, m)  # fmt: skip
    assert mapping == LOOP.stage_to_rank(p, v)


@pytest.mark.parametrize(("p", "m"), [(p, m) for p in range(1, 6) for m in range(1, 13)])
def test_zbv_is_torchs_order_on_the_v_placement(p, m):
    ours = zbv_zero_bubble(p, 2, m)
    assert strings(ours) == torch_order(torch_schedules.ScheduleZBVZeroBubble, p, 2, m)
    validate(ours, p, 2, m, placement=V)
    mapping = _validate_schedule({r: [TorchAction.from_str(str(a)) for a in acts] for r, acts in ours.items()},
                                 p, 2 * p, m)  # fmt: skip
    assert mapping == V.stage_to_rank(p, 2)  # torch infers the same V from the lists
    if p > 1:  # and our validator holds it to that placement
        with pytest.raises(ValueError, match="belongs on rank"):
            validate(ours, p, 2, m, placement=LOOP)


def test_zbv_takes_exactly_two_stages_per_rank_up_front():
    with pytest.raises(ValueError, match="places exactly two stages per rank, in a V"):
        PipelineConfig(schedule="zbv", stages_per_rank=3)
    plan = PipelineConfig(schedule="zbv").resolve_plan(MeshShape(2, 1), [10] * 8)
    assert plan.stages_per_rank == 2 and plan.stages_of(0) == (0, 3) and plan.stages_of(1) == (1, 2)


@pytest.mark.parametrize("name", ["interleaved_zb", "zbv"])
@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (4, 16)])
def test_zero_bubble_lowering_gathers_each_stage_once_and_reduces_after_its_last_w(name, p, m):
    """Under ``full_shard`` each local stage is gathered at its first visit and released after its reduction,
    which follows its last ``W``: ``v`` gathers per rank and step with every local stage's weights resident at
    once, which at ``v = 2`` is also what breadth-first holds and gathers (two stages, one of them prefetched)."""
    v = 2
    plan = Plan(name, p, 2, v, m)
    breadth = Plan("breadth_first", p, 2, v, m).lowered()
    for rank, actions in plan.lowered().items():
        assert count(actions, UNSHARD) == v == count(breadth[rank], UNSHARD)
        assert max_resident_stages(actions) == v == max_resident_stages(breadth[rank])
        for stage in plan.stages_of(rank):
            reduce_at = actions.index(Action(stage, REDUCE_GRAD))
            last_w = max(i for i, a in enumerate(actions) if a.kind is W and a.stage == stage)
            # right after it, but for the wait of the reduction before it (one pending at a time)
            assert all(a.kind is WAIT_REDUCE_GRAD for a in actions[last_w + 1 : reduce_at]), actions
            assert reduce_at - last_w <= 2
            assert actions[reduce_at + 1 :].index(Action(stage, RESHARD)) >= 0
        resident: set[int] = set()
        for a in actions:  # every compute action finds its stage gathered
            if a.kind is UNSHARD:
                resident.add(a.stage)
            elif a.kind is RESHARD:
                resident.discard(a.stage)
            elif a.is_compute:
                assert a.stage in resident
    # shard_grad_op gathers once per step as always
    assert all(count(a, UNSHARD) == v for a in Plan(name, p, 2, v, m, sharding="shard_grad_op").lowered().values())


def test_a_smaller_last_batch_falls_back_on_the_same_placement():
    plan = Plan("interleaved_zb", 4, 1, 2, 8)
    smaller = plan.for_microbatches(9)  # 9 is no multiple of its 2 rounds: breadth-first, looping like it
    assert smaller.schedule == "breadth_first" and smaller.placement == plan.placement
    assert plan.for_microbatches(4).schedule == "interleaved_zb"
    zbv = Plan("zbv", 4, 1, 2, 8).for_microbatches(3)  # any count runs (with bubbles below 2p − 1)
    assert zbv.schedule == "zbv" and zbv.compute == zbv_zero_bubble(4, 2, 3)
    assert Plan("depth_first", 4, 1, 2, 8, microbatch_group_size=8).for_microbatches(4).microbatch_group_size is None


def test_evaluation_follows_the_placement():
    plan = Plan("zbv", 2, 1, 2, 2)
    assert strings(plan.evaluation) == {0: ["0F0", "0F1", "3F0", "3F1"], 1: ["1F0", "1F1", "2F0", "2F1"]}


def test_the_simulator_sends_along_the_v_and_the_zero_bubble_orders_beat_breadth_first():
    """The simulator places stages as the kind does: ZB-V's turn at rank ``p − 1`` costs no transfer. With
    ``f = i = w`` and free communication, torch's orders at p=4 v=2 m=4 take 27 units (ZB1P) and 30 (ZB-V) against
    breadth-first's 33 (its whole backward ``b = i + w``) and breadth_first_zb's 30: the ratios the benchmarks
    compare (stage 0 runs its whole backward as its ``W``, as torch's runtime does)."""
    profile = ModelProfile(tuple([LayerCost(1.0, 2.0, 8, 8, 8, backward_weight_s=1.0)] * 8))
    free = Cluster(4, 4, 2**40, 1e15, 1e15, latency_s=0.0)
    names = ("breadth_first", "breadth_first_zb", "interleaved_zb", "zbv")
    step = {name: simulate(Plan(name, 4, 1, 2, 4), profile, free).step_time for name in names}
    assert step == pytest.approx({"breadth_first": 33.0, "breadth_first_zb": 30.0, "interleaved_zb": 27.0, "zbv": 30.0})
    sends = [s for s in simulate(Plan("zbv", 4, 1, 2, 4), profile, free).spans if s.kind == "forward" and s.stage == 4]
    assert {s.rank for s in sends} == {3}  # stage 4 shares rank 3 with stage 3


class Reversed(ScheduleKind):
    """A kind written for the test: breadth-first's sweeps with each rank's micro-batches in reverse order in the
    backward. Its own class, one registration, and nothing else: no planner model, no configuration rules."""

    name = "reversed_test"
    summary = "breadth-first, each backward sweep in reverse micro-batch order"

    def generate(self, p, v, m, *, microbatch_group_size=None):
        schedule = sweeps(p, v, m, None)
        for rank in range(p):
            stages = LOOP.stages_of(rank, p, v)
            schedule[rank] += [Action(s, B, mb) for s in reversed(stages) for mb in reversed(range(m))]
        return schedule


def test_a_new_kind_is_its_class_and_one_registration():
    register(Reversed())
    try:
        assert "reversed_test" in schedule_names()
        # what it does not register, the defaults say: the configuration's rules and the planner's model
        assert type(config_rules("reversed_test")) is ConfigRules
        assert type(planner_model("reversed_test")) is PlannerModel
        config = PipelineConfig(schedule="reversed_test", pipeline_parallel_size=2, num_microbatches=4)  # accepted
        plan = config.resolve_plan(MeshShape(2, 2), [10] * 8)
        assert plan.stages_per_rank == 2  # the default rule: two stages per rank where the layers allow
        assert [str(a) for a in plan.compute[0][-4:]] == ["0B3", "0B2", "0B1", "0B0"]
        assert count(plan.lowered()[0], UNSHARD) == 2  # lowered like breadth-first, by the default rule
        assert generate("reversed_test", 2, 2, 4) == plan.compute
        space = SearchSpace(schedules=("reversed_test",), pipeline_sizes=(2,), stages_per_rank=(2,))
        found = search(uniform(8, 1e-3, 2e-3, 8, 8), Cluster(4, 4, 2**40, 1e9, 1e9), 8, space)
        assert found and all(c.config.schedule == "reversed_test" and c.infeasible is None for c in found)
    finally:
        unregister("reversed_test")
    assert "reversed_test" not in schedule_names()


def test_each_built_in_kind_is_its_module_and_a_registration_line():
    """The built-in schedule modules register their kinds (and whatever configuration rules and planner model they
    override) when imported; :mod:`lightning_bfpp.plan` imports each, once, in the order of ``schedule_names()``."""
    plan = Path(__file__).resolve().parents[2] / "lightning_bfpp" / "plan"
    imported = [
        alias.name.rsplit(".", 1)[-1]
        for node in ast.parse((plan / "__init__.py").read_text()).body
        if isinstance(node, ast.Import)
        for alias in node.names
        if alias.name.startswith("lightning_bfpp.plan.schedules.")
    ]
    modules = {path.stem for path in (plan / "schedules").glob("*.py")} - {"__init__", "base"}
    assert sorted(imported) == sorted(modules)
    where = {get_schedule(name).__module__.rsplit(".", 1)[-1]: None for name in schedule_names()}
    assert list(where) == imported
    # weight passing overrides both; depth-first what a search varies
    assert type(config_rules("weight_passing")).__name__ == "WeightPassingConfig"
    assert type(planner_model("weight_passing")).__name__ == "WeightPassingModel"
    assert type(planner_model("depth_first")).__name__ == "DepthFirstModel"
    assert type(config_rules("depth_first")) is ConfigRules


@pytest.mark.parametrize("name", schedule_names())
def test_every_kind_refuses_what_it_cannot_run_and_lays_out_what_it_can(name):
    kind = get_schedule(name)
    for p, v, m in itertools.product((1, 2, 4), (1, 2, 4), (1, 4, 8)):
        if kind.runner == "weight_passing":
            p, v = 1, 4
        if kind.stages_per_rank_choices and v not in kind.stages_per_rank_choices:
            with pytest.raises(ValueError, match=f"schedule={name!r}"):
                kind.generate_checked(p, v, m)
            continue
        try:
            schedule = kind.generate_checked(p, v, m)
        except ValueError as error:  # a size the kind refuses, with a reason
            assert "num_microbatches" in str(error) or "multiple" in str(error), (name, p, v, m, error)
            continue
        validate(schedule, p, v, m, placement=kind.placement)
        assert all(a.kind in (F, B, I, W) for acts in schedule.values() for a in acts)


# --------------------------------------------------------------------------------------------------
# memory in the plan


class _MLP(L.LightningModule):
    """Three pipeline layers: a projection, then two of Linear(16, 64) → GELU → Linear(64, 16)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(2))

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.embed, *self.blocks]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.pipeline_layers():
            x = layer(x)
        return x

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch).pow(2).mean()


def test_the_profile_counts_what_the_input_gradient_pass_keeps_for_the_weight_pass():
    """torch's ``stage_backward_input`` keeps the gradients of the outputs of a block's two linear layers for its
    weight pass: (rows·64 + rows·16) fp32 values. The first layer has no input-gradient pass; without the split
    nothing is measured."""
    from lightning_bfpp.adapter.user_step import training_step_input
    from lightning_bfpp.measure.profile import profile_module

    rows = 8
    split = profile_module(_MLP(), torch.randn(rows, 4), training_step_input, repeats=1)
    kept = (rows * 64 + rows * 16) * 4
    assert [layer.intermediate_grad_bytes for layer in split.layers] == [0, kept, kept]
    plain = profile_module(_MLP(), torch.randn(rows, 4), training_step_input, repeats=1, split_backward=False)
    assert all(layer.intermediate_grad_bytes == 0 for layer in plain.layers)
    # it scales with the micro-batch, as activations do
    assert split.at_microbatch_size(2 * rows)[1].intermediate_grad_bytes == 2 * split.layers[1].intermediate_grad_bytes


@pytest.mark.parametrize("name", ["breadth_first_zb", "interleaved_zb", "zbv"])
def test_what_an_input_gradient_keeps_is_held_from_its_end_to_its_weight_passs_end(name):
    """Each (stage > 0, micro-batch)'s kept gradients (here 1000 bytes) are taken when its ``I`` ends and given back
    when its ``W`` ends; the peak of a split schedule counts them, that of the same order with whole backwards does
    not (here: every split kind holds more at its peak than with the kept bytes left out)."""
    layer = LayerCost(1.0, 2.0, 8, 10, 100, backward_weight_s=1.0, intermediate_grad_bytes=1000)
    profile = ModelProfile(tuple([layer] * 8), optimizer_state_ratio=0.0)
    free = Cluster(4, 4, 2**40, 1e15, 1e15, latency_s=0.0)
    prediction = simulate(Plan(name, 4, 1, 2, 4), profile, free)
    ends: dict[tuple[int, int], list[float]] = {}
    for span in prediction.spans:
        if span.kind == "backward":
            ends.setdefault((span.stage, span.microbatch), []).append(span.end)
    for rank, events in enumerate(prediction.memory_events):
        stages = [s for s in Plan(name, 4, 1, 2, 4).stages_of(rank) if s > 0]
        # the I's end: kept bytes in, the stage's output out (the last stage's is its loss, not counted)
        taken = sorted(t for t, delta in events if delta in (1000 - 10, 1000))
        given = sorted(t for t, delta in events if delta == -1000 - 100)  # the W's end: kept bytes and activations
        assert taken == sorted(ends[(s, mb)][0] for s in stages for mb in range(4))
        assert given == sorted(ends[(s, mb)][-1] for s in stages for mb in range(4))
    without = ModelProfile(
        tuple([LayerCost(1.0, 2.0, 8, 10, 100, backward_weight_s=1.0)] * 8), optimizer_state_ratio=0.0
    )
    assert max(prediction.activation_peaks) > max(simulate(Plan(name, 4, 1, 2, 4), without, free).activation_peaks)


def test_with_a_memory_budget_the_search_ranks_first_the_fastest_plan_that_fits():
    layer = LayerCost(1e-3, 2e-3, 4096, 2**14, 2**20, backward_weight_s=1e-3, intermediate_grad_bytes=2**18)
    profile = ModelProfile(tuple([layer] * 10), microbatch_size=8)
    roomy = Cluster(4, 4, 2**40, 1e9, 1e9)
    space = SearchSpace(pipeline_sizes=(2,), schedules=("breadth_first", "breadth_first_zb", "1f1b", "zbv"))
    ranked = [c for c in search(profile, roomy, 16, space) if c.infeasible is None]
    fastest = ranked[0]
    budget = fastest.prediction.peak_memory - 1
    tight = search(profile, Cluster(4, 4, budget, 1e9, 1e9), 16, space)
    chosen = tight[0]
    assert chosen.infeasible is None and chosen.prediction.peak_memory <= budget
    assert chosen.config != fastest.config
    assert chosen.config == next(c.config for c in ranked if c.prediction.peak_memory <= budget)
    over = next(c for c in tight if c.config == fastest.config)
    assert over.infeasible is not None and over.infeasible.startswith("memory:")
