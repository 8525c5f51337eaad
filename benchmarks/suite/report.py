"""From per-rank records to one row per job, a Markdown report and a PNG figure.

Definitions (per job, over its timed steps; the first ``warmup`` steps, which infer shapes and build
schedules, are dropped):

- step time: rank 0's interval between consecutive step starts (the optimizer and data loading included),
  min / median / max over the timed steps of all launches of the job;
- efficiency: the analytic bound (:func:`benchmarks.suite.spec.bound_s`) over the median step;
- bubble: time waiting for pipeline neighbours' activations and gradients, as a share of the step (the
  median over steps, the mean over ranks); exposed communication: time blocked in collectives (which
  includes waiting there for slower ranks) or waiting for a weight gather, likewise; busy: time the emulated
  layers slept, likewise, and their overrun: slept over nominal time, minus one;
- collectives and point-to-point sends: per rank and step, mean over ranks;
- peak memory: live host memory (malloc's) during the warm-up steps after the first, above its level before the
  first step, largest rank (read there only: reading it in the timed steps would lengthen them).
"""

from __future__ import annotations

import itertools
import statistics
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from benchmarks.suite.spec import Job, bound_s

MIB = 1024 * 1024
LABEL_WIDTH = 48  # characters per line of a bar's label: long labels would squeeze their panel


@dataclass
class Spread:
    min: float
    median: float
    max: float

    @staticmethod
    def of(values: list[float]) -> Spread:
        return Spread(min(values), statistics.median(values), max(values))

    def scaled(self, factor: float) -> Spread:
        return Spread(self.min * factor, self.median * factor, self.max * factor)

    def inverse(self, numerator: float) -> Spread:
        """``numerator / x`` of each value (a throughput from step times): min and max swap."""
        return Spread(numerator / self.max, numerator / self.median, numerator / self.min)

    def text(self, digits: int = 0) -> str:
        return f"{self.median:.{digits}f} ({self.min:.{digits}f}–{self.max:.{digits}f})"


@dataclass
class Row:
    """One job's results, as the report and ``results.json`` carry them."""

    name: str
    group: str
    label: str
    layout: str
    processes: int
    global_rows: int
    launches: int = 0
    step_ms: Spread | None = None
    launch_step_ms: list[float] = field(default_factory=list)  # each successful launch's median step, in order
    samples_per_s: Spread | None = None
    bound_ms: float | None = None
    efficiency: float | None = None
    ratio_to_reference: float | None = None  # step time over the group's bfpp row (same global batch)
    bubble: float | None = None
    exposed_comm: float | None = None
    busy: float | None = None
    sleep_overrun: float | None = None  # emulated layers' slept time over their nominal time, minus one
    collectives_per_step: float | None = None
    collective_mib_per_step: float | None = None
    gathers_per_step: float | None = None
    reduce_scatters_per_step: float | None = None
    collectives_by_name_per_step: dict[str, float] = field(default_factory=dict)
    p2p_sends_per_step: float | None = None
    p2p_mib_per_step: float | None = None
    peak_mib: float | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.step_ms is not None


def summarize(job: Job, launches: list[list[dict[str, Any]]]) -> Row:
    """Pool the timed steps of every successful launch of ``job`` into one row."""
    row = Row(job.name, job.group, job.label, job.layout, job.processes, job.global_rows)
    steps: list[float] = []
    throughputs: list[float] = []
    shares: dict[str, list[float]] = {k: [] for k in ("bubble", "exposed", "busy")}
    slept = nominal = 0.0
    per_step: dict[str, list[float]] = {
        k: [] for k in ("collectives", "collective_bytes", "gathers", "reduce_scatters", "p2p_sends", "p2p_send_bytes")
    }
    by_name: list[dict[str, float]] = []  # per rank and launch
    peaks: list[float] = []
    for records in launches:
        failed = [r["error"] for r in records if "error" in r]
        if failed:
            row.errors.append(failed[0])
            continue
        row.launches += 1
        intervals = [_intervals(r) for r in records]
        # rank 0's steps; ranks that never wait for each other (stage_compute) take as long as the slower one
        launch_steps = [max(t) for t in zip(*intervals, strict=True)] if job.kind == "stage_compute" else intervals[0]
        steps += launch_steps
        row.launch_step_ms.append(1e3 * statistics.median(launch_steps))
        if job.kind == "independent":  # every process trains on its own: throughputs add up
            throughputs += [sum(job.microbatch_size / ivs[i] for ivs in intervals) for i in range(len(launch_steps))]
        else:
            throughputs += [job.global_rows / s for s in launch_steps]
        for record in records:
            timed = record["marks"][record["warmup"] :]
            first, last = timed[0], timed[-1]
            count = len(timed) - 1
            for key, share in (("bubble", _p2p_wait), ("exposed", _exposed), ("busy", _busy)):
                # the median step's share: robust to the odd step another process on the machine slowed down
                per_step_share = [(share(b) - share(a)) / (b["t"] - a["t"]) for a, b in itertools.pairwise(timed)]
                shares[key].append(statistics.median(per_step_share))
            slept += last["compute_s"] - first["compute_s"]
            nominal += last["nominal_s"] - first["nominal_s"]
            for key, values in per_step.items():
                values.append((last[key] - first[key]) / count)
            by_name.append({n: (total - first["by_name"].get(n, 0)) / count for n, total in last["by_name"].items()})
            if record["memory"]["step_peak_mib"] is not None:
                peaks.append(record["memory"]["step_peak_mib"])
    if not steps:
        return row
    row.step_ms = Spread.of(steps).scaled(1e3)
    row.samples_per_s = Spread.of(throughputs)
    bound = bound_s(job)
    if bound is not None:
        row.bound_ms = 1e3 * bound
        row.efficiency = row.bound_ms / row.step_ms.median
        row.busy = statistics.fmean(shares["busy"])
        row.sleep_overrun = slept / nominal - 1 if nominal else None
    row.bubble = statistics.fmean(shares["bubble"])
    row.exposed_comm = statistics.fmean(shares["exposed"])
    row.collectives_per_step = statistics.fmean(per_step["collectives"])
    row.collective_mib_per_step = statistics.fmean(per_step["collective_bytes"]) / MIB
    row.gathers_per_step = statistics.fmean(per_step["gathers"])
    row.reduce_scatters_per_step = statistics.fmean(per_step["reduce_scatters"])
    names = sorted({name for counts in by_name for name, n in counts.items() if n})
    row.collectives_by_name_per_step = {n: statistics.fmean(c.get(n, 0.0) for c in by_name) for n in names}
    row.p2p_sends_per_step = statistics.fmean(per_step["p2p_sends"])
    row.p2p_mib_per_step = statistics.fmean(per_step["p2p_send_bytes"]) / MIB
    row.peak_mib = max(peaks) if peaks else None
    return row


def _p2p_wait(mark: dict[str, float]) -> float:
    return mark["p2p_wait_s"]


def _exposed(mark: dict[str, float]) -> float:
    return mark["collective_s"] + mark["gather_wait_s"]


def _busy(mark: dict[str, float]) -> float:
    return mark["compute_s"]


def _intervals(record: dict[str, Any]) -> list[float]:
    times = [mark["t"] for mark in record["marks"][record["warmup"] :]]
    return [b - a for a, b in itertools.pairwise(times)]


def add_ratios(rows: list[Row], jobs: dict[str, Job]) -> None:
    """Each row's median step over its group's reference (bfpp) row that trains the same global batch (a group may
    hold several settings, each with its own reference, told apart by their global batches)."""
    references = {(r.group, r.global_rows): r for r in rows if jobs[r.name].reference and r.ok}
    for row in rows:
        ref = references.get((row.group, row.global_rows))
        if ref is not None and row.ok and row.step_ms and ref.step_ms:
            row.ratio_to_reference = row.step_ms.median / ref.step_ms.median


def to_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]


def from_json(items: list[dict[str, Any]]) -> list[Row]:
    """The rows :func:`to_json` wrote (``results.json``), to draw them again."""
    spreads = ("step_ms", "samples_per_s")
    return [Row(**{k: Spread(**v) if k in spreads and v is not None else v for k, v in item.items()}) for item in items]


# -- Markdown -------------------------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:.0%}"


def _signed_pct(x: float | None) -> str:
    return "" if x is None else f"{x:+.1%}"


def _num(x: float | None, digits: int = 2) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def pipeline_table(rows: list[Row]) -> str:
    """The emulated-accelerator configurations: one line per job."""
    lines = [
        "| config | implementation | layout | step ms, median (min–max) | × bfpp | bound ms | efficiency | busy"
        " (sleep overrun) | bubble | exposed comm | collectives/step (weight gathers, reduce-scatters) |"
        " coll. MiB/step"
        " | p2p sends/step (MiB) | peak MiB/rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r.group} | {r.label} | {r.layout} |"
        if not r.ok:
            lines.append(head + f" failed: {_one_line(r.errors)} |" + " |" * 10)
            continue
        assert r.step_ms is not None
        lines.append(
            head + f" {r.step_ms.text()} | {_num(r.ratio_to_reference)} | {_num(r.bound_ms, 0)} |"
            f" {_num(r.efficiency)} | {_pct(r.busy)} ({_signed_pct(r.sleep_overrun)}) | {_pct(r.bubble)} |"
            f" {_pct(r.exposed_comm)} |"
            f" {_num(r.collectives_per_step, 1)} ({_num(r.gathers_per_step, 1)},"
            f" {_num(r.reduce_scatters_per_step, 1)}) |"
            f" {_num(r.collective_mib_per_step, 1)} | {_num(r.p2p_sends_per_step, 1)} ({_num(r.p2p_mib_per_step, 2)}) |"
            f" {_num(r.peak_mib, 1)} |"
        )
    return "\n".join(lines)


def throughput_table(rows: list[Row], capacity: Row | None) -> str:
    """The real-compute configurations: samples per second, against the machine's measured capacity."""
    lines = [
        "| implementation | layout | samples/s, median (min–max) | × two-process capacity | step ms, median"
        " (min–max) | exposed comm | bubble | collectives/step | peak MiB/rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r.label} | {r.layout} |"
        if not r.ok:
            lines.append(head + f" failed: {_one_line(r.errors)} |" + " |" * 6)
            continue
        assert r.samples_per_s is not None and r.step_ms is not None
        vs = ""
        if capacity is not None and capacity.samples_per_s is not None:
            vs = _num(r.samples_per_s.median / capacity.samples_per_s.median)
        lines.append(
            head + f" {r.samples_per_s.text(1)} | {vs} | {r.step_ms.text(1)} | {_pct(r.exposed_comm)} |"
            f" {_pct(r.bubble)} | {_num(r.collectives_per_step, 1)} | {_num(r.peak_mib, 1)} |"
        )
    return "\n".join(lines)


def _one_line(errors: list[str]) -> str:
    text = errors[0] if errors else "no record"
    return text.replace("|", "/")[:160]


# -- figure ---------------------------------------------------------------------------------------------------


def plot(rows: list[Row], path: Path, titles: dict[str, str], title: str, reference_line: float | None = None) -> None:
    """One panel per configuration: median step (bars, min–max whiskers) against the analytic bound (dashes);
    for real compute, samples per second, with ``reference_line`` (the measured capacity) dotted. Drawn without
    pyplot, so nothing global is touched and no display is needed."""
    groups = [g for g in titles if any(r.group == g and r.ok for r in rows)]
    if not groups:
        return
    most = max(sum(1 for r in rows if r.group == g and r.ok) for g in groups)
    figure = Figure(figsize=(6.5 * len(groups), max(4.8, 0.55 * most + 1.0)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(groups), squeeze=False)[0]
    for ax, group in zip(axes, groups, strict=True):
        members = [r for r in rows if r.group == group and r.ok]
        throughput = all(r.bound_ms is None for r in members)
        spreads = [r.samples_per_s if throughput else r.step_ms for r in members]
        values = [s.median for s in spreads if s is not None]
        low = [s.median - s.min for s in spreads if s is not None]
        high = [s.max - s.median for s in spreads if s is not None]
        y = list(range(len(members)))
        colors = ["tab:blue" if r.label.startswith("bfpp") else "tab:gray" for r in members]
        ax.barh(y, values, xerr=[low, high], color=colors, capsize=3)
        labels = [f"{textwrap.fill(r.label, LABEL_WIDTH)}\n{r.layout}" for r in members]
        ax.set_yticks(y, labels, fontsize=7)
        ax.invert_yaxis()
        for i, (r, spread) in enumerate(zip(members, spreads, strict=True)):
            if r.bound_ms is not None:
                ax.plot([r.bound_ms, r.bound_ms], [i - 0.4, i + 0.4], color="black", linestyle="--", linewidth=1)
            if r.efficiency is not None and spread is not None:
                ax.text(spread.max, i, f"  {r.efficiency:.2f} of bound", va="center", fontsize=7)
        if reference_line is not None and throughput:
            ax.axvline(reference_line, color="tab:orange", linestyle=":", linewidth=1.2)
        ax.set_xlabel(
            "samples/s (median, min–max); dots: capacity"
            if throughput
            else "step ms (median, min–max); dashes: analytic bound"
        )
        ax.set_title(titles[group], fontsize=9)
    figure.suptitle(title, fontsize=10)
    figure.savefig(path, dpi=110)
