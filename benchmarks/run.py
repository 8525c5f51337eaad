"""The benchmark suite: bfpp against its peers on emulated accelerators and on real compute, in one run.

    python -m benchmarks.run --quick                     # every configuration once, 2–4 minutes on 2 cores
    python -m benchmarks.run --full                      # three interleaved rounds, longer, variants: ~10 min
    python -m benchmarks.run --quick --only a/bfpp       # one job (or a group: --only a), well under a minute
    python -m benchmarks.run --full --rounds 6 --only a/bfpp,a/bfpp_hand   # (d) on (a), round by round: 2 min
    python -m benchmarks.run --quick --only z            # zero-bubble group (z): only runs when named

Writes ``results.md`` (tables, the four judged ratios, the command, the date and the machine as measured),
``results.png`` and ``results.json`` to ``--out`` (default ``docs/benchmarks``; with ``--only``,
``runs/benchmarks`` so that a partial run does not replace the published one). Each process's log and
raw per-step record stay under ``runs/benchmarks/raw``.

Why the figures can be trusted as ratios and not as absolutes: every job runs as real processes (gloo on
127.0.0.1), the emulated layers sleep instead of computing so several processes on two cores behave like
several devices, and the real-compute case is compared only with the machine's capacity measured in the
same run. Other work on the machine still moves every figure; compare within one run, and read the spread.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.suite import configs, launch, report
from benchmarks.suite.spec import Job

REPO = Path(__file__).resolve().parents[1]


def _select(all_jobs: list[Job], only: str | None) -> list[Job]:
    if not only:
        return all_jobs
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    chosen = [j for j in all_jobs if j.name in wanted or j.group in wanted]
    if not chosen:
        names = ", ".join(j.name for j in all_jobs)
        groups = ", ".join(dict.fromkeys(j.group for j in all_jobs))
        raise SystemExit(f"--only {only!r} matches no job; groups are {groups}; jobs are: {names}")
    return chosen


def _with_knobs(job: Job, settings: list[str]) -> Job:
    """``job`` with ``emulated.<field>=<value>`` / ``gpt.<field>=<value>`` applied to its model specs."""
    for setting in settings:
        key, _, value = setting.partition("=")
        model, _, knob = key.partition(".")
        spec = getattr(job, model, None) if model in ("emulated", "gpt") else None
        if spec is None or knob not in spec.__dataclass_fields__ or not value:
            fields = ", ".join(f"{m}.{f}" for m in ("emulated", "gpt") for f in getattr(job, m).__dataclass_fields__)
            raise SystemExit(f"--set {setting!r}: expected MODEL.KNOB=VALUE with one of {fields}")
        kind = type(getattr(spec, knob)) if getattr(spec, knob) is not None else float  # weight_grad_ms: None
        job = replace(job, **{model: replace(spec, **{knob: kind(value)})})
    return job


def _sleep_overshoot_ms(target_ms: float = 5.0, samples: int = 40) -> float:
    """How much longer than asked a sleep takes here now: the emulated layers' error, per call."""
    overshoot = []
    for _ in range(samples):
        start = time.perf_counter()
        time.sleep(target_ms / 1e3)
        overshoot.append(1e3 * (time.perf_counter() - start) - target_ms)
    return sorted(overshoot)[samples // 2]


def _machine(load_before: tuple[float, float, float], sleep_ms: float) -> list[str]:
    load_after = os.getloadavg()
    return [
        f"- Machine: {platform.node()}, {os.cpu_count()} CPU cores, Python {platform.python_version()},"
        f" torch {torch.__version__}, lightning {_version('lightning')}; gloo on 127.0.0.1, one thread per process.",
        f"- Load average (1, 5, 15 min) at the start: {', '.join(f'{x:.2f}' for x in load_before)}; at the end:"
        f" {', '.join(f'{x:.2f}' for x in load_after)} (other work on the machine shares its {os.cpu_count()} cores).",
        f"- A 5 ms sleep took {5 + sleep_ms:.2f} ms (median) at the start: each emulated layer call runs that much"
        " long; the bounds use the nominal times.",
    ]


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--quick", action="store_true", help="every configuration once, 5 timed steps each")
    mode.add_argument("--full", action="store_true", help="three interleaved rounds of 10 timed steps, and variants")
    mode.add_argument("--replot", action="store_true", help="only draw results.png again from --out's results.json")
    parser.add_argument(
        "--only", help="comma-separated job names or groups (a, b, c; z only when named), e.g. 'a/bfpp' or 'b'"
    )
    parser.add_argument("--out", type=Path, help="where results.md/png/json go (default: docs/benchmarks)")
    parser.add_argument(
        "--rounds",
        type=int,
        help="interleaved rounds (default: 3 with --full, 1 with --quick), e.g. 6 to narrow a ratio",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="MODEL.KNOB=VALUE",
        help="change a model knob for every job of that model, e.g. emulated.forward_ms=10,"
        " emulated.param_numel=4000000, emulated.activation_numel=65536, gpt.dim=256 (repeatable)",
    )  # fmt: skip
    args = parser.parse_args()
    out: Path = args.out or (REPO / ("runs/benchmarks" if args.only else "docs/benchmarks"))
    if args.replot:
        _replot(out)
        return
    raw = REPO / "runs/benchmarks/raw"
    # the optional groups (z) are there to be named by --only; a run of everything leaves them out
    all_jobs = configs.jobs(full=args.full, optional=bool(args.only))
    selected = [_with_knobs(job, args.set) for job in _select(all_jobs, args.only)]
    rounds = args.rounds or (3 if args.full else 1)

    load_before = os.getloadavg()
    sleep_ms = _sleep_overshoot_ms()
    started = time.monotonic()
    launches: dict[str, list[list[dict]]] = {j.name: [] for j in selected}
    for round_index in range(rounds):
        for job in selected:  # rounds interleave the jobs, so that drift in the machine's load hits all of them
            t0 = time.monotonic()
            records = launch.launch(job, raw / job.name.replace("/", "_") / f"round{round_index}")
            launches[job.name].append(records)
            status = next((r["error"] for r in records if "error" in r), "ok")
            print(f"[{time.monotonic() - started:6.1f}s] {job.name:<24} {time.monotonic() - t0:5.1f}s  {status}",
                  flush=True)  # fmt: skip
    elapsed = time.monotonic() - started

    jobs = {j.name: j for j in selected}
    rows = [report.summarize(j, launches[j.name]) for j in selected]
    report.add_ratios(rows, jobs)
    command = "python -m benchmarks.run " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    out.mkdir(parents=True, exist_ok=True)
    title = f"{command}  ({datetime.date.today().isoformat()}, {os.cpu_count()} cores)"
    _plot(rows, out, title)
    results = {"command": command, "title": title, "rows": report.to_json(rows)}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(_markdown(rows, jobs, command, elapsed, load_before, sleep_ms))
    print(f"\nwrote {out / 'results.md'}, results.png, results.json in {elapsed:.0f} s")


def _plot(rows: list[report.Row], out: Path, title: str) -> None:
    capacity = configs.capacity_row(rows)
    line = capacity.samples_per_s.median if capacity is not None and capacity.samples_per_s is not None else None
    report.plot(rows, out / "results.png", configs.TITLES, title, reference_line=line)


def _replot(out: Path) -> None:
    """``results.png`` drawn again from ``results.json`` (the figures of the run that wrote it)."""
    results = json.loads((out / "results.json").read_text())
    title = results.get("title") or results["command"]
    _plot(report.from_json(results["rows"]), out, title)
    print(f"wrote {out / 'results.png'} from {out / 'results.json'}")


def _markdown(
    rows: list[report.Row],
    jobs: dict[str, Job],
    command: str,
    elapsed: float,
    load_before: tuple[float, float, float],
    sleep_ms: float,
) -> str:
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    emulated = [r for r in rows if jobs[r.name].model == "emulated"]
    real = [r for r in rows if jobs[r.name].model == "gpt"]
    parts = [
        "# Benchmarks",
        "",
        f"Made by `{command}` on {now}, in {elapsed / 60:.1f} minutes.",
        "",
        *_machine(load_before, sleep_ms),
        "",
        "## The judged ratios",
        "",
        *configs.targets(rows),
        "",
    ]
    if emulated:
        models = sorted({jobs[r.name].emulated.describe() + f" ({r.group})" for r in emulated})
        parts += [
            "## Emulated accelerators",
            "",
            "Layers sleep for their forward and backward time (per micro-batch of one sample) while real tensors flow:",
            *[f"- {m}" for m in models],
            "",
            "Every row trains the same model on the same global batch with the same number of processes (except"
            " the no-data-parallelism row of (b), which is the same pipeline on half the processes and half the"
            " batch: the same work per rank). × bfpp: median step over bfpp's (Lightning) in the same"
            " configuration. Efficiency: the analytic bound, `(m·v + p − 1)(f + b)` for one stage's `f`, `b`"
            " (`(m + p − 1)(f + b)` without looping; a rank's own samples through every layer without a"
            " pipeline), over the median step. Busy: time the emulated layers slept; bubble: waiting for"
            " pipeline neighbours; exposed comm: blocked in collectives or waiting for a weight gather (shares of"
            " the step, mean over ranks). Collectives and point-to-point sends per rank and step; bytes are each"
            " collective's full buffer. Peak: live host memory during the warm-up steps after the first (read"
            " there, not in the timed steps, whose host time the reads would lengthen) above its level before the"
            " first step (parameters and what setup left), largest rank.",
            "",
            report.pipeline_table(emulated),
            "",
        ]
    if real:
        capacity = configs.capacity_row(rows)
        model = jobs[real[0].name].gpt.describe()
        parts += [
            "## Real compute",
            "",
            f"{model}, AdamW, micro-batches of {jobs[real[0].name].microbatch_size} sequences, one thread per"
            " process. The capacity rows are independent processes (no communication) each training the whole"
            " model on one micro-batch per step, started together: what the machine's cores deliver for this"
            " model right now. They run before and after the pipelined rows; the ratios use the mean of the two"
            " medians. The *each rank alone* rows run bfpp's two ranks' own stages, forward and backward in its"
            " order over the step's micro-batches and one optimizer step, started together but never waiting for"
            " each other (a later stage's inputs are made beforehand): the pipeline's compute on these cores"
            " without its communication and bubble; their step is the slower rank's.",
            "",
            report.throughput_table(real, capacity),
            "",
        ]
    parts += ["![results](results.png)", ""]
    return "\n".join(parts)


if __name__ == "__main__":
    main()
