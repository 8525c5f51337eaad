"""What a step on data-parallel replicas has beyond the simulated one, layout by layout, and where.

    python -m benchmarks.replicated_costs --cluster4 cluster4.json --rounds 3      # about 7 minutes
    python -m benchmarks.replicated_costs --cluster4 cluster4.json --trace runs/replicated_traces

The first form trains five ``full_shard`` layouts of the calibration's emulated model at 4 processes (p=2, dp=2,
breadth-first) that vary one thing each against v=2 m=4 with 1 MiB layers: the layers' weights (4 MiB), the
stages per rank (v=4, v=8) and the micro-batches (m=16), in alternating rounds, and prints each median step
beside the simulated one on the cluster without its data-parallel cost per action, with a least-squares fit of
a cost per gradient reduction on the critical path and one per action to the differences. If a layout's excess
is not explained by those two terms, the residuals say so.

``--trace`` instead traces ``interleaved_zb`` at v=2 and v=4 at the fastest benchmark's split_p2_m2_dp2 point
(``BFPPStrategy(trace=...)``) and prints, per rank, the traced step's exposed data-parallel communication and
the wait for the first stage's gather beside the simulator's; ``--prefetch-stages 0`` with no next stage's gather
in flight beside the first.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from benchmarks.fastest import Point
from benchmarks.suite import launch
from benchmarks.suite.spec import Job
from lightning_bfpp.adapter.strategy import BFPPStrategy
from lightning_bfpp.adapter.user_step import training_step_input
from lightning_bfpp.measure.calibrate import RUNTIME_MODEL, one_thread, run_emulated, sensitivity
from lightning_bfpp.measure.emulated import EmulatedNet
from lightning_bfpp.measure.profile import profile_module
from lightning_bfpp.plan.cluster import Cluster
from lightning_bfpp.plan.plan import Plan
from lightning_bfpp.plan.simulate import simulate
from lightning_bfpp.plan.timeline import Span, read_spans, summarize

MIB = 1 << 20
# name: (stages per rank, micro-batches, bytes of weights per layer)
LAYOUTS = {
    "v2_m4_1MiB": (2, 4, MIB),
    "v2_m4_4MiB": (2, 4, 4 * MIB),
    "v4_m4_1MiB": (4, 4, MIB),
    "v8_m4_1MiB": (8, 4, MIB),
    "v2_m16_1MiB": (2, 16, MIB),
}


def replicated_plan(v: int, m: int) -> Plan:
    return Plan("breadth_first", 2, 2, v, m, 1, sharding="full_shard")


def fit_costs(rows: list[tuple[float, float, float]]) -> tuple[tuple[float, float], list[float]]:
    """``(per reduction, per action)`` seconds and the residuals, least squares over rows of ``(excess, reductions
    on the critical path, actions on it)``: excess ≈ reductions × a + actions × b (either may come out negative:
    a term the simulator over-charges)."""
    a = np.array([[r[1], r[2]] for r in rows])
    y = np.array([r[0] for r in rows])
    x, *_ = np.linalg.lstsq(a, y, rcond=None)
    return (float(x[0]), float(x[1])), [float(e) for e in y - a @ x]


def measure(cluster: Cluster, rounds: int) -> None:
    cluster = replace(cluster, data_parallel_action_overhead_s=0.0)
    with one_thread():
        profile = profile_module(
            EmulatedNet(RUNTIME_MODEL), (torch.randn(1, RUNTIME_MODEL.activation_numel),), training_step_input
        )
    profile = replace(profile, optimizer_state_ratio=0.0)
    runs: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    for _ in range(rounds):  # alternating, so that the machine's drift spreads over every layout
        for name, (v, m, weights) in LAYOUTS.items():
            model = replace(RUNTIME_MODEL, param_numel=weights // 4)
            runs[name].append(run_emulated(replicated_plan(v, m), model, 12, 4, strategy=BFPPStrategy))
    rows = []
    for name, (v, m, weights) in LAYOUTS.items():
        plan = replicated_plan(v, m)
        layers = replace(profile, layers=tuple(replace(layer, param_bytes=weights) for layer in profile.layers))
        base, per_collective = sensitivity(plan, layers, cluster, "collective_overhead_s")
        _, per_action = sensitivity(plan, layers, cluster, "data_parallel_action_overhead_s")
        measured = statistics.median(runs[name])
        rows.append((measured - base, per_collective, per_action))
        print(f"{name}: measured {1e3 * measured:.0f} ms (rounds {[round(1e3 * s) for s in runs[name]]}),"
              f" simulated {1e3 * base:.0f} ms, excess {1e3 * (measured - base):+.1f} ms")  # fmt: skip
    (per_reduction, per_action), residuals = fit_costs(rows)
    print(f"fit: {1e3 * per_reduction:+.2f} ms per reduction on the critical path, {1e3 * per_action:+.2f} ms per"
          f" action; residuals (ms): {', '.join(f'{1e3 * e:+.1f}' for e in residuals)}")  # fmt: skip


def first_gather_wait(spans: list[Span], rank: int) -> float:
    """How long ``rank``'s first compute waited for its first stage's gather (s)."""
    waits = sorted((s for s in spans if s.rank == rank and s.kind == "gather_wait"), key=lambda s: s.start)
    return waits[0].duration if waits else 0.0


def trace(cluster: Cluster, out: Path, prefetch_stages: int = 1, step: int = 8) -> None:
    point = Point(True, 2, 2, 2)
    profile = point.nominal_profile()
    common = dict(group=point.name, processes=4, p=2, m=2, dp=2, emulated=point.emulated, warmup=4, steps=6,
                  timeout_s=300.0)  # fmt: skip
    for v in (2, 4):
        folder = out / f"interleaved_zb_v{v}"
        job = Job(f"{point.name}/interleaved_zb_v{v}", kind="bfpp", label=f"interleaved_zb v={v}",
                  schedule="interleaved_zb", v=v, prefetch_stages=prefetch_stages, trace=str(folder),
                  **common)  # fmt: skip
        launch.launch(job, out / f"interleaved_zb_v{v}_records")
        traced = read_spans(folder / f"step{step:05d}.spans.json")
        plan = Plan("interleaved_zb", 2, 2, v, 2, 1, sharding="full_shard", prefetch_stages=prefetch_stages)
        simulated = simulate(plan, profile, cluster).spans
        for label, spans in (("traced", traced), ("simulated", simulated)):
            line = "; ".join(
                f"rank {s.rank}: {1e3 * s.step_time:.0f} ms, exposed data-parallel {1e3 * s.data_parallel:.0f} ms,"
                f" first gather wait {1e3 * first_gather_wait(spans, s.rank):.1f} ms"
                for s in summarize(spans)
            )
            print(f"interleaved_zb v={v} {label}: {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster4", type=Path, required=True, help="a Cluster JSON for 4 processes (plan calibrate)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trace", type=Path, help="trace split_p2_m2_dp2's interleaved_zb v=2 and v=4 here instead")
    parser.add_argument("--prefetch-stages", type=int, default=1, help="--trace: BFPPStrategy(prefetch_stages=)")
    args = parser.parse_args()
    cluster = Cluster.from_json(args.cluster4)
    if args.trace:
        trace(cluster, args.trace, args.prefetch_stages)
    else:
        measure(cluster, args.rounds)


if __name__ == "__main__":
    main()
