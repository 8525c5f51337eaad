"""Predicted against measured step times, on emulated accelerators (CPU processes whose layers sleep).

    python benchmarks/validate_planner.py              # prints the comparison table (about 4 minutes)

1. Calibrate the machine: point-to-point and collective costs (``lightning_bfpp.plan.calibrate``), then the
   runtime's own cost per schedule action and per step, from two runs of 1 ms layers (these two
   configurations are not among those compared below).
2. Profile the emulated model layer by layer (``lightning_bfpp.plan.profile``): the planner sees measured
   times, including how long a 10 ms sleep really takes.
3. For each configuration, train a few steps with ``BFPPStrategy`` on 4 processes, take the median step
   time after the first step (which also infers shapes), and compare with ``lightning_bfpp.plan.simulate``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.emulated import EmulatedModel, EmulatedNet, emulated_loader
from lightning_bfpp import BFPPStrategy
from lightning_bfpp.plan.calibrate import calibrate
from lightning_bfpp.plan.costs import ModelProfile
from lightning_bfpp.plan.profile import profile_module
from lightning_bfpp.plan.simulate import PlanConfig, simulate

DEVICES = 4
MODEL = EmulatedModel(layers=16, forward_ms=10.0, backward_ms=20.0, param_numel=16_384, activation_numel=4096)
# calibration layers sleep too (1 and 2 ms), so processes share the cores as they do in the measured runs
ZERO = replace(MODEL, forward_ms=1.0, backward_ms=2.0)
CONFIGS = [
    PlanConfig("breadth_first", 4, 1, 2, 4, 1),
    PlanConfig("breadth_first", 4, 1, 2, 8, 1),
    PlanConfig("depth_first", 4, 1, 2, 8, 1),
    PlanConfig("1f1b", 4, 1, 1, 8, 1),
    PlanConfig("gpipe", 4, 1, 1, 4, 1),
    PlanConfig("breadth_first", 2, 2, 2, 4, 1, "full_shard"),
    PlanConfig("depth_first", 2, 2, 2, 8, 1, "full_shard"),
    PlanConfig("breadth_first", 2, 2, 4, 4, 1, "no_shard"),
]
CALIBRATION = [PlanConfig("breadth_first", 4, 1, 2, 4, 1), PlanConfig("breadth_first", 4, 1, 2, 16, 1)]


class StepTimes(L.Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, *args: object) -> None:
        self.starts.append(time.perf_counter())

    def on_train_end(self, *args: object) -> None:
        self.starts.append(time.perf_counter())


def measure(config: PlanConfig, model: EmulatedModel, steps: int, out: Path) -> None:
    """Train ``steps`` steps of ``config`` (run as its own 4-process job) and write the median step time."""
    timer = StepTimes()
    strategy = BFPPStrategy(
        pipeline_parallel_size=config.pipeline_parallel_size,
        stages_per_rank=config.stages_per_rank,
        num_microbatches=config.num_microbatches,
        schedule=config.schedule,
        sharding=config.sharding,
        microbatch_group_size=config.microbatch_group_size,
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=DEVICES, strategy=strategy, max_steps=steps, callbacks=[timer], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(EmulatedNet(model), emulated_loader(model, config.num_microbatches, steps))
    if trainer.global_rank == 0:
        durations = [b - a for a, b in zip(timer.starts, timer.starts[1:], strict=False)][1:]
        out.write_text(json.dumps({"step_time": statistics.median(durations), "steps": durations}))


def _run(config: PlanConfig, model: EmulatedModel, steps: int, out: Path) -> float:
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    cmd = [sys.executable, __file__, "--measure", json.dumps(asdict(config)), "--model", json.dumps(asdict(model)),
           "--steps", str(steps), "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())["step_time"]


def _profile(model: EmulatedModel) -> ModelProfile:
    profile = profile_module(EmulatedNet(model), (torch.randn(1, model.activation_numel),), repeats=7)
    return replace(profile, optimizer_state_ratio=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default="runs/validate_planner")
    args = parser.parse_args()
    if args.measure:
        measure(PlanConfig(**json.loads(args.measure)), EmulatedModel(**json.loads(args.model)), args.steps,
                Path(args.out))  # fmt: skip
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    links, _ = calibrate(DEVICES, group_size=2)
    # the runtime's own costs: two zero-time runs that differ only in how many actions each rank executes
    zero = _profile(ZERO)
    measured = [_run(c, ZERO, args.steps, out / f"calibration{i}.json") for i, c in enumerate(CALIBRATION)]
    predicted = [simulate(c, zero, links).step_time for c in CALIBRATION]
    actions = [2 * c.stages_per_rank * c.num_microbatches for c in CALIBRATION]
    per_action = ((measured[1] - predicted[1]) - (measured[0] - predicted[0])) / (actions[1] - actions[0])
    per_step = max(measured[0] - predicted[0] - per_action * actions[0], 0.0)
    cluster = replace(links, action_overhead_s=max(per_action, 0.0), step_overhead_s=per_step)
    cluster.to_json(out / "cluster.json")

    profile = _profile(MODEL)
    profile.to_json(out / "profile.json")
    print(f"calibrated: {cluster}\n")
    print("| configuration | predicted step (ms) | measured step (ms) | error | predicted bubble |")
    print("|---|---|---|---|---|")
    within = 0
    for i, config in enumerate(CONFIGS):
        prediction = simulate(config, profile, cluster)
        step = _run(config, MODEL, args.steps, out / f"config{i}.json")
        error = prediction.step_time / step - 1
        within += abs(error) <= 0.10
        print(f"| {config.describe()} | {1e3 * prediction.step_time:.1f} | {1e3 * step:.1f} | {error:+.1%} |"
              f" {prediction.bubble_fraction:.1%} |", flush=True)  # fmt: skip
    print(f"\n{within} of {len(CONFIGS)} configurations within 10%")


if __name__ == "__main__":
    main()
