"""Predicted against measured step times, on emulated accelerators (CPU processes whose layers sleep).

    python benchmarks/validate_planner.py               # 4 processes (about 4 minutes)
    python benchmarks/validate_planner.py --devices 8   # 8 processes, incl. sharded MB-sized layers
    python benchmarks/validate_planner.py --topology    # 2 nodes × 2: weight passing, hybrid sharding, breadth-first

1. Calibrate the machine at that process count as a user would, with ``plan calibrate``
   (``lightning_bfpp.measure.calibrate``): point-to-point and collective costs, and the runtime's own cost per
   schedule action and per step (from two runs of 5 ms layers, not among the configurations compared).
2. Profile the emulated model layer by layer (``lightning_bfpp.measure.profile``): the planner sees measured
   times, including how long a 10 ms sleep really takes.
3. For each configuration, train a few steps with ``BFPPStrategy``, take the median step time after the
   first step (which also infers shapes), and compare with ``lightning_bfpp.plan.simulate``.

Besides the schedules and shardings, the configurations include ``breadth_first_zb`` on layers whose backward
is split into input and weight gradients (the profile measures the two parts), and tensor parallelism
(``t=2``: each layer's compute and weight halved, its output and input gradient all-reduced over the tensor
group with real collectives), with small and with 256 KiB activations.

At 4 processes it then checks ``BFPPStrategy(pipeline_parallel_size="auto", tensor_parallel_size=2)`` end to
end, on the calibrated cluster: the strategy measures the layers split over each tensor group, chooses a
layout, and the step it predicted for that layout is compared with the step measured in the same run. (Its
layers sleep per sample, as real layers compute: "auto" measures one whole batch and chooses micro-batch sizes.)
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch

from lightning_bfpp.adapter.strategy import BFPPStrategy
from lightning_bfpp.adapter.user_step import training_step_input
from lightning_bfpp.measure.calibrate import calibrate, one_thread, run_emulated, run_emulated_auto
from lightning_bfpp.measure.emulated import EmulatedModel, EmulatedNet
from lightning_bfpp.measure.profile import profile_module
from lightning_bfpp.plan import Plan, simulate
from lightning_bfpp.plan.cluster import Cluster
from lightning_bfpp.plan.costs import ModelProfile

MODEL = EmulatedModel(layers=16, forward_ms=10.0, backward_ms=20.0, param_numel=16_384, activation_numel=4096)
# 2 MiB of fp32 weights per layer: gathers and reductions that take time against the compute
LARGE = replace(MODEL, param_numel=1 << 19)
# the backward split into 10 ms of input gradient and 10 ms of weight gradient (zero-bubble schedules)
SPLIT = replace(MODEL, backward_ms=10.0, weight_grad_ms=10.0)
# 256 KiB activations per sample: tensor parallelism's all-reduces of them take time against the compute
WIDE = replace(MODEL, activation_numel=1 << 16)
LARGE_SPLIT = replace(LARGE, backward_ms=10.0, weight_grad_ms=10.0)
LARGE_WIDE = replace(LARGE, activation_numel=1 << 16)
CONFIGS: dict[int, list[tuple[Plan, EmulatedModel]]] = {
    4: [
        (Plan("breadth_first", 4, 1, 2, 4, 1), MODEL),
        (Plan("breadth_first", 4, 1, 2, 8, 1), MODEL),
        (Plan("depth_first", 4, 1, 2, 8, 1), MODEL),
        (Plan("1f1b", 4, 1, 1, 8, 1), MODEL),
        (Plan("gpipe", 4, 1, 1, 4, 1), MODEL),
        (Plan("breadth_first", 2, 2, 2, 4, 1, "full_shard"), MODEL),
        (Plan("depth_first", 2, 2, 2, 8, 1, "full_shard"), MODEL),
        (Plan("breadth_first", 2, 2, 4, 4, 1, "no_shard"), MODEL),
        (Plan("breadth_first", 4, 1, 2, 4, 1), SPLIT),
        (Plan("breadth_first_zb", 4, 1, 2, 4, 1), SPLIT),
        (Plan("breadth_first_zb", 2, 2, 2, 4, 1, "full_shard"), SPLIT),
        (Plan("breadth_first", 2, 1, 2, 4, 1, tensor_parallel_size=2), MODEL),
        (Plan("breadth_first", 2, 1, 2, 4, 1, tensor_parallel_size=2), WIDE),
        (Plan("breadth_first", 4, 1, 2, 4, 1), WIDE),
    ],
    8: [
        (Plan("breadth_first", 8, 1, 2, 8, 1), MODEL),
        (Plan("depth_first", 8, 1, 2, 16, 1), MODEL),
        (Plan("1f1b", 8, 1, 1, 8, 1), MODEL),
        (Plan("gpipe", 8, 1, 1, 8, 1), MODEL),
        (Plan("breadth_first", 4, 2, 2, 4, 1, "full_shard"), LARGE),
        (Plan("depth_first", 4, 2, 2, 8, 1, "full_shard"), LARGE),
        (Plan("1f1b", 4, 2, 1, 4, 1, "full_shard"), LARGE),
        (Plan("gpipe", 4, 2, 1, 4, 1, "full_shard"), LARGE),
        (Plan("breadth_first", 2, 4, 4, 4, 1, "full_shard"), LARGE),
        (Plan("breadth_first", 4, 2, 2, 4, 1, "shard_grad_op"), LARGE),
        (Plan("breadth_first_zb", 4, 2, 2, 4, 1, "full_shard"), LARGE_SPLIT),
        (Plan("breadth_first", 2, 2, 2, 4, 1, "full_shard", tensor_parallel_size=2), LARGE),
        (Plan("breadth_first", 2, 2, 2, 4, 1, "full_shard", tensor_parallel_size=2), LARGE_WIDE),
    ],
}

# "auto" with tensor groups of 2 at 4 processes: the layouts it chooses between, and the models
AUTO_TENSOR = Plan("breadth_first", 2, 1, 2, 4, 1, tensor_parallel_size=2)
AUTO_MODELS = [replace(MODEL, per_sample=True), replace(WIDE, per_sample=True)]

# --topology: 4 processes as 2 nodes × 2, one global batch of 8 samples, two models of 8 layers
LONG = EmulatedModel(layers=8, forward_ms=10.0, backward_ms=20.0, param_numel=16_384, activation_numel=1 << 18)
SHORT = EmulatedModel(layers=8, forward_ms=10.0, backward_ms=20.0, param_numel=1 << 19, activation_numel=4096)
TOPOLOGY = [
    Plan("breadth_first", 2, 2, 2, 4, 1, "full_shard"),  # a pipeline per node, replicas across nodes
    Plan("breadth_first", 1, 4, 2, 2, 1, "hybrid_shard"),  # no pipeline: shard in a node, replicate across
    Plan("weight_passing", 1, 4, 4, 2, 1),  # one chunk per rank, TawPipe's placement and transfers
]
TOPOLOGY_MODELS = {
    "long sequence: 1 MiB activations per sample, 64 KiB weights per layer": LONG,
    "short sequence: 16 KiB activations per sample, 2 MiB weights per layer": SHORT,
}


def _profile(model: EmulatedModel) -> ModelProfile:
    """Measured layer by layer on one process; each layer splits over a tensor group with one all-reduce of its
    output per pass (``EmulatedLayer.parallelize``), which a profile on one process cannot see."""
    with one_thread():  # as the training processes run
        profile = profile_module(
            EmulatedNet(model), (torch.randn(1, model.activation_numel),), training_step_input, repeats=15
        )
    layers = tuple(replace(layer, tensor_parallel_all_reduces=1) for layer in profile.layers)
    return replace(profile, layers=layers, optimizer_state_ratio=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, choices=sorted(CONFIGS), default=4)
    parser.add_argument(
        "--topology", action="store_true", help="weight passing against hybrid sharding and breadth-first"
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default="runs/validate_planner")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if args.topology:
        _topology(args.steps, out)
        return
    cluster, timings = calibrate(args.devices, group_size=2, strategy=BFPPStrategy)
    cluster.to_json(out / f"cluster{args.devices}.json")
    print(f"calibrated: {cluster}\nruntime runs: {timings['runtime']}\n")
    profiles: dict[EmulatedModel, ModelProfile] = {}
    print("| configuration | layer weights | predicted step (ms) | measured step (ms) | error | predicted bubble |")
    print("|---|---|---|---|---|---|")
    configs = CONFIGS[args.devices]
    within = 0
    for config, model in configs:
        profile = profiles.setdefault(model, _profile(model))
        prediction = simulate(config, profile, cluster)
        # a job of its own: in one long job at 8 processes on 2 cores the later configurations ran slower
        step = run_emulated(config, model, args.steps, args.devices, strategy=BFPPStrategy)
        error = prediction.step_time / step - 1
        within += abs(error) <= 0.10
        print(f"| {config.describe()} | {model.param_bytes / 2**20:.2f} MiB | {1e3 * prediction.step_time:.1f} |"
              f" {1e3 * step:.1f} | {error:+.1%} | {prediction.bubble_fraction:.1%} |", flush=True)  # fmt: skip
    print(f"\n{within} of {len(configs)} configurations within 10%")
    if args.devices == 4:
        _auto_tensor(cluster, args.steps)


def _auto_tensor(cluster: Cluster, steps: int) -> None:
    """``pipeline_parallel_size="auto"`` with ``tensor_parallel_size=2``: the step the strategy predicted for
    the layout it chose, against the step it then ran."""
    print("\npipeline_parallel_size='auto', tensor_parallel_size=2 (layers measured split by the strategy)\n")
    print("| activations per sample | chosen layout | predicted step (ms) | measured step (ms) | error |")
    print("|---|---|---|---|---|")
    for model in AUTO_MODELS:
        step, chosen, predicted = run_emulated_auto(AUTO_TENSOR, model, steps, 4, cluster, strategy=BFPPStrategy)
        print(f"| {model.activation_bytes // 1024} KiB | {chosen.describe()} | {1e3 * predicted:.1f} |"
              f" {1e3 * step:.1f} | {predicted / step - 1:+.1%} |", flush=True)  # fmt: skip


def _topology(steps: int, out: Path) -> None:
    """Each model under each of ``TOPOLOGY``'s ways of training, measured one after the other (ratios from this
    one run) and predicted by the planner for the same 2 nodes of 2 (links calibrated here: loopback both ways)."""
    cluster, _ = calibrate(4, group_size=2, strategy=BFPPStrategy)
    cluster = replace(cluster, devices_per_node=2)
    cluster.to_json(out / "cluster_topology.json")
    print(f"calibrated (as 2 nodes × 2): {cluster}\n")
    within = total = 0
    for title, model in TOPOLOGY_MODELS.items():
        profile = _profile(model)
        print(f"\n{title}\n")
        print("| configuration | measured step (ms) | × breadth-first | predicted step (ms) | predicted × | error |")
        print("|---|---|---|---|---|---|")
        rows = []
        for config in TOPOLOGY:
            predicted = simulate(config, profile, cluster).step_time
            rows.append(
                (config, run_emulated(config, model, steps, 4, processes_per_node=2, strategy=BFPPStrategy), predicted)
            )
        base_measured, base_predicted = rows[0][1], rows[0][2]
        for config, step, predicted in rows:
            error = predicted / step - 1
            within, total = within + (abs(error) <= 0.10), total + 1
            print(f"| {config.describe()} | {1e3 * step:.1f} | {step / base_measured:.2f} | {1e3 * predicted:.1f} |"
                  f" {predicted / base_predicted:.2f} | {error:+.1%} |", flush=True)  # fmt: skip
    print(f"\n{within} of {total} predictions within 10%")


if __name__ == "__main__":
    main()
