"""Timelines of the same emulated model under each schedule, as ``BFPPStrategy(trace=...)`` records them.

    python benchmarks/trace_schedules.py --out runs/traces     # one folder per schedule, a minute or two
    python benchmarks/trace_schedules.py --reductions --out runs/traces   # breadth-first, 2M-parameter layers,
                                                       # gradient reductions blocking and on a thread

4 CPU processes (p=2, dp=2, v=2, m=4 for the looped schedules; v=1 for gpipe and 1f1b) with emulated
layers (5 ms forward, 10 ms backward per layer and micro-batch), fully sharded. Each folder holds the
Chrome traces, PNG timelines and summary of the traced steps; the summaries are printed at the end. Each
schedule's ranks are started by the package's launcher (``lightning_bfpp.measure.launcher``) as new interpreters
with one intra-op thread each; their output goes to ``OUT/logs/SCHEDULE/rank<R>.log``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_bfpp import BFPPStrategy
from lightning_bfpp.measure import launcher
from lightning_bfpp.measure.emulated import EmulatedModel, EmulatedNet, emulated_loader

MODEL = EmulatedModel(layers=8, forward_ms=5.0, backward_ms=10.0, param_numel=250_000, activation_numel=4096)
SCHEDULES = ("breadth_first", "depth_first", "gpipe", "1f1b")
# the reductions comparison: layers heavy enough (8 MiB of fp32 weights) for gathers and reductions to show
HEAVY = EmulatedModel(layers=8, forward_ms=5.0, backward_ms=10.0, param_numel=2_000_000, activation_numel=4096)
REDUCTIONS = {"reductions_blocking": False, "reductions_overlapped": "thread"}


def trace(schedule: str, out: Path) -> None:
    """One rank of a schedule's 4-process job: trains 3 steps, traced into ``out/schedule``."""
    looped = schedule in ("breadth_first", "depth_first")
    overlap = REDUCTIONS.get(schedule, False)
    model = HEAVY if schedule in REDUCTIONS else MODEL
    strategy = BFPPStrategy(
        pipeline_parallel_size=2, stages_per_rank=2 if looped or schedule in REDUCTIONS else 1, num_microbatches=4,
        schedule="breadth_first" if schedule in REDUCTIONS else schedule, trace=out / schedule, trace_steps=3,
        overlap_reductions=overlap,
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(EmulatedNet(model), emulated_loader(model, 4, 3))


def _trace_rank(rank: int, schedule: str, out: str) -> None:
    """A rank started by the launcher (Lightning reads its rank from the launcher's environment)."""
    trace(schedule, Path(out))


def run_schedule(schedule: str, out: Path) -> None:
    """``schedule``'s job on 4 new interpreters, its ranks' output in ``out/logs/schedule``."""
    target = "benchmarks.trace_schedules:_trace_rank"
    result = launcher.launch(target, 4, out / "logs" / schedule, args=(schedule, str(out)), start="spawn")
    if not result.ok:
        raise RuntimeError(f"tracing {schedule} failed: {result.report()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/traces"))
    parser.add_argument("--reductions", action="store_true", help="compare blocking and overlapped reductions")
    args = parser.parse_args()
    out = args.out.resolve()  # the ranks write there too
    for schedule in REDUCTIONS if args.reductions else SCHEDULES:
        run_schedule(schedule, out)
        summary = (out / schedule / "summary.md").read_text().strip().split("\n## ")[-1]
        print(f"## {summary}\n")


if __name__ == "__main__":
    main()
