"""Emulated layers with a split backward spend each half only in the pass that computes it, as zero-bubble
schedules need (torch's ``BACKWARD_INPUT`` then ``BACKWARD_WEIGHT``); without ``weight_grad_ms`` a layer is
still the single autograd node it was."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight

from benchmarks.suite import models
from benchmarks.suite.instrument import COUNTERS
from benchmarks.suite.spec import Emulated
from lightning_bfpp.measure.emulated import EmulatedLayer, EmulatedModel, EmulatedNet, split_sleep

INPUT_MS, WEIGHT_MS = 30.0, 60.0  # per layer; twice apart, so that each pass's time tells which sleeps ran
LAYERS = 2  # a stage of two layers: torch groups each weight with its own layer's intermediate
NUMEL, ROWS = 16, 2


def _package_stage(weight_grad_ms: float | None) -> nn.Module:
    return nn.Sequential(*(EmulatedLayer(1.0, INPUT_MS, NUMEL, weight_grad_ms) for _ in range(LAYERS)))


def _suite_stage(weight_grad_ms: float | None) -> nn.Module:
    spec = Emulated(
        layers=LAYERS, forward_ms=1.0, backward_ms=INPUT_MS, param_numel=NUMEL, weight_grad_ms=weight_grad_ms
    )
    return nn.Sequential(*(models.SleepLayer(spec, microbatch_size=ROWS) for _ in range(LAYERS)))


STAGES = pytest.mark.parametrize("make_stage", [_package_stage, _suite_stage], ids=["package", "suite"])


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


@STAGES
def test_torch_split_backward_sleeps_each_half_only_in_its_own_pass(make_stage: Callable[..., nn.Module]) -> None:
    stage = make_stage(WEIGHT_MS)
    x = torch.randn(ROWS, 8, requires_grad=True)  # a received activation: its gradient is sent on
    out = stage(x)
    grad = torch.ones(()).expand_as(out)  # what a mean loss hands back: stride 0
    nominal = COUNTERS.nominal_s
    result: dict[str, object] = {}

    def input_pass() -> None:
        result["input"] = stage_backward_input([out], [grad], [x], stage.parameters())

    input_ms = _timed(input_pass)
    input_nominal, nominal = COUNTERS.nominal_s - nominal, COUNTERS.nominal_s
    (dx,), param_groups = result["input"]  # type: ignore[misc]
    assert all(p.grad is None for p in stage.parameters())
    weight_ms = _timed(lambda: stage_backward_weight(stage.parameters(), param_groups))

    # each pass takes its own time and not the other's (a sleep never ends early; a late wake-up is far below 30 ms)
    assert LAYERS * INPUT_MS <= input_ms < LAYERS * INPUT_MS + WEIGHT_MS
    assert LAYERS * WEIGHT_MS <= weight_ms < LAYERS * WEIGHT_MS + INPUT_MS
    if make_stage is _suite_stage:  # the suite counts the time slept as the emulated accelerator's busy time
        assert input_nominal == pytest.approx(LAYERS * INPUT_MS / 1e3)
        assert COUNTERS.nominal_s - nominal == pytest.approx(LAYERS * WEIGHT_MS / 1e3)
    assert torch.equal(dx, grad) and dx.is_contiguous()  # identity layers; gloo cannot receive stride 0
    assert all(torch.equal(p.grad, torch.zeros(NUMEL)) for p in stage.parameters())


@STAGES
def test_a_full_backward_takes_both_halves(make_stage: Callable[..., nn.Module]) -> None:
    stage = make_stage(WEIGHT_MS)
    x = torch.randn(ROWS, 8, requires_grad=True)
    ms = _timed(lambda: stage(x).mean().backward())
    assert LAYERS * (INPUT_MS + WEIGHT_MS) <= ms < LAYERS * (INPUT_MS + WEIGHT_MS) + INPUT_MS
    assert x.grad is not None and x.grad.is_contiguous()
    assert all(p.grad is not None and p.grad.shape == (NUMEL,) for p in stage.parameters())


def test_a_first_layer_spends_its_input_time_in_the_pass_that_runs_its_backward() -> None:
    """The pipeline's input needs no gradient; torch's first stage then runs its whole backward as its weight
    pass, and that pass still takes ``input + weight`` per layer, as breadth-first's full backward does."""
    slept: list[float] = []
    weight = nn.Parameter(torch.zeros(NUMEL))
    out = split_sleep(torch.randn(ROWS, 8), weight, 0.001, 0.03, 0.06, sleep=slept.append)
    assert slept == [0.001]
    stage_backward(out.mean(), None, [])  # what torch runs for the first stage's BACKWARD_WEIGHT
    assert sorted(slept[1:]) == [0.03, 0.06]
    assert torch.equal(weight.grad, torch.zeros(NUMEL))


def test_split_sleep_runs_each_sleep_once_in_its_own_pass() -> None:
    slept: list[float] = []
    weight = nn.Parameter(torch.zeros(NUMEL))
    x = torch.randn(ROWS, 8, requires_grad=True)
    out = split_sleep(x, weight, 0.001, 0.03, 0.06, sleep=slept.append)
    (dx,) = torch.autograd.grad(out, inputs=[x], grad_outputs=torch.ones_like(out), retain_graph=True)
    assert slept == [0.001, 0.03]
    (dw,) = torch.autograd.grad(out, inputs=[weight], grad_outputs=torch.ones_like(out))
    assert slept == [0.001, 0.03, 0.06]
    assert torch.equal(dx, torch.ones_like(x)) and torch.equal(dw, torch.zeros(NUMEL))


@STAGES
def test_without_weight_grad_ms_a_layer_is_one_node_sleeping_its_whole_backward(
    make_stage: Callable[..., nn.Module],
) -> None:
    stage = make_stage(None)
    x = torch.randn(ROWS, 8, requires_grad=True)
    out = stage(x)
    node = out.grad_fn
    assert node is not None and type(node).__name__ == "_SleepBackward"
    previous = node.next_functions[0][0]  # straight into the previous layer's single node, then x
    assert type(previous).__name__ == "_SleepBackward"
    assert type(previous.next_functions[0][0]).__name__ == "AccumulateGrad"
    ms = _timed(lambda: out.mean().backward())
    assert LAYERS * INPUT_MS <= ms < LAYERS * INPUT_MS + INPUT_MS
    assert x.grad is not None and x.grad.is_contiguous()


def test_models_keep_their_unsplit_default() -> None:
    assert EmulatedModel().weight_grad_ms is None and Emulated().weight_grad_ms is None
    net = EmulatedNet(EmulatedModel(layers=2, param_numel=NUMEL, weight_grad_ms=5.0))
    assert all(layer.weight_grad_s == pytest.approx(0.005) for layer in net.layers)
    assert all(layer.weight_grad_s is None for layer in EmulatedNet(EmulatedModel(layers=2, param_numel=8)).layers)


def test_the_profile_measures_the_weight_gradient_part_of_each_backward() -> None:
    """``profile_module`` times the whole backward, and torch's split backward as its runtime runs it: the input
    pass (``backward_input_s``, an ``I``) and the weight pass (``backward_weight_s``, a ``W``). A layer whose backward
    is one autograd node runs it whole in both passes (torch's weight pass starts again from the node), which the
    planner then charges twice to a zero-bubble schedule; the first layer (its input needs no gradient) has only a
    weight pass."""
    from lightning_bfpp.adapter.user_step import training_step_input
    from lightning_bfpp.measure.profile import profile_module

    batch = (torch.randn(ROWS, 8),)
    split = profile_module(
        EmulatedNet(EmulatedModel(3, 1.0, INPUT_MS, NUMEL, 8, WEIGHT_MS)), batch, training_step_input, repeats=2
    )
    first, *rest = split.layers
    assert first.backward_weight_s == pytest.approx(first.backward_s, abs=1e-3)  # all of it: no input to differentiate
    for layer in rest:  # (a sleep never ends early; a late wake-up is far below 30 ms)
        assert (INPUT_MS + WEIGHT_MS) / 1e3 <= layer.backward_s < (2 * INPUT_MS + WEIGHT_MS) / 1e3
        assert WEIGHT_MS / 1e3 - 0.01 <= layer.backward_weight_s <= WEIGHT_MS / 1e3 + INPUT_MS / 1e3 - 0.01
        assert layer.input_grad_s < INPUT_MS / 1e3 + 0.02
    whole = profile_module(
        EmulatedNet(EmulatedModel(3, 1.0, INPUT_MS, NUMEL, 8)), batch, training_step_input, repeats=2
    )
    for layer in whole.layers[1:]:
        for seconds in (layer.backward_s, layer.input_grad_s, layer.backward_weight_s):
            assert INPUT_MS / 1e3 <= seconds < 2 * INPUT_MS / 1e3
    # without a zero-bubble schedule to plan ("auto" with another schedule, partition="time"), no input-gradient
    # pass: the weight part is left unknown (the planner's default: half), the whole backward still measured
    plain = profile_module(
        EmulatedNet(EmulatedModel(3, 1.0, INPUT_MS, NUMEL, 8, WEIGHT_MS)),
        batch,
        training_step_input,
        repeats=2,
        split_backward=False,
    )
    assert all(layer.backward_weight_s is None for layer in plain.layers)
    for layer in plain.layers[1:]:
        assert (INPUT_MS + WEIGHT_MS) / 1e3 <= layer.backward_s < (2 * INPUT_MS + WEIGHT_MS) / 1e3
