"""What this machine allows the suite's targets (a) and (b), and the nearest points where they are met.

    python -m benchmarks.limits --quick     # every section, fewer points, one round: about 6 minutes on 2 cores
    python -m benchmarks.limits --full      # every point, three interleaved rounds: about 45 minutes
    python -m benchmarks.limits --full --only shard/2M/f60,shard/2M/f80 --merge   # add rows to the last run

A launch during which other processes kept the cores busy is run again once the machine is quiet (``--retries``,
``--wait``), which makes a run on a shared machine longer.

Writes ``limits.md`` and ``limits.json`` to ``--out`` (default ``docs/benchmarks``); each process's log and raw
record, and the Chrome traces and PNG timelines of the traced jobs, go to ``runs/benchmarks/limits``. The jobs
are the suite's (:mod:`benchmarks.suite`: the same launcher, workers, models and counters), so the rows mean
what ``results.md``'s mean:

1. host cost of the schedule, (a)'s p=4 v=2 m=4 job with layer times from 0 up: the step at 0 ms is the
   schedule's own per-step host and communication cost; the efficiency at each layer time, and the layer time
   where each implementation reaches 0.95 of the bound; the same at p=2 v=4 m=2 on two processes (no
   contention for the two cores); traced steps, cut into their critical paths;
2. sharded communication, (b): bfpp's gathers and reductions alone (no compute), the (b) comparison over
   parameter sizes and layer times, and the ratio over ``ScheduleLoopedBFS`` that communication volume allows;
   with ``--full``, (b) beside torch's schedules over 2, 4 and 8 micro-batches, each sharding of bfpp against the
   torch setting that holds weights as long;
3. the machine: load, the CPU other work took while each job ran, sleep overrun, and two one-thread processes'
   throughput against one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.run import _sleep_overshoot_ms
from benchmarks.suite import configs, critical_path, launch, report
from benchmarks.suite.report import Row, Spread
from benchmarks.suite.spec import Emulated, Job, bound_s
from lightning_bfpp.plan.timeline import Span, draw, write_chrome_trace

REPO = Path(__file__).resolve().parents[1]
RAW = REPO / "runs/benchmarks/limits"
RUN_FILE = RAW / "run.json"  # every launch's records of the last run: ``--report`` writes the report from it
TARGET_EFFICIENCY = 0.95  # (a)
TARGET_DP_COST = 0.07  # (b), as the suite words it: sharded data parallelism costs 1 − no-dp step / dp step ≤ 7%
BUSY = 0.25  # cores other work kept busy, on average over a job, above which the job shared the machine

# -- the jobs -------------------------------------------------------------------------------------------------

HOST_LAYOUTS: dict[str, dict[str, Any]] = {
    "p4": dict(processes=4, p=4, v=2, m=4),  # (a)
    "p2": dict(processes=2, p=2, v=4, m=2),  # two processes: no contention for the two cores
}
HOST_IMPLS: dict[str, dict[str, Any]] = {
    "bfpp": dict(kind="bfpp", label="bfpp (Lightning)"),
    "bfpp_hand": dict(kind="bfpp_hand", label="bfpp schedule by hand"),
    "LoopedBFS": dict(kind="torch", schedule="LoopedBFS", label="torch LoopedBFS"),
    "Interleaved1F1B": dict(kind="torch", schedule="Interleaved1F1B", label="torch Interleaved1F1B"),
}
TRACED = ("bfpp", "bfpp_hand", "LoopedBFS", "Interleaved1F1B")
B_LAYOUT: dict[str, Any] = dict(processes=4, p=2, v=4, m=2, dp=2)  # (b)
SHARD_IMPLS: dict[str, dict[str, Any]] = {
    "bfpp": dict(kind="bfpp", label="bfpp (Lightning), full_shard dp=2"),
    "nodp": dict(kind="bfpp", processes=2, dp=1, label="bfpp (Lightning), no data parallelism"),
    "LoopedBFS": dict(kind="torch", schedule="LoopedBFS", label="torch LoopedBFS + FSDP2"),
    "LoopedBFS_reshard": dict(
        kind="torch", schedule="LoopedBFS", reshard_after_forward=True,
        label="torch LoopedBFS + FSDP2 (default resharding)",
    ),
    "hand": dict(kind="bfpp_hand", label="bfpp by hand, full_shard dp=2"),
    "hand_none": dict(kind="bfpp_hand", sharding="none", label="bfpp by hand, 2 replicas, no gradient exchange"),
}  # fmt: skip
B_SIZE = 2_000_000  # (b)'s fp32 parameters per layer
# section 2 (iv): bfpp against torch's schedules + FSDP2 at (b) and with more micro-batches, where FSDP2's default
# resharding gathers once per micro-batch; and each sharding of bfpp against the torch schedules of its own kind
# (``shard_grad_op`` keeps a stage's weights from its forward to its backward, as ``reshard_after_forward=False``)
PEER_MS = (2, 4, 8)
PEER_IMPLS: dict[str, dict[str, Any]] = {
    "bfpp": SHARD_IMPLS["bfpp"],
    "bfpp_zero2": dict(kind="bfpp", sharding="shard_grad_op", label="bfpp (Lightning), shard_grad_op dp=2"),
    "LoopedBFS": SHARD_IMPLS["LoopedBFS"],
    "LoopedBFS_reshard": SHARD_IMPLS["LoopedBFS_reshard"],
    "Interleaved1F1B": dict(kind="torch", schedule="Interleaved1F1B", label="torch Interleaved1F1B + FSDP2"),
}


@dataclass(frozen=True)
class Points:
    """Which layer times and sizes a mode measures, and how long."""

    host_ms: tuple[float, ...]  # forward ms per layer (backward twice that), section 1
    shard_sizes: tuple[int, ...]  # parameters per layer at 5 ms, section 2
    shard_ms: tuple[float, ...]  # forward ms per layer at (b)'s 2M parameters, section 2
    shard_ms_impls: tuple[str, ...]  # the implementations measured at those layer times
    far_ms: tuple[float, ...]  # layer times past (b)'s 7% crossing, measured for bfpp and no-dp only (long steps)
    peers: bool  # section 2 (iv): (b) at PEER_M micro-batches, and bfpp shard_grad_op against torch's schedules
    rounds: int
    warmup: int
    steps: int


QUICK = Points(
    (0, 5, 20), (62_500, 250_000, 500_000, 1_000_000, B_SIZE), (0, 10, 20), ("bfpp", "nodp"), (), False, 1, 2, 4
)
FULL = Points(
    (0, 5, 10, 20, 40),
    (62_500, 125_000, 250_000, 500_000, 1_000_000, B_SIZE),
    (0, 10, 20, 40),
    ("bfpp", "nodp", "LoopedBFS", "LoopedBFS_reshard"),
    (60, 80),
    True,
    3,
    2,
    5,
)


def emulated(forward_ms: float, param_numel: int = configs.EMULATED_A.param_numel) -> Emulated:
    return replace(configs.EMULATED_A, forward_ms=forward_ms, backward_ms=2 * forward_ms, param_numel=param_numel)


def lightning_traces(forward_ms: float) -> Path:
    """Where the traced Lightning job's ``BFPPStrategy(trace=...)`` writes its timelines."""
    return RAW / "lightning_traces" / f"f{forward_ms:g}"


def host_name(layout: str, forward_ms: float, impl: str) -> str:
    return f"host/{layout}/f{forward_ms:g}/{impl}"


def shard_name(param_numel: int, forward_ms: float, impl: str) -> str:
    return f"shard/{param_numel / 1e6:g}M/f{forward_ms:g}/{impl}"


def peer_name(m: int, impl: str) -> str:
    """Section 2 (iv)'s jobs: (b) at 5 ms layers with ``m`` micro-batches, side by side."""
    return f"peers/m{m}/{impl}"


def jobs(points: Points) -> list[Job]:
    """Every job of a mode, in the order one round runs them."""
    steps = dict(warmup=points.warmup, steps=points.steps)
    capacity = dict(
        group="machine", kind="independent", model="gpt", gpt=configs.GPT, microbatch_size=configs.GPT_MICROBATCH,
        warmup=3, steps=20,
    )  # fmt: skip
    listed = [
        Job("machine/one_before", label="one process (before)", processes=1, **capacity),
        Job("machine/two_before", label="two independent processes (before)", processes=2, **capacity),
    ]
    for layout, sizes in HOST_LAYOUTS.items():
        for forward_ms in points.host_ms:
            listed += [
                Job(host_name(layout, forward_ms, impl), group=f"host/{layout}", emulated=emulated(forward_ms),
                    **spec, **sizes, **steps)
                for impl, spec in HOST_IMPLS.items()
            ]  # fmt: skip
    for forward_ms in (0.0, 5.0):  # traced: what the steps of (a) wait on
        listed += [
            Job(f"trace/f{forward_ms:g}/{impl}", group="trace", emulated=emulated(forward_ms),
                trace=str(lightning_traces(forward_ms)) if impl == "bfpp" else "spans",
                **HOST_IMPLS[impl], **HOST_LAYOUTS["p4"], **steps)
            for impl in TRACED
        ]  # fmt: skip
    b_model = emulated(5.0, B_SIZE)
    listed += [
        Job(f"comm/{mode}", group="comm", kind="collectives", schedule=mode, label=f"collectives alone, {mode}",
            emulated=b_model, **B_LAYOUT, **steps)
        for mode in ("waited", "async")
    ]  # fmt: skip
    # one data-parallel group alone (2 processes): stages of the same 2 layers, p=1 v=8
    one_group = dict(B_LAYOUT, processes=2, p=1, v=8)
    listed.append(Job("comm/one_group", group="comm", kind="collectives", schedule="waited",
                      label="collectives alone, waited, one data-parallel group", emulated=b_model, **one_group,
                      **steps))  # fmt: skip

    def shard_job(param_numel: int, forward_ms: float, impl: str) -> Job:
        spec = {**B_LAYOUT, **SHARD_IMPLS[impl]}
        return Job(shard_name(param_numel, forward_ms, impl), group="shard",
                   emulated=emulated(forward_ms, param_numel), **spec, **steps)  # fmt: skip

    for size in points.shard_sizes:
        impls = ("bfpp", "nodp", "LoopedBFS", "LoopedBFS_reshard")
        listed += [shard_job(size, 5.0, impl) for impl in impls + (("hand", "hand_none") if size == B_SIZE else ())]
    for forward_ms in points.shard_ms:
        extra = ("hand_none",) if forward_ms == 0 else ()
        listed += [shard_job(B_SIZE, forward_ms, impl) for impl in points.shard_ms_impls + extra]
    for forward_ms in points.far_ms:
        listed += [shard_job(B_SIZE, forward_ms, impl) for impl in ("bfpp", "nodp")]
    if points.peers:
        for m in PEER_MS:
            listed += [
                Job(peer_name(m, impl), group="peers", emulated=emulated(5.0, B_SIZE),
                    **{**B_LAYOUT, "m": m, **PEER_IMPLS[impl]}, **steps)
                for impl in PEER_IMPLS
            ]  # fmt: skip
    listed += [
        Job("machine/two_after", label="two independent processes (after)", processes=2, **capacity),
        Job("machine/one_after", label="one process (after)", processes=1, **capacity),
    ]
    return listed


# -- measurements of a row ------------------------------------------------------------------------------------


@dataclass
class Measured:
    """One job's row, with what this report adds: host CPU per step, and what other work took meanwhile."""

    job: Job
    row: Row
    launches: list[list[dict[str, Any]]]
    cpu_ms: Spread | None = None  # all ranks' process CPU time per step (every thread), summed over ranks
    others: list[float] = field(default_factory=list)  # cores other processes kept busy during each launch
    quiet: int = 0  # launches with others under BUSY cores: the row's figures come from these when there are any

    @property
    def step(self) -> float | None:
        return self.row.step_ms.median if self.row.step_ms is not None else None

    @property
    def bound(self) -> float | None:
        return self.row.bound_ms

    @property
    def overhead(self) -> float | None:
        return None if self.step is None or self.bound is None else self.step - self.bound

    @property
    def cores(self) -> float | None:
        """Cores busy on average over a step: host CPU per step over the median step."""
        return None if self.cpu_ms is None or not self.step else self.cpu_ms.median / self.step

    def records(self) -> Iterable[list[dict[str, Any]]]:
        return (r for r in self.launches if not any("error" in x for x in r))


def cpu_per_step(launches: list[list[dict[str, Any]]]) -> Spread | None:
    """The process CPU time of all ranks per step (the i-th timed step of every rank, summed), in ms."""
    per_step: list[float] = []
    for records in launches:
        if any("error" in r for r in records):
            continue
        timed = [r["marks"][r["warmup"] :] for r in records]
        count = min(len(t) for t in timed) - 1
        per_step += [1e3 * sum(t[i + 1]["cpu_s"] - t[i]["cpu_s"] for t in timed) for i in range(count)]
    return Spread.of(per_step) if per_step else None


# -- section 1: host cost of the schedule ---------------------------------------------------------------------


@dataclass
class Fit:
    """``step = intercept + slope · bound`` over an implementation's layer times (ms)."""

    intercept: float
    slope: float

    @staticmethod
    def of(points: list[tuple[float, float]]) -> Fit | None:
        if len(points) < 2:
            return None
        xs, ys = [x for x, _ in points], [y for _, y in points]
        slope, intercept = statistics.linear_regression(xs, ys)
        return Fit(intercept, slope)

    def bound_for(self, efficiency: float) -> float | None:
        """The bound (ms) at which ``bound / step`` reaches ``efficiency``; None if it never does."""
        denominator = 1 - efficiency * self.slope
        return efficiency * self.intercept / denominator if denominator > 0 else None


def host_section(measured: dict[str, Measured], points: Points) -> tuple[list[str], dict[str, Any]]:
    lines: list[str] = []
    data: dict[str, Any] = {}
    for layout, sizes in HOST_LAYOUTS.items():
        title = {"p4": "(a)'s layout", "p2": "two processes"}[layout]
        unit = bound_s(Job("unit", "", "bfpp", "", emulated=emulated(1.0), **sizes)) or 0.0  # the bound per 1 ms
        lines += [
            f"### {title}: p={sizes['p']} v={sizes['v']} m={sizes['m']}, {sizes['processes']} processes",
            "",
            f"Bound `(m·v + p − 1)(f + b)` = {1e3 * unit:.0f} × (forward ms per layer) here. Overhead: median step"
            " minus the bound. CPU: all ranks' host CPU time per step (every thread), and the cores that keeps busy"
            " over the median step (the machine has 2).",
            "",
            "| implementation | forward / backward ms per layer | step ms, median (min–max) | bound ms | overhead ms"
            " | efficiency | CPU ms/step (cores busy) | others' cores |",
            "|---|---|---|---|---|---|---|---|",
        ]
        summary = []
        for impl, spec in HOST_IMPLS.items():
            fit_points = []
            for forward_ms in points.host_ms:
                m = measured.get(host_name(layout, forward_ms, impl))
                if m is None:
                    continue
                lines.append(_host_line(spec["label"], forward_ms, m))
                if m.step is not None and m.bound is not None:
                    fit_points.append((m.bound, m.step))
                    data.setdefault(layout, {}).setdefault(impl, {})[f"{forward_ms:g}"] = {
                        "step_ms": m.step, "bound_ms": m.bound, "overhead_ms": m.overhead,
                        "cpu_ms": m.cpu_ms.median if m.cpu_ms else None,
                    }  # fmt: skip
            fit = Fit.of(fit_points)
            summary.append((impl, spec["label"], fit, fit_points, unit))
        lines += ["", *_feasible_lines(summary, layout, data), "", *_versus_lines(measured, points, layout, data), ""]
    return lines, data


def _versus_lines(measured: dict[str, Measured], points: Points, layout: str, data: dict[str, Any]) -> list[str]:
    """Each implementation's median step over Interleaved1F1B's at the same layer time, and whether the ranges
    of their steps overlap (a difference inside both spreads is not told apart from noise by this run)."""
    lines = [
        "Against torch Interleaved1F1B at the same layer time (median step over its median; `<`: every step of"
        " the row shorter than every one of Interleaved1F1B's, `>`: every one longer, `~`: the ranges overlap):",
        "",
        "| forward ms per layer | " + " | ".join(HOST_IMPLS[i]["label"] for i in HOST_IMPLS) + " |",
        "|---|" + "---|" * len(HOST_IMPLS),
    ]
    for forward_ms in points.host_ms:
        theirs = measured.get(host_name(layout, forward_ms, "Interleaved1F1B"))
        if theirs is None or theirs.row.step_ms is None:
            continue
        cells = []
        for impl in HOST_IMPLS:
            ours = measured.get(host_name(layout, forward_ms, impl))
            if ours is None or ours.row.step_ms is None:
                cells.append("–")
                continue
            a, b = ours.row.step_ms, theirs.row.step_ms
            order = "<" if a.max < b.min else ">" if a.min > b.max else "~"
            cells.append(f"{a.median / b.median:.3f} {order}")
            data.setdefault(layout, {}).setdefault(impl, {}).setdefault("vs_interleaved", {})[f"{forward_ms:g}"] = (
                a.median / b.median
            )
        lines.append(f"| {forward_ms:g} | " + " | ".join(cells) + " |")
    return lines


def _host_line(label: str, forward_ms: float, m: Measured) -> str:
    if m.row.step_ms is None:
        return f"| {label} | {forward_ms:g} / {2 * forward_ms:g} | failed: {report._one_line(m.row.errors)} | | | | | |"
    cpu = f"{m.cpu_ms.median:.0f} ({m.cores:.2f})" if m.cpu_ms is not None and m.cores is not None else ""
    efficiency = f"{m.row.efficiency:.2f}" if m.row.efficiency is not None and m.bound else "–"
    return (
        f"| {label} | {forward_ms:g} / {2 * forward_ms:g} | {m.row.step_ms.text()} | {m.bound:.0f} |"
        f" {m.overhead:.0f} | {efficiency} | {cpu} | {_others(m)} |"
    )


def _feasible_lines(summary: list[tuple[str, str, Fit | None, list[tuple[float, float]], float]], layout: str,
                    data: dict[str, Any]) -> list[str]:  # fmt: skip
    need = TARGET_EFFICIENCY / (1 - TARGET_EFFICIENCY)  # bound / overhead at the target
    lines = [
        f"Where each reaches {TARGET_EFFICIENCY} of the bound (the nearest feasible point of (a)): with the"
        f" overhead measured at the largest layer time held constant (the bound must be {need:.0f}× it); from the"
        " fit `step = a + k · bound` over all its layer times (a: the fixed per-step cost; k > 1: a cost that"
        f" grows with the layer time, such as the sleeps' overrun), solved for `bound / step = {TARGET_EFFICIENCY}`;"
        " and the first measured layer time that reached it.",
        "",
        "| implementation | overhead ms at each layer time | 0.95 at, constant overhead | a (ms) | k |"
        " 0.95 at, fit | measured ≥ 0.95 at |",
        "|---|---|---|---|---|---|---|",
    ]
    for impl, label, fit, fit_points, unit in summary:
        if fit is None:
            lines.append(f"| {label} | | | | | not measured | |")
            continue
        overheads = ", ".join(f"{step - bound:.0f}" for bound, step in fit_points)
        last_bound, last_step = max(fit_points)
        constant = need * (last_step - last_bound) / (1e3 * unit)
        needed = fit.bound_for(TARGET_EFFICIENCY)
        at = "never (k ≥ 1/0.95)" if needed is None else f"{needed / (1e3 * unit):.1f} ms fwd"
        reached = [bound / (1e3 * unit) for bound, step in fit_points if bound and bound / step >= TARGET_EFFICIENCY]
        first = f"{min(reached):g} ms" if reached else "none measured"
        lines.append(
            f"| {label} | {overheads} | {constant:.1f} ms fwd | {fit.intercept:.0f} | {fit.slope:.3f} | {at} |"
            f" {first} |"
        )
        entry = data.setdefault(layout, {}).setdefault(impl, {})
        entry["fit"] = {"a_ms": fit.intercept, "k": fit.slope}
        entry["forward_ms_for_0.95"] = {
            "constant_overhead": constant,
            "fit": None if needed is None else needed / (1e3 * unit),
        }
    return lines


PHASES = ("before", "pipeline", "collectives", "after", "optimizer", "between")


def phase_split(m: Measured) -> dict[str, dict[str, float]]:
    """Rank 0's and the other ranks' step split at the step clock's phases, median ms per step (see
    :func:`phases_section`); a plain loop has only its schedule ("pipeline"), its optimizer step and nothing
    between."""
    split: dict[str, dict[str, list[float]]] = {who: {k: [] for k in PHASES} for who in ("rank 0", "others")}
    for records in m.records():
        for rank, record in enumerate(records):
            marks, warmup = record["marks"], record["warmup"]
            at: dict[tuple[int, str], dict[str, float]] = {}
            for ph in record.get("phases", []):
                at.setdefault((ph["step"], ph["name"]), ph)  # a hook's first call in the step
            for k in range(warmup, len(marks) - 2):  # steps with a next step after them
                start, optimizer, end = marks[k], at.get((k, "optimizer")), at.get((k, "end"))
                if optimizer is None or end is None:
                    continue
                before = at.get((k, "zero_grad"), start)
                after = at.get((k, "after_backward"), optimizer)
                collectives = optimizer["collective_s"] - after["collective_s"]
                values = (before["t"] - start["t"], after["t"] - before["t"], collectives,
                          optimizer["t"] - after["t"] - collectives, end["t"] - optimizer["t"],
                          marks[k + 1]["t"] - end["t"])  # fmt: skip
                for key, value in zip(PHASES, values, strict=True):
                    split["rank 0" if rank == 0 else "others"][key].append(1e3 * value)
    return {who: {k: statistics.median(v) for k, v in parts.items() if v} for who, parts in split.items()}


def phases_section(measured: dict[str, Measured], points: Points) -> tuple[list[str], dict[str, Any]]:
    lines = [
        "Each rank's step split at its clock's marks (medians, ms per step; the untraced jobs above). Through"
        " Lightning: *before* = the step's start (`on_train_batch_start`) to `BFPPStrategy.training_step`'s"
        " `on_before_zero_grad`; *pipeline* = from there to its `on_after_backward` (`Pipeline.run`: splitting the"
        " batch, capturing the first stage's inputs, the schedule, the last stage's user step per micro-batch);"
        " *collectives* = the logged-value sync after it (`LoggedValueSync.share`, the step's one collective, where"
        " a rank also waits for the slowest); *after* = the rest up to `on_before_optimizer_step`; *optimizer* ="
        " to `on_train_batch_end`; *between* = to the next step's start (Lightning's loop, the next batch). By"
        " hand and torch: *pipeline* = the schedule's `run` / `step`. Rank 0 runs the first and the last compute"
        " of every step, so what it does outside the pipeline is on the critical path.",
        "",
        "| layout | forward ms | implementation | rank 0: before / pipeline / collectives / after / optimizer /"
        " between | other ranks: the same |",
        "|---|---|---|---|---|",
    ]
    data: dict[str, Any] = {}
    for layout in HOST_LAYOUTS:
        for forward_ms in points.host_ms:
            for impl, spec in HOST_IMPLS.items():
                m = measured.get(host_name(layout, forward_ms, impl))
                split = phase_split(m) if m is not None else {}
                if not split.get("rank 0"):
                    continue
                data.setdefault(layout, {}).setdefault(f"{forward_ms:g}", {})[impl] = split
                cells = [" / ".join(f"{split[who].get(k, float('nan')):.1f}" for k in PHASES) for who in split]
                lines.append(f"| {layout} | {forward_ms:g} | {spec['label']} | {' | '.join(cells)} |")
    return [*lines, ""], data


# -- section 1, traces ----------------------------------------------------------------------------------------


def traced_steps(m: Measured) -> list[tuple[list[Span], float, float]]:
    """Each timed step's spans of every rank, with rank 0's step start and end (the one shared clock).

    Through Lightning, the spans ``BFPPStrategy(trace=...)`` wrote for the timed steps: its clock starts at a
    barrier before each step, and the step ends with its last span (the optimizer's)."""
    if m.job.kind == "bfpp":
        traced = [
            [Span(**s) for s in step] for records in m.records() for step in records[0].get("lightning_spans", [])
        ]
        return [(spans, 0.0, max(s.end for s in spans)) for spans in traced if spans]
    steps = []
    for records in m.records():
        warmup = records[0]["warmup"]
        for k in range(len(records[0]["marks"]) - warmup - 1):
            spans = []
            for record in records:
                start, end = record["marks"][warmup + k]["t"], record["marks"][warmup + k + 1]["t"]
                spans += [Span(**s) for s in record.get("spans", []) if start <= s["start"] < end]
            zero = records[0]["marks"][warmup + k]["t"]
            steps.append((spans, zero, records[0]["marks"][warmup + k + 1]["t"]))
    return steps


def trace_section(measured: dict[str, Measured], out: Path) -> tuple[list[str], dict[str, Any]]:
    data: dict[str, Any] = {}
    orders: dict[str, dict[int, list[critical_path.Op]]] = {}
    labels: dict[str, str] = {}
    for forward_ms in (0.0, 5.0):
        for impl in TRACED:
            m = measured.get(f"trace/f{forward_ms:g}/{impl}")
            steps = traced_steps(m) if m is not None and m.row.step_ms is not None else []
            if m is None or not steps:
                continue
            labels[impl] = m.job.label
            data.setdefault(f"{forward_ms:g}", {})[impl] = _trace_entry(m.job, steps)
            _write_traces(steps, out / f"f{forward_ms:g}_{impl}", f"{m.job.label} {m.job.layout}, {forward_ms:g} ms")
            if forward_ms == 5.0:
                orders[impl] = critical_path.orders(steps[0][0])
    lines = [
        "Each traced job ran its timed steps under `lightning_bfpp.engine.trace.StepTracer`'s hooks on torch's runtime"
        " (bfpp by hand, LoopedBFS and Interleaved1F1B all run on `_PipelineScheduleRuntime`), on the clock all"
        " processes share, without the barrier `BFPPStrategy(trace=...)` puts before a step; bfpp through"
        " Lightning with `BFPPStrategy(trace=...)` itself (its steps start at that barrier and end, here, with"
        " rank 0's optimizer step). The critical path walks back from the step's last compute span, each time to"
        " whichever ended later: the previous compute on the same rank, or the producing compute on another rank"
        " (the previous stage's forward, the next stage's backward). Its length is the compute spans on it"
        " (nominal compute plus the host time inside the actions: torch's stage bookkeeping, autograd, the"
        " sleep's overrun, and through Lightning the user's step on the last stage), the *hops* (producer's end to"
        " the consumer's start on another rank: the send, the transfer, the wake-up) and the *gaps* (host time"
        " between two compute spans of one rank). Medians over the traced steps.",
        "",
        "| layer ms | implementation | step ms | path ms | compute on path: nominal + inside (spans) | hops: n × median"
        " ms (total) | gaps: n × median ms (total) | rank 0 before its first compute + after its last, ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for forward_ms, entries in data.items():
        for impl, e in entries.items():
            lines.append(
                f"| {forward_ms} | {labels[impl]} | {e['step_ms']:.0f} | {e['path_ms']:.0f} |"
                f" {e['path_nominal_ms']:.0f} + {e['path_compute_ms'] - e['path_nominal_ms']:.0f}"
                f" ({e['path_computes']:.0f}) | {e['hops']:.0f} × {e['hop_ms']:.2f} ({e['hops_total_ms']:.0f}) |"
                f" {e['gaps']:.0f} × {e['gap_ms']:.2f} ({e['gaps_total_ms']:.0f}) |"
                f" {e['lead_ms']:.1f} + {e['tail_ms']:.1f} |"
            )
    lines += [
        "",
        "Host time inside one action (its span minus the nominal sleep; median over all ranks and steps), rank 0's"
        " optimizer step and (through Lightning) the logged-value sync after the schedule, and each rank's time"
        " waiting for its neighbours:",
        "",
        "| layer ms | implementation | F / B | last stage's F | first stage's F | optimizer (rank 0) | step sync"
        " (rank 0) | waiting per rank (0 / 1 / 2 / 3) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for forward_ms, entries in data.items():
        for impl, e in entries.items():
            lines.append(
                f"| {forward_ms} | {labels[impl]} | {e['inside_forward_ms']:.2f} / {e['inside_backward_ms']:.2f} |"
                f" {e['inside_last_forward_ms']:.2f} | {e['inside_first_forward_ms']:.2f} |"
                f" {e['optimizer_ms']:.1f} | {e['step_sync_ms']:.1f} |"
                f" {' / '.join(f'{w:.0f}' for w in e['wait_ms_per_rank'])} |"
            )
    lines += ["", *_replay_lines(orders, data)]
    return lines, data


def _trace_entry(job: Job, steps: list[tuple[list[Span], float, float]]) -> dict[str, Any]:
    """One traced job's critical path and host-time figures, medians over its traced steps."""
    stage_layers = job.emulated.layers // (job.p * job.v)
    nominal = {kind: stage_layers * getattr(job.emulated, f"{kind}_ms") for kind in ("forward", "backward")}
    last = job.p * job.v - 1
    paths = [critical_path.critical_path(spans, last + 1, zero) for spans, zero, _ in steps]
    med = statistics.median

    def rank0(spans: list[Span]) -> list[Span]:
        return sorted((s for s in spans if s.rank == 0 and s.kind in ("forward", "backward")), key=lambda s: s.start)

    def total(kind: str, rank: int) -> float:
        return med([1e3 * sum(s.duration for s in spans if s.rank == rank and s.kind == kind) for spans, _, _ in steps])

    return {
        "step_ms": med([1e3 * (end - zero) for _, zero, end in steps]),
        "path_ms": med([1e3 * p.length for p in paths]),
        "path_compute_ms": med([1e3 * p.compute for p in paths]),
        "path_nominal_ms": med([sum(nominal[op[0]] for op in p.ops) for p in paths]),
        "path_computes": med([p.computes for p in paths]),
        "hops": med([len(p.hop_latencies) for p in paths]),
        "hop_ms": med([1e3 * h for p in paths for h in p.hop_latencies] or [0.0]),
        "hops_total_ms": med([1e3 * sum(p.hop_latencies) for p in paths]),
        "gaps": med([len(p.gaps) for p in paths]),
        "gap_ms": med([1e3 * g for p in paths for g in p.gaps] or [0.0]),
        "gaps_total_ms": med([1e3 * sum(p.gaps) for p in paths]),
        "lead_ms": med([1e3 * (rank0(spans)[0].start - zero) for spans, zero, _ in steps]),
        "tail_ms": med([1e3 * (end - rank0(spans)[-1].end) for spans, _, end in steps]),
        "inside_forward_ms": _inside(steps, nominal["forward"], lambda s: s.kind == "forward"),
        "inside_backward_ms": _inside(steps, nominal["backward"], lambda s: s.kind == "backward"),
        "inside_last_forward_ms": _inside(steps, nominal["forward"], lambda s: s.kind == "forward" and s.stage == last),
        "inside_first_forward_ms": _inside(steps, nominal["forward"], lambda s: s.kind == "forward" and s.stage == 0),
        "optimizer_ms": total("optimizer", 0),
        "step_sync_ms": total("step_sync", 0),
        "wait_ms_per_rank": [total("p2p_wait", r) for r in range(job.p)],
        "path": [f"{s}{'F' if k == 'forward' else 'B'}{mb}" for k, s, mb in paths[len(paths) // 2].ops],
    }


def _inside(steps: list[tuple[list[Span], float, float]], nominal_ms: float, which: Callable[[Span], bool]) -> float:
    """The median host time inside the compute actions ``which`` selects: their spans minus the nominal sleep."""
    return statistics.median(1e3 * s.duration - nominal_ms for spans, _, _ in steps for s in spans if which(s))


def _replay_lines(orders: dict[str, dict[int, list[critical_path.Op]]], data: dict[str, Any]) -> list[str]:
    """The measured per-rank orders replayed: with the same costs for all (does the order alone matter?), and
    with each implementation's own measured costs (do its per-action costs explain its step?)."""
    traced = data.get("5", {})
    if not orders or not traced:
        return []
    hop = statistics.median(e["hop_ms"] for e in traced.values())
    gap = statistics.median(e["gap_ms"] for e in traced.values())
    stage = 2 * emulated(5.0).forward_ms  # (a): two layers per stage
    lines = [
        f"The per-rank orders each ran (traced, 5 ms layers) replayed (`benchmarks/suite/critical_path.py`): with"
        f" the same costs for all (a stage's forward {stage:g} ms, backward {2 * stage:g} ms; free, then with the"
        f" median hop {hop:.2f} ms and gap {gap:.2f} ms of all traced jobs on every hop and after every compute),"
        " and with the implementation's own medians (host time inside its F and B actions, its hop, its gap):",
        "",
        "| implementation | order of rank 2 / rank 3 | free | same hop and gap | its own costs | measured step |",
        "|---|---|---|---|---|---|",
    ]
    for impl, ranked in orders.items():
        e = traced[impl]
        free = critical_path.replay(ranked, 8, stage, 2 * stage)
        same = critical_path.replay(ranked, 8, stage, 2 * stage, hop=hop, gap=gap)
        forward, backward = stage + e["inside_forward_ms"], 2 * stage + e["inside_backward_ms"]
        own = critical_path.replay(ranked, 8, forward, backward, hop=e["hop_ms"], gap=e["gap_ms"])
        shown = " / ".join(" ".join(f"{s}{k[0].upper()}{mb}" for k, s, mb in ranked.get(r, [])) for r in (2, 3))
        lines.append(f"| {impl} | {shown} | {free:.0f} | {same:.0f} | {own:.0f} | {e['step_ms']:.0f} |")
        e["replay_ms"] = {"free": free, "same_hop_gap": same, "own_costs": own}
        e["order"] = {r: [f"{s}{k[0].upper()}{mb}" for k, s, mb in ops] for r, ops in ranked.items()}
    return [*lines, ""]


def _write_traces(steps: list[tuple[list[Span], float, float]], folder: Path, title: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i, (spans, zero, _) in enumerate(steps[:3]):
        shifted = [replace(s, start=s.start - zero, end=s.end - zero) for s in spans]
        write_chrome_trace(shifted, folder / f"step{i}.json", title)
        draw(shifted, folder / f"step{i}.png", title)


# -- section 2: sharded communication -------------------------------------------------------------------------


def comm_section(measured: dict[str, Measured]) -> tuple[list[str], dict[str, Any]]:
    waited, alone = measured.get("comm/waited"), measured.get("comm/async")
    nodp = measured.get(shard_name(B_SIZE, 5.0, "nodp"))
    dp = measured.get(shard_name(B_SIZE, 5.0, "bfpp"))
    none = measured.get(shard_name(B_SIZE, 5.0, "hand_none"))
    nodp0, dp0 = measured.get(shard_name(B_SIZE, 0.0, "nodp")), measured.get(shard_name(B_SIZE, 0.0, "bfpp"))
    none0 = measured.get(shard_name(B_SIZE, 0.0, "hand_none"))
    if waited is None or waited.step is None:
        return ["Not measured in this run.", ""], {}
    per_op = _per_collective(waited)
    plan = next(iter(waited.records()))[0]["plan"]
    gathers, reductions = plan.count("gather"), plan.count("reduce")
    stage_mib = 4 * waited.job.emulated.param_numel * waited.job.emulated.layers / (waited.job.p * waited.job.v) / 2**20
    data: dict[str, Any] = {
        "gathers": gathers, "reductions": reductions, "stage_mib": stage_mib,
        "gather_ms": statistics.median(per_op["gather"]), "reduce_ms": statistics.median(per_op["reduce"]),
        "waited_ms": waited.step, "async_ms": alone.step if alone else None,
        "waited_cpu_ms": waited.cpu_ms.median if waited.cpu_ms else None,
        "async_cpu_ms": alone.cpu_ms.median if alone and alone.cpu_ms else None,
    }  # fmt: skip
    lines = [
        f"(i) One bfpp step's data-parallel collectives at (b) issued alone (`benchmarks/suite/collectives.py`): per"
        f" rank {gathers} all-gathers and {reductions} reduce-scatters of a {stage_mib:.0f} MiB stage (2 layers ×"
        f" {waited.job.emulated.param_numel / 1e6:g}M fp32) over dp=2, in the lowered schedule's order, 4 processes"
        " (both data-parallel groups at once, as in the job), no compute, no FSDP2 copies around them.",
        "",
        "| collectives alone | per step ms, median (min–max) | CPU ms/step, 4 ranks (cores busy) | per collective ms"
        " (median, min–max) |",
        "|---|---|---|---|",
        f"| waited, one after the other | {_spread(waited)} | {_cpu(waited)} | {_per_collective_text(per_op)} |",
    ]
    if alone is not None and alone.row.step_ms is not None:
        lines.append(f"| all issued at once, then waited | {_spread(alone)} | {_cpu(alone)} | |")
    one = measured.get("comm/one_group")
    if one is not None and one.row.step_ms is not None:
        one_op = _per_collective(one)
        data["one_group_gather_ms"] = statistics.median(one_op["gather"])
        data["one_group_reduce_ms"] = statistics.median(one_op["reduce"])
        plan_one = next(iter(one.records()))[0]["plan"]
        lines.append(
            f"| waited, one data-parallel group alone (2 processes; p=1 v=8: {plan_one.count('gather')} gathers,"
            f" {plan_one.count('reduce')} reductions of the same 2-layer stages) | {_spread(one)} | {_cpu(one)} |"
            f" {_per_collective_text(one_op)} |"
        )
    lines.append("")
    if nodp is None or nodp.step is None or dp is None or dp.step is None:
        return lines, data
    window = nodp.step
    budget = TARGET_DP_COST / (1 - TARGET_DP_COST) * window
    # two replicas' pipelines on 4 processes; else twice the 2-process pipeline's
    twice = 2 * (nodp.cpu_ms.median if nodp.cpu_ms else 0.0)
    cpu_pipelines = none.cpu_ms.median if none is not None and none.cpu_ms else twice
    cpu_comm = waited.cpu_ms.median if waited.cpu_ms else 0.0
    cores = os.cpu_count() or 2
    floor = (cpu_pipelines + cpu_comm) / cores
    sharded_cpu = dp.cpu_ms.median if dp.cpu_ms else 0.0
    data.update(window_ms=window, budget_ms=budget, cpu_pipelines_ms=cpu_pipelines, floor_ms=floor,
                sharded_cpu_ms=sharded_cpu, sharded_floor_ms=sharded_cpu / cores)  # fmt: skip
    lines += [
        f"The window they would have to hide in: the same pipeline without data parallelism takes {window:.0f} ms"
        f" per step (bound {nodp.bound:.0f} ms; its ranks' compute sleeps and leaves both cores idle), and (b)'s"
        f" target allows the sharded step {budget:.0f} ms more ({TARGET_DP_COST:.0%} of the sharded step). The"
        f" collectives alone take {waited.step:.0f} ms waited and"
        f" {data['async_ms'] or float('nan'):.0f} ms all at once: {waited.step / budget:.1f}× that allowance.",
        "",
        f"Whether the cores could hide them at all: two pipeline replicas without any gradient exchange (bfpp by"
        f" hand, 4 processes) use {cpu_pipelines:.0f} ms of CPU per step, the collectives {cpu_comm:.0f} ms: the"
        f" sharded step needs at least {cpu_pipelines + cpu_comm:.0f} core-ms per step, so on {cores} cores it"
        f" cannot be shorter than {floor:.0f} ms even with perfect overlap ({floor / window:.2f}× the"
        f" no-data-parallelism step; the target is ≤ {1 / (1 - TARGET_DP_COST):.3f}×). The sharded job as it runs"
        f" (FSDP2's copies into and out of its flat buffers, its hooks, and everything else) used {sharded_cpu:.0f}"
        f" core-ms per step: at least {sharded_cpu / cores:.0f} ms on {cores} cores,"
        f" {sharded_cpu / cores / window:.2f}× the no-data-parallelism step.",
        "",
    ]
    rows = [
        ("bfpp (Lightning), no data parallelism, 2 processes", nodp0, nodp),
        ("bfpp by hand, 2 replicas without gradient exchange, 4 processes", none0, none),
        ("bfpp (Lightning), full_shard dp=2, 4 processes", dp0, dp),
    ]
    lines += [
        "The same (b) job in the real runtime, with 0 ms layers (its host and communication cost alone) and with"
        " 5 ms layers:",
        "",
        "| job | step ms at 0 ms layers (CPU ms, cores busy) | step ms at 5 ms layers (CPU ms, cores busy) |",
        "|---|---|---|",
    ]
    for label, zero, five in rows:
        lines.append(f"| {label} | {_step_cpu(zero)} | {_step_cpu(five)} |")
    lines.append("")
    return lines, data


def _per_collective(m: Measured) -> dict[str, list[float]]:
    """Every timed collective's duration (ms) of a waited ``collectives`` job, by kind, over ranks and launches."""
    return {
        kind: [1e3 * d for records in m.records() for r in records for d in r["collective_s"][kind]]
        for kind in ("gather", "reduce")
    }


def _per_collective_text(per_op: dict[str, list[float]]) -> str:
    return f"all-gather {Spread.of(per_op['gather']).text(1)}, reduce-scatter {Spread.of(per_op['reduce']).text(1)}"


def _step_cpu(m: Measured | None) -> str:
    if m is None or m.row.step_ms is None:
        return "not measured"
    return f"{m.row.step_ms.text()} ({_cpu(m)})"


def _cpu(m: Measured) -> str:
    return f"{m.cpu_ms.median:.0f} ({m.cores:.2f})" if m.cpu_ms is not None and m.cores is not None else ""


def sweep_section(measured: dict[str, Measured], points: Points) -> tuple[list[str], dict[str, Any]]:
    lines = [
        "(ii) The (b) comparison over parameter sizes per layer (5 ms layers) and over layer times (2M parameters"
        " per layer). dp cost: `1 − no-dp step / full_shard step`, the suite's measure ((b)'s target: ≤ 7%).",
        "",
        "| params per layer | forward / backward ms | no-dp step ms | full_shard dp=2 step ms | dp cost | LoopedBFS ×"
        " bfpp | LoopedBFS (default resharding) × bfpp | gathers/step: bfpp, LoopedBFS, default resharding |"
        " others' cores: no-dp / dp |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    data: dict[str, Any] = {}
    grid = [(size, 5.0) for size in points.shard_sizes]
    grid += [(B_SIZE, f) for f in points.shard_ms + points.far_ms if f != 5.0]
    for size, forward_ms in sorted(set(grid), key=lambda p: (p[1] != 5.0, p[1], p[0])):
        at = {impl: measured.get(shard_name(size, forward_ms, impl)) for impl in SHARD_IMPLS}
        nodp, dp, lbfs, lbfs_r = at["nodp"], at["bfpp"], at["LoopedBFS"], at["LoopedBFS_reshard"]
        if dp is None or dp.step is None:
            continue
        cost = 1 - nodp.step / dp.step if nodp is not None and nodp.step else None
        ratio = lbfs.step / dp.step if lbfs is not None and lbfs.step else None
        ratio_r = lbfs_r.step / dp.step if lbfs_r is not None and lbfs_r.step else None
        gathers = ", ".join(_num(x.row.gathers_per_step if x else None, 0) for x in (dp, lbfs, lbfs_r))
        lines.append(
            f"| {size / 1e6:g}M | {forward_ms:g} / {2 * forward_ms:g} | {_spread(nodp)} | {_spread(dp)} |"
            f" {_pct(cost)} | {_num(ratio)} | {_num(ratio_r)} | {gathers} |"
            f" {_others(nodp) if nodp else '–'} / {_others(dp)} |"
        )
        data[f"{size / 1e6:g}M/f{forward_ms:g}"] = {
            "nodp_ms": nodp.step if nodp else None, "dp_ms": dp.step, "dp_cost": cost,
            "dp_minus_nodp_ms": dp.step - nodp.step if nodp and nodp.step else None,
            "loopedbfs_ratio": ratio, "loopedbfs_reshard_ratio": ratio_r,
        }  # fmt: skip
    lines += ["", *_nearest_lines(data), ""]
    return lines, data


def _nearest_lines(data: dict[str, Any]) -> list[str]:
    """Where dp cost reaches 7%: measured, and from a line through the extra time full_shard takes."""
    lines = []
    for axis, unit in (("size", "M parameters per layer"), ("time", "ms forward per layer")):
        points = []
        for key, entry in data.items():
            size, forward = key.split("/f")
            if entry["dp_minus_nodp_ms"] is None or entry["nodp_ms"] is None or entry["dp_ms"] is None:
                continue
            if axis == "size" and float(forward) == 5.0:
                points.append((float(size.rstrip("M")), entry))
            elif axis == "time" and float(size.rstrip("M")) == B_SIZE / 1e6 and float(forward) > 0:
                points.append((float(forward), entry))
        points.sort(key=lambda p: p[0])
        if len(points) < 2:
            continue
        met = [x for x, e in points if e["dp_cost"] is not None and e["dp_cost"] <= TARGET_DP_COST]
        extra = Fit.of([(x, e["dp_minus_nodp_ms"]) for x, e in points])
        window = Fit.of([(x, e["nodp_ms"]) for x, e in points])
        assert extra is not None and window is not None
        # cost ≤ t  ⇔  extra(x) ≤ t / (1 − t) · nodp(x), both lines in x
        t = TARGET_DP_COST / (1 - TARGET_DP_COST)
        a, b = extra.intercept - t * window.intercept, extra.slope - t * window.slope
        if b < 0:
            solved = f"from {-a / b:.3g} {unit} up" if -a / b > 0 else "everywhere"
        elif b > 0:
            solved = f"up to {-a / b:.3g} {unit}" if -a / b > 0 else "nowhere (extra time above 7% at every point)"
        else:
            solved = "nowhere" if a > 0 else "everywhere"
        label = "5 ms layers, over parameter size" if axis == "size" else "2M parameters, over layer time"
        lines.append(
            f"- {label}: full_shard's extra time ≈ {extra.intercept:.0f} + {extra.slope:.3g} · x ms, the no-dp step ≈"
            f" {window.intercept:.0f} + {window.slope:.3g} · x ms (x in {unit}); dp cost ≤ 7% {solved}; measured"
            f" ≤ 7% at: {', '.join(f'{x:g}' for x in met) or 'none of the points'}."
        )
    return lines


def ceiling_section(measured: dict[str, Measured], comm: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    at = {
        impl: measured.get(shard_name(B_SIZE, 5.0, impl)) for impl in ("bfpp", "nodp", "LoopedBFS", "LoopedBFS_reshard")
    }
    steps = {impl: m.step for impl, m in at.items() if m is not None and m.step}
    if len(steps) < len(at) or not comm:
        return ["Not measured in this run.", ""], {}
    gathers = {impl: at[impl].row.gathers_per_step or 0.0 for impl in ("bfpp", "LoopedBFS", "LoopedBFS_reshard")}  # type: ignore[union-attr]
    extra = gathers["LoopedBFS_reshard"] - gathers["LoopedBFS"]
    costs = {"alone": comm["gather_ms"]}  # one gather's cost: measured alone, and inside LoopedBFS's steps
    if extra:
        costs["in a step"] = (steps["LoopedBFS_reshard"] - steps["LoopedBFS"]) / extra
    ours = steps["bfpp"]
    data: dict[str, Any] = {"gathers": gathers, "per_gather_ms": costs, "measured": {}, "volume": {}}
    lines = [
        f"(iii) Weight gathers per rank and step at (b), as counted in the runs: bfpp {gathers['bfpp']:.0f},"
        f" LoopedBFS (`reshard_after_forward=False`) {gathers['LoopedBFS']:.0f}, LoopedBFS with FSDP2's default"
        f" resharding {gathers['LoopedBFS_reshard']:.0f}; 4 reduce-scatters for all. What volume alone predicts for"
        " LoopedBFS's step over bfpp's, if both exposed their communication alike: `(bfpp step + (peer's gathers −"
        " bfpp's) × one gather) / bfpp step`, one gather costing what it did alone in (i)"
        + (
            f" ({costs['alone']:.1f} ms) or what an extra gather cost inside LoopedBFS's steps (its two settings:"
            f" {steps['LoopedBFS_reshard'] - steps['LoopedBFS']:.0f} ms for {extra:.0f} more gathers,"
            f" {costs['in a step']:.1f} ms each):"
            if "in a step" in costs
            else ":"
        ),
        "",
        "| peer | gathers more than bfpp | predicted by volume: alone / in a step | measured |",
        "|---|---|---|---|",
    ]
    for impl, label in (("LoopedBFS", "`reshard_after_forward=False`"), ("LoopedBFS_reshard", "default resharding")):
        more = gathers[impl] - gathers["bfpp"]
        predicted = {how: (ours + more * cost) / ours for how, cost in costs.items()}
        measured_ratio = steps[impl] / ours
        data["measured"][impl], data["volume"][impl] = measured_ratio, predicted
        shown = " / ".join(f"{x:.2f}×" for x in predicted.values())
        lines.append(f"| LoopedBFS, {label} | {more:+.0f} | {shown} | **{measured_ratio:.2f}×** |")
    free = steps["LoopedBFS_reshard"] / steps["nodp"]
    data["bfpp_communication_free"] = free
    lines += [
        "",
        f"Against `reshard_after_forward=False` LoopedBFS gathers"
        f" {'no more than' if gathers['LoopedBFS'] <= gathers['bfpp'] else 'more than'} bfpp, so"
        f" {'no ratio above 1 can come from volume' if gathers['LoopedBFS'] <= gathers['bfpp'] else 'volume allows'}"
        "; against the default resharding its extra gathers allow about the predicted ratio. Even if"
        f" bfpp hid all of its communication (its step = the no-dp step, {steps['nodp']:.0f} ms) while LoopedBFS"
        f" kept its own, LoopedBFS would take {free:.2f}× bfpp's step; (i) shows that hiding is not possible on"
        " these cores.",
        "",
    ]
    return lines, data


def peers_section(measured: dict[str, Measured]) -> tuple[list[str], dict[str, Any]]:
    """(b) against torch's schedules + FSDP2 over micro-batch counts, each sharding of bfpp beside the peers
    that hold weights as long as it does, and what gather volume predicts for FSDP2's default resharding."""
    table = {m: {impl: measured.get(peer_name(m, impl)) for impl in PEER_IMPLS} for m in PEER_MS}
    if not any(x is not None and x.step for row in table.values() for x in row.values()):
        return [], {}
    data: dict[str, Any] = {}
    lines = [
        f"(iv) (b) with {', '.join(map(str, PEER_MS))} micro-batches, 5 ms layers, every row of a micro-batch count"
        " run side by side: with FSDP2's default resharding torch's schedules gather a stage's weights for every"
        " micro-batch's forward, bfpp once per sweep. And each sharding of bfpp beside the torch schedules that"
        " keep weights as long: `full_shard` releases a stage after each visit, as FSDP2's default does after each"
        " forward; `shard_grad_op` keeps it from its forward to its backward, as `reshard_after_forward=False`"
        " does. × bfpp: median step over bfpp `full_shard`'s at the same micro-batch count (and over bfpp"
        " `shard_grad_op`'s).",
        "",
        "| micro-batches | implementation | weight gathers/step | step ms, median (min–max) | × bfpp full_shard |"
        " × bfpp shard_grad_op | peak MiB/rank |",
        "|---|---|---|---|---|---|---|",
    ]
    volume = []
    for m, row in table.items():
        ours, zero2 = row["bfpp"], row["bfpp_zero2"]
        entry: dict[str, Any] = {}
        for impl, x in row.items():
            if x is None or x.step is None:
                continue
            versus = x.step / ours.step if ours is not None and ours.step else None
            versus2 = x.step / zero2.step if zero2 is not None and zero2.step else None
            entry[impl] = {"step_ms": x.step, "gathers": x.row.gathers_per_step, "x_bfpp": versus,
                           "x_bfpp_zero2": versus2, "peak_mib": x.row.peak_mib}  # fmt: skip
            lines.append(
                f"| {m} | {PEER_IMPLS[impl]['label']} | {_num(x.row.gathers_per_step, 0)} | {_spread(x)} |"
                f" {_num(versus)} | {_num(versus2)} | {_num(x.row.peak_mib, 1)} |"
            )
        data[f"m{m}"] = entry
        mine, lbfs, lbfs_r = (entry.get(k) for k in ("bfpp", "LoopedBFS", "LoopedBFS_reshard"))
        if not (mine and lbfs and lbfs_r and lbfs_r["gathers"] and lbfs["gathers"] is not None):
            continue
        extra = lbfs_r["gathers"] - lbfs["gathers"]
        if not extra:
            continue
        # one gather's cost inside LoopedBFS's steps: its two settings differ only in gathers
        per_gather = (lbfs_r["step_ms"] - lbfs["step_ms"]) / extra
        more = lbfs_r["gathers"] - (mine["gathers"] or 0.0)
        predicted = (mine["step_ms"] + more * per_gather) / mine["step_ms"]
        entry["volume"] = {"per_gather_ms": per_gather, "more_gathers": more, "predicted": predicted}
        volume.append(f"| {m} | {more:+.0f} | {per_gather:.1f} | {predicted:.2f}× | **{lbfs_r['x_bfpp']:.2f}×** |")
    if volume:
        lines += [
            "",
            "LoopedBFS with FSDP2's default resharding against bfpp `full_shard`: what gather volume predicts, `(bfpp"
            " step + (its gathers − bfpp's) × one gather) / bfpp step`, one gather costing what an extra gather cost"
            " inside LoopedBFS's steps at the same micro-batch count (its two settings differ only in gathers):",
            "",
            "| micro-batches | gathers more than bfpp | ms per extra gather | predicted by volume | measured |",
            "|---|---|---|---|---|",
            *volume,
        ]
    lines.append("")
    return lines, data


# -- section 3: the machine -----------------------------------------------------------------------------------


def machine_section(measured: dict[str, Measured], machine: dict[str, Any]) -> list[str]:
    others = [x for m in measured.values() for x in m.others] or [0.0]
    mixed = [name for name, m in measured.items() if not m.quiet and m.others]
    rates = {}
    for name in ("one_before", "two_before", "two_after", "one_after"):
        m = measured.get(f"machine/{name}")
        rates[name] = m.row.samples_per_s if m is not None and m.row.samples_per_s is not None else None
    lines = [
        f"- {platform.node()}, {os.cpu_count()} CPU cores, Python {platform.python_version()},"
        f" torch {torch.__version__}; gloo on 127.0.0.1, one thread per process.",
        f"- Load average (1, 5, 15 min) at the start: {_loads(machine['load_start'])}; at the end:"
        f" {_loads(machine['load_end'])} (it counts this run's own processes too)."
        f" Other processes' CPU while each job ran (all cores' busy time in `/proc/stat` less this run's own):"
        f" {statistics.median(others):.2f} cores on median over the launches, at most {max(others):.2f}; above"
        f" {BUSY:g} cores during {sum(x > BUSY for x in others)} of {len(others)} launches. A disturbed launch was"
        f" run again once the machine was quiet (up to {machine['retries']} times, {machine['reruns']} reruns,"
        f" {machine['waited_s']:.0f} s of waiting in all), and a row's figures come from its job's undisturbed"
        " launches when it has any (column *others' cores*: each launch's, the ones left out in brackets).",
        f"- A 5 ms sleep took {5 + machine['sleep_start_ms']:.2f} ms (median of 40) at the start and"
        f" {5 + machine['sleep_end_ms']:.2f} ms at the end; a 1 ms sleep {1 + machine['sleep1_ms']:.2f} ms.",
    ]
    if mixed:
        lines.append(
            f"- **{len(mixed)} of {len(measured)} jobs had no undisturbed launch** (other work shared the cores during"
            " all of them): their rows are slower and noisier than on an idle machine; compare rows run side by"
            " side, and read the ratios."
        )
    for when in ("before", "after"):
        one, two = rates[f"one_{when}"], rates[f"two_{when}"]
        if one and two:
            lines.append(
                f"- vCPU capacity {when} the pipelined jobs: two independent one-thread processes (the suite's small"
                f" GPT, micro-batch {configs.GPT_MICROBATCH}) trained {two.median:.0f} samples/s against one's"
                f" {one.median:.0f}: **{two.median / one.median:.2f}×** one process (min–max"
                f" {two.min / one.max:.2f}–{two.max / one.min:.2f})."
            )
    return lines


class Quiet:
    """Keeps other work's share out of the figures: a launch during which other processes kept more than
    ``BUSY`` cores busy is run again once the machine is quiet, at most ``retries`` times per launch and within
    ``budget_s`` seconds of waiting in all. Every attempt is kept, with the cores others took meanwhile; the
    report uses a job's undisturbed launches when it has any (see :func:`measured_rows`)."""

    def __init__(self, retries: int, budget_s: float) -> None:
        self.retries = retries
        self.budget_s = budget_s
        self.waited_s = 0.0
        self.reruns = 0

    def launch(self, job: Job, folder: Path) -> list[tuple[list[dict[str, Any]], float]]:
        """Every attempt at ``job``: its records and the cores other work kept busy meanwhile."""
        attempts = [self._measured(job, folder / "try0")]
        while attempts[-1][1] > BUSY and len(attempts) <= self.retries and self._wait():
            self.reruns += 1
            attempts.append(self._measured(job, folder / f"try{len(attempts)}"))
        return attempts

    def _measured(self, job: Job, folder: Path) -> tuple[list[dict[str, Any]], float]:
        start, busy, own = time.monotonic(), _busy_s(), _own_s()
        records = launch.launch(job, folder)
        wall = time.monotonic() - start
        if job.kind == "bfpp" and job.trace and records and "error" not in records[0]:
            # the timelines BFPPStrategy(trace=...) wrote for the timed steps, kept with the launch's records
            files = [Path(job.trace) / f"step{job.warmup + k + 1:05d}.spans.json" for k in range(job.steps)]
            records[0]["lightning_spans"] = [json.loads(f.read_text()) for f in files if f.exists()]
        return records, max(0.0, (_busy_s() - busy - (_own_s() - own)) / wall)

    def _wait(self) -> bool:
        """Wait (1 s windows) until other work keeps under ``BUSY`` cores busy; False once the budget is spent."""
        while self.waited_s < self.budget_s:
            start, busy = time.monotonic(), _busy_s()
            time.sleep(1.0)
            wall = time.monotonic() - start
            self.waited_s += wall
            if (_busy_s() - busy) / wall < BUSY:  # this process sleeps, and no job runs: all of it is others'
                return True
        return False


# -- the run --------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--quick", action="store_true", help="fewer layer times, one round (about 6 minutes)")
    mode.add_argument("--full", action="store_true", help="every point, three interleaved rounds")
    mode.add_argument("--report", action="store_true", help=f"only write the report again from {RUN_FILE}")
    parser.add_argument("--only", help="comma-separated job-name prefixes, e.g. 'host/p4,trace' (a partial run)")
    parser.add_argument(
        "--merge", action="store_true",
        help="with --only: add the selected jobs' launches to the last run of the same mode and report both",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, help="where limits.md/json go (default: docs/benchmarks)")
    parser.add_argument("--retries", type=int, default=2, help="reruns of a launch other work disturbed (default 2)")
    parser.add_argument(
        "--wait", type=float, help="seconds in all to wait for a quiet machine before reruns (default: 300, --full 900)"
    )
    args = parser.parse_args()
    if args.report:
        run = json.loads(RUN_FILE.read_text())
    elif args.merge:
        run = json.loads(RUN_FILE.read_text())
        if not args.only or run["full"] != bool(args.full):
            parser.error("--merge adds --only's jobs to the last run of the same mode (--quick or --full)")
        added = measure(args)
        run["attempts"].update(added["attempts"])
        jobs = sorted(added["attempts"])
        # a merge whose every job this one measured again no longer contributes a row
        kept = [m for m in run.get("merged", []) if not set(m.get("jobs", [""])) <= set(jobs)]
        run["merged"] = [*kept, {**{k: added[k] for k in ("command", "date", "elapsed_s", "machine")}, "jobs": jobs}]
        RUN_FILE.write_text(json.dumps(run))
    else:
        run = measure(args)
        RUN_FILE.parent.mkdir(parents=True, exist_ok=True)
        RUN_FILE.write_text(json.dumps(run))
    out: Path = args.out or (REPO / ("runs/benchmarks" if run["only"] else "docs/benchmarks"))
    write_report(run, out)
    print(f"\nwrote {out / 'limits.md'} and limits.json")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run every selected job, ``rounds`` times interleaved; everything the report needs, as JSON."""
    points = FULL if args.full else QUICK
    selected = [j for j in jobs(points) if not args.only or any(j.name.startswith(p) for p in args.only.split(","))]
    machine: dict[str, Any] = {
        "load_start": os.getloadavg(),
        "sleep_start_ms": _sleep_overshoot_ms(5.0),
        "sleep1_ms": _sleep_overshoot_ms(1.0),
    }
    quiet = Quiet(args.retries, args.wait if args.wait is not None else 900.0 if args.full else 300.0)
    started = time.monotonic()
    attempts: dict[str, list[list[tuple[list[dict[str, Any]], float]]]] = {j.name: [] for j in selected}
    for round_index in range(points.rounds):
        for job in selected:
            tries = quiet.launch(job, RAW / "raw" / job.name.replace("/", "_") / f"round{round_index}")
            attempts[job.name].append(tries)
            status = next((r["error"] for r in tries[-1][0] if "error" in r), "ok")
            busy = " ".join(f"{b:4.2f}" for _, b in tries)
            print(f"[{time.monotonic() - started:6.1f}s] others' cores {busy:<14} {job.name:<36} {status}", flush=True)
    machine.update(load_end=os.getloadavg(), sleep_end_ms=_sleep_overshoot_ms(5.0), reruns=quiet.reruns,
                   waited_s=quiet.waited_s, retries=quiet.retries, cores=os.cpu_count())  # fmt: skip
    return {
        "command": "python -m benchmarks.limits " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "elapsed_s": time.monotonic() - started,
        "full": bool(args.full),
        "only": args.only,
        "machine": machine,
        "attempts": attempts,
    }


def measured_rows(run: dict[str, Any], points: Points) -> dict[str, Measured]:
    """Each job's row from its undisturbed launches (others kept at most ``BUSY`` cores busy), or from all of
    them when none was; the cores others took during every launch stay in the row."""
    rows = {}
    for job in jobs(points):
        tries_by_round = run["attempts"].get(job.name)
        if tries_by_round is None:
            continue
        every = [attempt for tries in tries_by_round for attempt in tries]
        quiet = [records for records, busy in every if busy <= BUSY and not any("error" in r for r in records)]
        used = quiet or [records for records, _ in every]
        rows[job.name] = Measured(job, report.summarize(job, used), used, cpu_per_step(used),
                                  [busy for _, busy in every], len(quiet))  # fmt: skip
    return rows


def write_report(run: dict[str, Any], out: Path) -> None:
    """``limits.md`` and ``limits.json`` from one run's data."""
    points = FULL if run["full"] else QUICK
    measured = measured_rows(run, points)
    machine = run["machine"]
    host, host_data = host_section(measured, points)
    phases, phase_data = phases_section(measured, points)
    traces, trace_data = trace_section(measured, RAW / "traces")
    comm, comm_data = comm_section(measured)
    sweep, sweep_data = sweep_section(measured, points)
    ceiling, ceiling_data = ceiling_section(measured, comm_data)
    peers, peers_data = peers_section(measured)
    command, elapsed = run["command"], run["elapsed_s"]
    parts = [
        "# Physical limits of the benchmark machine, and the nearest feasible points",
        "",
        f"Made by `{command}` on {run['date']}, in {elapsed / 60:.1f} minutes; every figure below comes from this"
        f" one run ({points.rounds} round{'s' if points.rounds > 1 else ''} of {points.steps} timed steps after"
        f" {points.warmup} warm-up steps per job; medians over steps and launches, min–max in brackets). Raw"
        f" records, Chrome traces and PNG timelines: `{RAW.relative_to(REPO)}`.",
        *[
            f"Added to it by `{m['command']}` on {m['date']} ({m['elapsed_s'] / 60:.1f} minutes; load average"
            f" {_loads(m['machine']['load_start'])} at its start): the rows it measured."
            for m in run.get("merged", [])
        ],
        "",
        "## The machine",
        "",
        *machine_section(measured, machine),
        "",
        "## 1. Host cost of the schedule, (a)",
        "",
        "The emulated layers of (a) (16 layers, 64 KiB of weights, 16 KiB activations per sample) with forward"
        " time f and backward 2f per layer and micro-batch, f = 0 included: at f = 0 the step is the"
        " implementation's own host and communication cost per step.",
        "",
        *host,
        "### Where the step's time goes outside the schedule",
        "",
        *phases,
        "### Where a step of (a) waits: traces",
        "",
        *traces,
        "## 2. Sharded communication, (b)",
        "",
        *comm,
        *sweep,
        *ceiling,
        *peers,
    ]
    out.mkdir(parents=True, exist_ok=True)
    (out / "limits.md").write_text("\n".join(parts))
    payload = {
        "command": command, "date": run["date"], "elapsed_s": elapsed, "points": asdict(points), "machine": machine,
        "host": host_data, "phases": phase_data, "traces": trace_data, "comm": comm_data, "sweep": sweep_data,
        "ceiling": ceiling_data, "peers": peers_data,
        "rows": [{**asdict(m.row), "cpu_ms": asdict(m.cpu_ms) if m.cpu_ms else None, "others_cores": m.others,
                  "quiet_launches": m.quiet} for m in measured.values()],
    }  # fmt: skip
    (out / "limits.json").write_text(json.dumps(payload, indent=1, default=str))


def _others(m: Measured) -> str:
    """The cores others took during each launch; in brackets the disturbed ones left out of the row."""
    shown = [f"{x:.2f}" if x <= BUSY or not m.quiet else f"({x:.2f})" for x in m.others]
    return " ".join(shown)


def _busy_s() -> float:
    """All cores' busy time since boot (user, nice and system time in ``/proc/stat``), in seconds."""
    with open("/proc/stat") as f:
        user, nice, system = (int(x) for x in f.readline().split()[1:4])
    return (user + nice + system) / os.sysconf("SC_CLK_TCK")


def _own_s() -> float:
    """The CPU time of this process and of its children that have ended (every job's processes, once joined)."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def _loads(values: Iterable[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in values)


def _spread(m: Measured | None) -> str:
    return m.row.step_ms.text() if m is not None and m.row.step_ms is not None else "–"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.0%}"


def _num(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


if __name__ == "__main__":
    main()
