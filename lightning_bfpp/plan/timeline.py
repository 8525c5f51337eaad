"""Timelines of pipeline steps: spans per rank, written as Chrome traces and PNGs, and summarised. Pure.

A :class:`Span` is one thing one rank did for a while: a stage's forward or backward of a micro-batch,
waiting for a neighbour's activations or gradients, waiting for a stage's weights to be gathered, reducing
gradients, the optimizer step. Measured timelines (:mod:`lightning_bfpp.engine.trace`) and predicted ones
(:mod:`lightning_bfpp.plan.simulate`) use the same spans, so both are drawn and summarised the same way.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

COMPUTE = ("forward", "backward")
PIPELINE_WAIT = "p2p_wait"
# waiting for other pipeline ranks: for activations/gradients, and at the step's end for the last to finish
PIPELINE_WAITS = (PIPELINE_WAIT, "step_sync")
# data-parallel communication the rank waited for (not what ran beside compute): weights it had to wait to
# be gathered, and gradient reductions that held it up
DATA_PARALLEL = ("gather_wait", "reduce", "reduce_wait")
# lanes of a rank's row in the Chrome trace ("send_wait": a send's retirement, torch ≥ 2.15; the time it blocked
# is its p2p_wait inside it)
_LANES = {"forward": 0, "backward": 0, "p2p_wait": 1, "step_sync": 1, "send": 1, "recv": 1, "send_wait": 1,
          "gather": 2, "gather_wait": 2, "reduce": 2, "reduce_wait": 2, "reshard": 2, "optimizer": 3}  # fmt: skip
_LANE_NAMES = {0: "compute", 1: "pipeline p2p", 2: "data parallel", 3: "optimizer"}


@dataclass(frozen=True)
class Span:
    """``kind`` on ``rank`` from ``start`` to ``end`` seconds (relative to the step's start)."""

    rank: int
    kind: str
    start: float
    end: float
    stage: int | None = None
    microbatch: int | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def label(self) -> str:
        if self.kind in COMPUTE:
            return f"{self.stage}{'F' if self.kind == 'forward' else 'B'}{self.microbatch}"
        if self.stage is not None:
            return f"{self.kind} {self.stage}" + ("" if self.microbatch is None else f" mb{self.microbatch}")
        return self.kind


@dataclass(frozen=True)
class RankSummary:
    rank: int
    step_time: float
    compute: float
    pipeline_wait: float
    data_parallel: float
    optimizer: float

    @property
    def busy_fraction(self) -> float:
        return self.compute / self.step_time if self.step_time else 0.0

    @property
    def bubble_fraction(self) -> float:
        """Time spent waiting for other pipeline stages, as a fraction of the step."""
        return self.pipeline_wait / self.step_time if self.step_time else 0.0


def summarize(spans: Iterable[Span]) -> list[RankSummary]:
    by_rank: dict[int, list[Span]] = defaultdict(list)
    for span in spans:
        by_rank[span.rank].append(span)
    summaries = []
    for rank in sorted(by_rank):
        rank_spans = by_rank[rank]
        total = max(s.end for s in rank_spans) - min(0.0, *(s.start for s in rank_spans))

        def time_in(kinds: Sequence[str], rank_spans: list[Span] = rank_spans) -> float:
            return sum(s.duration for s in rank_spans if s.kind in kinds)

        summaries.append(
            RankSummary(
                rank=rank,
                step_time=total,
                compute=time_in(COMPUTE),
                pipeline_wait=time_in(PIPELINE_WAITS),
                data_parallel=time_in(DATA_PARALLEL),
                optimizer=time_in(("optimizer",)),
            )
        )
    return summaries


def format_summary(summaries: Sequence[RankSummary]) -> str:
    lines = [
        "| rank | step (ms) | busy | bubble (waiting for stages) | exposed data-parallel comm | optimizer (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for s in summaries:
        exposed = s.data_parallel / s.step_time if s.step_time else 0.0
        lines.append(
            f"| {s.rank} | {1e3 * s.step_time:.1f} | {s.busy_fraction:.1%} | {s.bubble_fraction:.1%} |"
            f" {1e3 * s.data_parallel:.1f} ms ({exposed:.1%}) | {1e3 * s.optimizer:.1f} |"
        )
    return "\n".join(lines)


def chrome_trace(spans: Iterable[Span], title: str = "") -> dict[str, Any]:
    """A Chrome trace (the JSON Perfetto and chrome://tracing open): one process per rank, one thread per lane."""
    events: list[dict[str, Any]] = []
    ranks = set()
    for span in spans:
        ranks.add(span.rank)
        events.append(
            {
                "name": span.label,
                "cat": span.kind,
                "ph": "X",
                "ts": span.start * 1e6,
                "dur": max(span.duration * 1e6, 0.001),
                "pid": span.rank,
                "tid": _LANES.get(span.kind, 4),
                "args": {"stage": span.stage, "microbatch": span.microbatch},
            }
        )
    for rank in sorted(ranks):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
        for lane, name in _LANE_NAMES.items():
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": lane, "args": {"name": name}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"title": title}}


def write_chrome_trace(spans: Iterable[Span], path: Path, title: str = "") -> None:
    path.write_text(json.dumps(chrome_trace(spans, title)))


def write_spans(spans: Iterable[Span], path: Path) -> None:
    path.write_text(json.dumps([asdict(s) for s in spans]))


def read_spans(path: Path) -> list[Span]:
    return [Span(**record) for record in json.loads(path.read_text())]


def draw(spans: Sequence[Span], path: Path, title: str = "") -> None:
    """Draw the timeline as a PNG, one row per rank, compute coloured by stage (as the paper draws schedules).

    Renders on a standalone Agg figure: no pyplot, so no global backend switch or figure registry in the
    user's process. matplotlib is a dependency of the package (imported here, on first use, to keep
    ``import lightning_bfpp`` light).
    """
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    ranks = sorted({s.rank for s in spans})
    stages = sorted({s.stage for s in spans if s.kind in COMPUTE and s.stage is not None})
    colors = colormaps["tab20" if len(stages) > 10 else "tab10"]
    color_of = {stage: colors(i % colors.N) for i, stage in enumerate(stages)}
    end = max((s.end for s in spans), default=1.0)
    fig = Figure(figsize=(min(24, 6 + 0.02 * len(spans)), 0.9 + 0.75 * len(ranks)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for row, rank in enumerate(ranks):
        y = len(ranks) - 1 - row
        for s in (s for s in spans if s.rank == rank):
            start, width = 1e3 * s.start, 1e3 * s.duration
            if s.kind in COMPUTE:
                forward = s.kind == "forward"
                ax.broken_barh([(start, width)], (y - 0.35, 0.5), facecolors=color_of[s.stage],
                               alpha=0.55 if forward else 1.0, edgecolor="black", linewidth=0.3)  # fmt: skip
                if width > end * 1e3 / 120:
                    ax.text(start + width / 2, y - 0.1, s.label, ha="center", va="center", fontsize=6)
            elif s.kind in PIPELINE_WAITS:
                ax.broken_barh([(start, width)], (y + 0.17, 0.08), facecolors="0.6")
            elif s.kind in ("gather_wait", "reduce", "reduce_wait", "gather"):
                ax.broken_barh(
                    [(start, width)], (y + 0.27, 0.08), facecolors="tab:red" if s.kind == "reduce" else "orange"
                )
            elif s.kind == "optimizer":
                ax.broken_barh([(start, width)], (y - 0.35, 0.5), facecolors="0.2")
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in reversed(ranks)])
    ax.set_xlabel("time (ms)")
    ax.set_xlim(0, 1e3 * end * 1.01)
    ax.set_title(title, fontsize=9)
    legend = [Patch(facecolor=color_of[s], label=f"stage {s}") for s in stages[:12]]
    legend += [
        Patch(facecolor="0.6", label="waiting for a neighbour"),
        Patch(facecolor="orange", label="weight gather"),
        Patch(facecolor="tab:red", label="gradient reduction"),
        Patch(facecolor="0.2", label="optimizer"),
    ]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=8, fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
