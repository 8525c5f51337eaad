"""Activation memory per pipeline rank for every schedule: the planner's prediction against what the runs hold.

    python -m benchmarks.memory_per_schedule            # every pipeline schedule, a markdown table (about 2 min)
    python -m benchmarks.memory_per_schedule --schedules breadth_first,zbv

The model is the example GPT (``examples/train_gpt.py``), trained through ``BFPPStrategy`` on 2 CPU processes
(p=2, dp=1, ``m`` micro-batches; two stages per rank, one for the non-looped schedules), fp32, AdamW. Each
schedule is its own job, its ranks started by the package's launcher (``lightning_bfpp.measure.launcher``) as new
interpreters with one intra-op thread each, so no rank inherits another process's memory; their output goes to
``OUT/logs/SCHEDULE/rank<R>.log``.

*Measured*, per rank, over the third training step: the most host memory held at once beyond what the step
started with (malloc's bytes in use, read at the end of every schedule action: torch's runtime opens a named
range around each, which this script wraps), less the gradient buffers held at that moment (they are the
planner's static state, weights' size). That is the step's activations: what autograd saves for backward, the
stage outputs torch's runtime keeps for the backward, what a split backward's input-gradient pass keeps for
its weight pass, and the step's transient tensors.

*Predicted*: the same module profiled on one process at the same micro-batch size (``profile_module``, which
also counts what torch's input-gradient pass keeps), each plan simulated (``Prediction.activation_peaks``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed.pipelining.schedules as torch_schedules
from torch.utils.data import DataLoader

import lightning_bfpp  # noqa: F401
from examples.train_gpt import GPT, SortDigits
from lightning_bfpp import BFPPStrategy
from lightning_bfpp.adapter.user_step import training_step_input
from lightning_bfpp.measure import launcher
from lightning_bfpp.measure.profile import profile_module
from lightning_bfpp.plan import Cluster, Plan, get_schedule, schedule_names, simulate

GPT_ARGS = dict(layers=8, dim=128, heads=4, block_size=16)
MICROBATCH, P, STEPS = 32, 2, 3
PIPELINE_SCHEDULES = tuple(n for n in schedule_names() if get_schedule(n).runner == "stages")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
    )]  # fmt: skip


_mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
_mallinfo2.restype = _MallInfo2


def in_use() -> int:
    info = _mallinfo2()
    return int(info.uordblks + info.hblkhd)


class ActivationPeak(L.Callback):
    """The most activation memory one training step holds on this rank (see the module docstring)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.peak = 0
        self._base: int | None = None
        self._params: list[torch.Tensor] = []
        self._original = torch_schedules.record_function

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._params = [p for p in pl_module.parameters() if p.requires_grad]

    def _sample(self) -> None:
        grads = sum(p.grad.numel() * p.grad.element_size() for p in self._params if p.grad is not None)
        level = in_use() - grads
        if self._base is None:
            self._base = level
        self.peak = max(self.peak, level - self._base)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != self.step:
            return
        original, probe = self._original, self

        @contextmanager
        def sampled(name: str) -> Any:
            if probe._base is None:
                probe._sample()  # the step's start, after its zero-grad
            with original(name):
                yield
            probe._sample()

        torch_schedules.record_function = sampled

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        torch_schedules.record_function = self._original


def plan_for(schedule: str, m: int) -> Plan:
    v = get_schedule(schedule).stages_per_rank_choices or (2,)
    return Plan(schedule, P, 1, v[0], m, MICROBATCH)


def measure(schedule: str, m: int, out: Path) -> None:
    """One rank of a schedule's 2-process job: trains, then writes its peak to ``out``."""
    torch.manual_seed(0)
    plan = plan_for(schedule, m)
    probe = ActivationPeak(step=STEPS - 1)
    strategy = BFPPStrategy(
        pipeline_parallel_size=P, stages_per_rank=plan.stages_per_rank, num_microbatches=m, schedule=schedule,
        partition="parameters",
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=P, strategy=strategy, max_steps=STEPS, callbacks=[probe], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = SortDigits(STEPS * m * MICROBATCH, seed=1)
    trainer.fit(GPT(**GPT_ARGS), DataLoader(data, batch_size=m * MICROBATCH))
    assert trainer.strategy.plan is not None
    record = {
        "rank": trainer.strategy.pipeline_rank,
        "peak": probe.peak,
        "counts": trainer.strategy.plan.stage_layer_counts,
    }
    (out / f"{schedule}_rank{trainer.global_rank}.json").write_text(json.dumps(record))


def _measure_rank(rank: int, schedule: str, m: int, out: str) -> None:
    """A rank started by the launcher (Lightning reads its rank from the launcher's environment)."""
    measure(schedule, m, Path(out))


def run_schedule(schedule: str, m: int, out: Path) -> None:
    """``schedule``'s job on ``P`` new interpreters (a forked rank would start from this process's memory)."""
    target = "benchmarks.memory_per_schedule:_measure_rank"
    folder = out / "logs" / schedule
    result = launcher.launch(target, P, folder, args=(schedule, m, str(out)), start="spawn")
    if not result.ok:
        raise RuntimeError(f"the {schedule} job failed: {result.report()}")


def predict(schedules: list[str], m: int, counts: dict[str, list[int]]) -> dict[str, list[int]]:
    torch.manual_seed(0)
    module = GPT(**GPT_ARGS)
    batch = next(iter(DataLoader(SortDigits(MICROBATCH, seed=1), batch_size=MICROBATCH)))
    profile = profile_module(module, batch, training_step_input, split_backward=True)
    cluster = Cluster(P, P, 2**40, 1e9, 1e9)
    return {
        s: simulate(
            Plan(s, P, 1, plan_for(s, m).stages_per_rank, m, MICROBATCH, stage_layer_counts=tuple(counts[s])),
            profile, cluster,
        ).activation_peaks
        for s in schedules
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", default=",".join(PIPELINE_SCHEDULES))
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--out", default="runs/memory_per_schedule")
    args = parser.parse_args()
    out = Path(args.out).resolve()  # the ranks write there too
    out.mkdir(parents=True, exist_ok=True)
    schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    for schedule in schedules:
        run_schedule(schedule, args.microbatches, out)
    measured = {s: [json.loads((out / f"{s}_rank{r}.json").read_text()) for r in range(P)] for s in schedules}
    counts = {s: measured[s][0]["counts"] for s in schedules}
    predicted = predict(schedules, args.microbatches, counts)
    spec = ", ".join(f"{k}={v}" for k, v in GPT_ARGS.items())
    print(f"GPT({spec}), micro-batches of {MICROBATCH}, p={P} dp=1 m={args.microbatches}, fp32\n")
    print("| schedule | v | rank | predicted (MiB) | measured (MiB) | predicted / measured |")
    print("|---|---|---|---|---|---|")
    rows = []
    for s in schedules:
        for rank in range(P):
            got = next(r["peak"] for r in measured[s] if r["rank"] == rank)
            want = predicted[s][rank]
            rows.append({"schedule": s, "rank": rank, "predicted": want, "measured": got})
            print(
                f"| {s} | {plan_for(s, args.microbatches).stages_per_rank} | {rank} | {want / 2**20:.1f} |"
                f" {got / 2**20:.1f} | {want / max(got, 1):.2f} |"
            )
    (out / "summary.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
