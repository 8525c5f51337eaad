"""The planner's predicted speed-ups match the runtime's, side by side: breadth-first over 1F1B,
``breadth_first_zb`` over breadth-first with the backward split into input and weight gradients, and a 3D
layout (two pipeline ranks of two tensor ranks) over a pipeline of four.

Emulated accelerators (layers that sleep 20 ms forward and 40 ms backward per micro-batch) on 4 CPU
processes; every configuration trains in one job (:func:`run_emulated_many`, one start-up), so each
comparison is a ratio measured in one run, robust to this machine's speed. The full validation (absolute step
times within 10%, zero-bubble and tensor-parallel layouts among them) is ``benchmarks/validate_planner.py``;
its table is in docs/planner.md.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_bfpp.adapter.strategy import BFPPStrategy
from lightning_bfpp.measure.calibrate import run_emulated_many
from lightning_bfpp.measure.emulated import EmulatedModel
from lightning_bfpp.plan import Cluster, Plan, simulate, uniform

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

MODEL = EmulatedModel(layers=8, forward_ms=20.0, backward_ms=40.0, param_numel=1024, activation_numel=1024)
# the same layers with the backward split: 20 ms of input gradient, 20 ms of weight gradient
SPLIT = replace(MODEL, backward_ms=20.0, weight_grad_ms=20.0)

LOOPED = Plan("breadth_first", 4, 1, 2, 4, 1)
FLAT = Plan("1f1b", 4, 1, 1, 4, 1)
ZERO_BUBBLE = replace(LOOPED, schedule="breadth_first_zb")
TENSOR = replace(LOOPED, pipeline_parallel_size=2, tensor_parallel_size=2)
# 10 ms and 20 ms: tensor parallelism's all-reduces (a few ms each with gloo here) weigh against half of that
SHORT = replace(MODEL, forward_ms=10.0, backward_ms=20.0)
RUNS = [
    (FLAT, MODEL), (LOOPED, MODEL), (ZERO_BUBBLE, SPLIT), (LOOPED, SPLIT), (TENSOR, MODEL), (LOOPED, SHORT),
    (TENSOR, SHORT),
]  # fmt: skip


@pytest.fixture(scope="module")
def measured():
    """Each run's median step (s), by its (configuration, model)."""
    return dict(zip(RUNS, run_emulated_many(RUNS, 5, 4, strategy=BFPPStrategy), strict=True))


def test_breadth_first_speedup_over_1f1b_is_predicted(measured):
    looped, flat = LOOPED, FLAT
    profile = uniform(8, 20e-3, 40e-3, 4096, 4096, optimizer_state_ratio=0.0)
    ideal = Cluster(4, 4, 2**40, 1e12, 1e12, latency_s=0.0)
    predicted = simulate(flat, profile, ideal).step_time / simulate(looped, profile, ideal).step_time
    assert predicted == pytest.approx(7 / 5.5)  # (m + p − 1) against m + (p − 1)/v, in rank-micro-batch units
    ratio = measured[flat, MODEL] / measured[looped, MODEL]
    # measured 1.21 against 1.27 here: the runtime's per-action cost weighs a little more on breadth-first's
    # 16 actions per rank than on 1F1B's 8; a schedule that did not loop would measure 1.0
    assert ratio == pytest.approx(predicted, rel=0.15), (ratio, predicted)


def test_zero_bubble_gain_over_breadth_first_is_predicted(measured):
    """``breadth_first_zb`` against ``breadth_first`` at p=4 v=2 m=4, f = i = w: the planner's ratio (the
    sweep-keeping bound, ``3vm + 2(p − 1)`` against ``3vm + 3(p − 1)`` units) within 10% of the measured one."""
    looped, split = LOOPED, ZERO_BUBBLE
    profile = uniform(8, 20e-3, 40e-3, 4096, 4096, optimizer_state_ratio=0.0)  # W: half of each backward
    ideal = Cluster(4, 4, 2**40, 1e12, 1e12, latency_s=0.0)
    predicted = simulate(split, profile, ideal).step_time / simulate(looped, profile, ideal).step_time
    assert predicted == pytest.approx(30 / 33)
    ratio = measured[split, SPLIT] / measured[looped, SPLIT]
    # the runtime's per-action cost weighs on the split schedule's 8 more actions per rank
    assert ratio == pytest.approx(predicted, rel=0.10), (ratio, predicted)


def test_tensor_parallel_layout_against_a_deeper_pipeline_is_predicted(measured):
    """p=2 t=2 against p=4 on the same 4 processes: each tensor rank computes half of every layer it holds and
    all-reduces the layers' outputs and input gradients over its group with real gloo collectives
    (``EmulatedLayer.parallelize``). The price of one such all-reduce as a step pays it is fitted on layers of
    20 ms forward and 40 ms backward, as ``measure_runtime`` fits it on its own tensor layout; with it the
    planner predicts the ratio on layers of half the time (the all-reduces weigh twice as much), within 15%.
    With free all-reduces it would predict the shallower pipeline's smaller bubble alone, further off.

    The links-only price (back-to-back calls after a sleep, ``calibrate(runtime=False)``) is not enough here:
    on 2 shared cores a step's all-reduce also waits for the later of its two members, and that wait varies
    between machines (0.9 against the 1.1 this price predicted, in one CI run)."""
    deep, tensor = LOOPED, TENSOR
    cluster = Cluster(4, 4, 2**40, 1e12, 1e12, latency_s=0.0)  # every fixed cost in the fitted price

    def ratio_on(ms: float, overhead_s: float) -> float:
        profile = uniform(8, ms * 1e-3, 2 * ms * 1e-3, 4096, 4096, optimizer_state_ratio=0.0)
        layers = tuple(replace(layer, tensor_parallel_all_reduces=1) for layer in profile.layers)
        profile = replace(profile, layers=layers)
        machine = replace(cluster, tensor_collective_overhead_s=overhead_s)
        return simulate(deep, profile, machine).step_time / simulate(tensor, profile, machine).step_time

    # the ratio falls as the price grows: bisect for the price that gives the measured ratio at 20 ms
    fit = measured[deep, MODEL] / measured[tensor, MODEL]
    low, high = 0.0, 50e-3
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if ratio_on(20.0, middle) > fit else (low, middle)
    price = (low + high) / 2
    ratio = measured[deep, SHORT] / measured[tensor, SHORT]
    fitted, free = ratio_on(10.0, price), ratio_on(10.0, 0.0)

    def off(predicted: float) -> float:  # relative to the measured ratio, for both predictions alike
        return abs(predicted / ratio - 1)

    assert off(fitted) <= 0.15, (ratio, fitted, price, fit)
    # free all-reduces predict the shallower pipeline's smaller bubble alone: further off, by a clear margin (17%
    # against the fitted price's few percent in one CI run, where the ratio was 1.04 and free predicted 1.22)
    assert off(free) > off(fitted) + 0.05, (ratio, fitted, free)
