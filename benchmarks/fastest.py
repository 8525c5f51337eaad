"""The fastest layout at every point: what ``schedule="auto"`` picks, against each of torch's schedules.

    python -m benchmarks.fastest    # all 24 points, all torch schedules, four interleaved rounds (hours on 2 cores)
    python -m benchmarks.fastest --points split_p4_m4_dp1 --rounds 3
    python -m benchmarks.fastest --points whole_p4_m16_dp2 --torch LoopedBFS_v4,Interleaved1F1B_v2

A point is a job: 16 emulated layers (5 ms forward; a backward of 5 ms input gradient + 5 ms weight gradient in two
autograd nodes, "split", or of 10 ms in one, "whole"), ``p`` ∈ {2, 4} pipeline ranks, ``m`` ∈ {p, 2p, 4p}
micro-batches of one sample, and either no data parallelism (64 KiB of weights per layer) or ``full_shard`` over
dp=2 (3.8 MiB per layer, so that gathers matter). At each point, one after the other in rounds:

- ``auto``: ``BFPPStrategy(pipeline_parallel_size=p, schedule="auto", stages_per_rank="auto", num_microbatches=m,
  cluster=...)`` through Lightning: the planner measures the layers on rank 0 and chooses among every registered
  schedule and stages per rank, on this machine as ``python -m lightning_bfpp.plan calibrate`` measured it
  (calibrated once per process count at the start, or ``--cluster2/4/8``);
- bfpp's ``breadth_first`` (v=2) through Lightning, the reference the zero-bubble kinds are judged against;
- torch's ``ScheduleGPipe`` and ``Schedule1F1B`` (v=1), ``ScheduleLoopedBFS``, ``ScheduleInterleaved1F1B`` and
  ``ScheduleInterleavedZeroBubble`` (v=2 and v=4) and ``ScheduleZBVZeroBubble`` (v=2), driven by hand over the same
  stages, with FSDP2 (``fully_shard(stage, reshard_after_forward=False)``) where sharded, by a loop that after each
  step's backward all-reduces the gradients' norm over every rank (what clipping by the model's norm issues,
  torchtitan's default): a training loop's one collective per step, which ends every rank's step together, as
  ``BFPPStrategy``'s shared step does. (Without it a rank starts its next step while another still drains this
  one, an overlap of consecutive steps that a loop which logs or clips does not have: at p=2 m=4 with ZB-V it
  hid 5% of the step.)

Every job's processes reuse the memory they free, as an accelerator's caching allocator does
(:func:`benchmarks.suite.launch.keep_freed_memory`), and the calibration runs with the same settings.

Each launch times 6 steps after 4 warm-up steps (every implementation's steps still settle over the first five);
a job's step is the median of its launches' medians, and the table gives, beside ``auto`` over the fastest torch
schedule, that ratio round by round: its spread is what the machine's drift alone does to it.

Writes ``runs/fastest/results.json`` and prints the table (``docs/benchmarks/planner.md`` holds runs' tables), with
the bound: the fastest of every order considered (bfpp's kinds, which include torch's orders) with free
communication and no host cost, from the simulator on the layers' nominal times.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.suite import launch
from benchmarks.suite.report import summarize
from benchmarks.suite.spec import Emulated, Job
from lightning_bfpp.plan import Cluster, LayerCost, ModelProfile, Plan, get_schedule, schedule_names, simulate

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "runs" / "fastest"
TORCH_JOBS = [("GPipe", 1), ("1F1B", 1)] + [
    (name, v) for name in ("LoopedBFS", "Interleaved1F1B", "InterleavedZeroBubble") for v in (2, 4)
] + [("ZBVZeroBubble", 2)]  # fmt: skip
TOLERANCE = 1.03  # auto's step may be at most this over the fastest torch schedule's


@dataclass(frozen=True)
class Point:
    split: bool
    p: int
    m: int
    dp: int

    @property
    def name(self) -> str:
        return f"{'split' if self.split else 'whole'}_p{self.p}_m{self.m}_dp{self.dp}"

    @property
    def emulated(self) -> Emulated:
        param_numel = 16_384 if self.dp == 1 else 1_000_000
        if self.split:
            return Emulated(16, 5.0, 5.0, param_numel, 4096, weight_grad_ms=5.0)
        return Emulated(16, 5.0, 10.0, param_numel, 4096)

    def nominal_profile(self) -> ModelProfile:
        """The emulated layers at their nominal times, as the simulator takes them (a whole backward runs whole in
        both passes of a split one, as torch's runtime runs it)."""
        e = self.emulated
        i = e.backward_ms / 1e3
        w = e.weight_grad_ms / 1e3 if e.weight_grad_ms else i  # one node: the weight pass runs it again
        layer = LayerCost(e.forward_ms / 1e3, (e.backward_ms + (e.weight_grad_ms or 0.0)) / 1e3, 4 * e.param_numel,
                          4 * e.activation_numel, 0, backward_weight_s=w, backward_input_s=i)  # fmt: skip
        return ModelProfile(tuple([layer] * e.layers))

    def jobs(self, clusters: dict[int, str], warmup: int, steps: int, torch_jobs: set[str] | None = None) -> list[Job]:
        processes = self.p * self.dp
        common = dict(
            group=self.name, processes=processes, p=self.p, m=self.m, dp=self.dp, emulated=self.emulated,
            warmup=warmup, steps=steps, timeout_s=400.0 if processes > 4 else 240.0,
        )  # fmt: skip
        jobs = [
            Job(f"{self.name}/auto", kind="bfpp", label="bfpp schedule='auto'", schedule="auto", v=0,
                cluster=clusters[processes], reference=True, **common),
            Job(f"{self.name}/bfpp_bf", kind="bfpp", label="bfpp breadth_first", schedule="breadth_first", v=2,
                **common),
        ]  # fmt: skip
        if self.dp > 1:  # auto at the memory torch's jobs hold: every local stage's weights resident all step
            jobs.append(
                Job(f"{self.name}/auto_sgo", kind="bfpp", label="bfpp schedule='auto' shard_grad_op", schedule="auto",
                    v=0, sharding="shard_grad_op", cluster=clusters[processes], **common)
            )  # fmt: skip
        for schedule, v in (
            TORCH_JOBS if torch_jobs is None else [j for j in TORCH_JOBS if f"{j[0]}_v{j[1]}" in torch_jobs]
        ):
            jobs.append(
                Job(f"{self.name}/{schedule}_v{v}", kind="torch", label=f"torch {schedule} v={v}", schedule=schedule,
                    v=v, step_sync=True, **common)
            )  # fmt: skip
        return jobs


POINTS = [Point(split, p, m, dp) for split in (True, False) for p in (2, 4) for m in (p, 2 * p, 4 * p) for dp in (1, 2)]


def bound_ms(point: Point) -> tuple[float, str]:
    """The fastest order's step with free communication and no host cost, and which order: the simulator on the
    layers' nominal times, over every registered pipeline kind at v ∈ {1, 2, 4} (they include torch's orders; a
    whole backward runs whole in both passes of a split one, as torch's runtime runs it)."""
    profile = point.nominal_profile()
    free = Cluster(point.p * point.dp, point.p * point.dp, 2**50, 1e18, 1e18, latency_s=0.0)
    best = (float("inf"), "")
    for name in schedule_names():
        kind = get_schedule(name)
        if kind.runner != "stages":
            continue
        for v in kind.stages_per_rank_choices or (1, 2, 4):
            try:
                step = simulate(Plan(name, point.p, point.dp, v, point.m), profile, free).step_time
            except ValueError:
                continue
            best = min(best, (1e3 * step, f"{name} v={v}"))
    return best


def calibrated(processes: int, given: str | None) -> str:
    """A Cluster JSON for ``processes`` processes on this machine: ``given``, one calibrated earlier, or now."""
    if given:
        return given
    path = OUT / f"cluster{processes}.json"
    if not path.exists():
        OUT.mkdir(parents=True, exist_ok=True)
        # its processes reuse freed memory as the jobs' do (launch.keep_freed_memory)
        env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"} | launch.CACHING_MALLOC_ENV
        cmd = [
            sys.executable,
            "-m",
            "lightning_bfpp.plan",
            "calibrate",
            "--devices",
            str(processes),
            "--out",
            str(path),
        ]
        subprocess.run(cmd, check=True, env=env, cwd=REPO)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", help="comma-separated point names (default: all 24)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--torch", help="comma-separated torch jobs to run, e.g. Interleaved1F1B_v2 (default: all)")
    # steps 3-5 still settle, torch's jobs as bfpp's: torch's ZBV at p=4 m=16 dp=2 stepped 1610, 1558, 1367, 1312,
    # 1263, 1250 ms, then 1197-1259; with 2 warm-up steps the settling reached the timed steps unevenly
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    for n in (2, 4, 8):
        parser.add_argument(f"--cluster{n}", help=f"a Cluster JSON for {n} processes (default: calibrated here)")
    args = parser.parse_args()
    points = POINTS
    if args.points:
        wanted = {p.strip() for p in args.points.split(",")}
        points = [p for p in POINTS if p.name in wanted]
        if not points:
            raise SystemExit(f"no point named {args.points!r}; points are {', '.join(p.name for p in POINTS)}")
    torch_jobs = {t.strip() for t in args.torch.split(",")} if args.torch else None
    unknown = sorted((torch_jobs or set()) - {f"{name}_v{v}" for name, v in TORCH_JOBS})
    if unknown:
        known = ", ".join(f"{name}_v{v}" for name, v in TORCH_JOBS)
        raise SystemExit(f"no torch job named {', '.join(unknown)}; torch jobs are {known}")
    clusters = {n: calibrated(n, getattr(args, f"cluster{n}")) for n in sorted({p.p * p.dp for p in points})}
    started = time.monotonic()
    results = []
    for point in points:
        jobs = point.jobs(clusters, args.warmup, args.steps, torch_jobs)
        launches: dict[str, list[list[dict[str, Any]]]] = {j.name: [] for j in jobs}
        for round_index in range(args.rounds):
            # interleaved, each round in another order: the machine's load drifts, and a slow spell then reaches
            # different jobs in different rounds instead of the same neighbours every time
            order = list(jobs)
            random.Random(f"{point.name}/{round_index}").shuffle(order)
            for job in order:
                t0 = time.monotonic()
                folder = OUT / "raw" / job.name.replace("/", "_") / f"round{round_index}"
                records = launch.launch(job, folder)
                launches[job.name].append(records)
                status = next((r["error"] for r in records if "error" in r), "ok")
                print(f"[{time.monotonic() - started:7.1f}s] {job.name:<40} {time.monotonic() - t0:5.1f}s {status}",
                      flush=True)  # fmt: skip
        results.append(_point_result(point, jobs, launches))
        print(_row(results[-1]), flush=True)
    command = "python -m benchmarks.fastest " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    OUT.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": command,
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "minutes": (time.monotonic() - started) / 60,
        "load_average": os.getloadavg(),
        "points": results,
    }
    (OUT / "results.json").write_text(json.dumps(payload, indent=1))
    print("\n" + table(results))


def _point_result(point: Point, jobs: list[Job], launches: dict[str, list[list[dict[str, Any]]]]) -> dict[str, Any]:
    rows = {j.name.split("/", 1)[1]: summarize(j, launches[j.name]) for j in jobs}
    # each job's median over its launches' medians: one slow launch moves it less than pooling its steps would
    steps = {
        name: (statistics.median(row.launch_step_ms) if row.launch_step_ms else None) for name, row in rows.items()
    }
    spread = {name: [round(x, 1) for x in row.launch_step_ms] for name, row in rows.items()}
    torch_steps = {n: s for n, s in steps.items() if n not in ("auto", "auto_sgo", "bfpp_bf") and s is not None}
    fastest_torch = min(torch_steps, key=torch_steps.__getitem__) if torch_steps else None
    plans = [r.get("plan") for records in launches[f"{point.name}/auto"] for r in records if r.get("plan")]
    sgo = launches.get(f"{point.name}/auto_sgo", [])
    sgo_plans = [r.get("plan") for records in sgo for r in records if r.get("plan")]
    bound, bound_order = bound_ms(point)
    return {
        "point": point.name, "split": point.split, "p": point.p, "m": point.m, "dp": point.dp,
        "steps_ms": steps, "launch_steps_ms": spread, "errors": {n: r.errors for n, r in rows.items() if r.errors},
        "auto_plan": plans[0] if plans else None, "auto_sgo_plan": sgo_plans[0] if sgo_plans else None,
        "fastest_torch": fastest_torch,
        "bound_ms": bound, "bound_order": bound_order,
    }  # fmt: skip


def _ratio(result: dict[str, Any], job: str = "auto") -> float | None:
    auto, fastest = result["steps_ms"].get(job), result["fastest_torch"]
    if auto is None or fastest is None:
        return None
    return auto / result["steps_ms"][fastest]


def _round_ratios(result: dict[str, Any], job: str = "auto") -> list[float]:
    """``job``'s step over the fastest torch schedule's in each round (the two launched minutes apart, in the
    same round): their spread is how far the machine's drift alone moves the ratio."""
    fastest = result["fastest_torch"]
    launches = result.get("launch_steps_ms", {})
    if fastest is None or not launches.get(job) or len(launches[job]) != len(launches.get(fastest, [])):
        return []  # a failed launch leaves the rounds unpaired
    return [a / b for a, b in zip(launches[job], launches[fastest], strict=True)]


def _spread(ratios: list[float]) -> str:
    return f"{min(ratios):.2f}–{max(ratios):.2f}" if ratios else ""


def _row(result: dict[str, Any]) -> str:
    steps, plan, fastest = result["steps_ms"], result["auto_plan"] or {}, result["fastest_torch"]
    ratio = _ratio(result)
    bf, auto = steps.get("bfpp_bf"), steps.get("auto")
    over_bf = "" if not bf or auto is None else f"{auto / bf:.3f}"
    return (
        f"| {result['point']} | {plan.get('schedule', '?')} v={plan.get('v', '?')} | {_ms(steps.get('auto'))} |"
        f" {_ms(1e3 * plan['predicted_s']) if plan else ''} | {fastest or '?'} | {_ms(steps.get(fastest))} |"
        f" {'' if ratio is None else f'{ratio:.3f}'}{'' if ratio is None or ratio <= TOLERANCE else ' ✗'} |"
        f" {_spread(_round_ratios(result))} | {_ms(bf)} | {over_bf} | {_sgo(result)} |"
        f" {result['bound_ms']:.0f} ({result['bound_order']}) |"
    )


def _sgo(result: dict[str, Any]) -> str:
    """``auto`` under ``shard_grad_op``: its choice, step and ratio to the fastest torch schedule (dp > 1 only)."""
    plan, ratio = result.get("auto_sgo_plan"), _ratio(result, "auto_sgo")
    if not plan or ratio is None:
        return ""
    mark = "" if ratio <= TOLERANCE else " ✗"
    return f"{plan['schedule']} v={plan['v']}: {_ms(result['steps_ms']['auto_sgo'])}, {ratio:.3f}{mark}"


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.0f}"


def table(results: list[dict[str, Any]]) -> str:
    head = (
        "| point | auto chose | auto step (ms) | predicted (ms) | fastest torch | its step (ms) | auto / it |"
        " auto / it by round | bfpp breadth_first (ms) | auto / breadth-first |"
        " auto shard_grad_op: chose, step (ms), / fastest torch | bound (ms) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    ratios = [r for r in (_ratio(x) for x in results) if r is not None]
    within = sum(r <= TOLERANCE for r in ratios)
    lines = [head, *(_row(r) for r in results), ""]
    if ratios:
        lines.append(
            f"auto within {TOLERANCE - 1:.0%} of the fastest torch schedule (or faster) at {within} of {len(ratios)}"
            f" points; median auto / fastest torch {statistics.median(ratios):.3f}"
        )
    sgo = [r for r in (_ratio(x, "auto_sgo") for x in results) if r is not None]
    if sgo:
        lines.append(
            f"auto with shard_grad_op (the weights' residency of torch's FSDP2 jobs) within {TOLERANCE - 1:.0%} at"
            f" {sum(r <= TOLERANCE for r in sgo)} of {len(sgo)} sharded points"
        )
    wins: dict[str, int] = {}
    for r in results:
        if r["fastest_torch"]:
            wins[r["fastest_torch"]] = wins.get(r["fastest_torch"], 0) + 1
    lines.append("fastest torch schedule: " + ", ".join(f"{k} at {v}" for k, v in sorted(wins.items())))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
