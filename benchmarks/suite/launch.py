"""Run a job as real processes, forked from this already-importing parent by the package's launcher
(:mod:`lightning_bfpp.measure.launcher`), and collect their records.

Forking saves each process importing torch and Lightning again (3–4 s of CPU each, 8 s for four processes
on two cores, per job); the parent only imports and never runs a tensor operation or a process group, so
no thread pool or communicator is inherited. Every process is a full participant: gloo over 127.0.0.1 for
the hand-driven jobs, Lightning's own process-group setup (told by ``LOCAL_RANK`` that the processes exist
already) for the Lightning jobs. A job that fails on one rank leaves the others waiting in a collective:
after the first failure the rest get a few seconds, then are killed.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing as mp
from pathlib import Path
from threading import Barrier
from typing import Any

from benchmarks.suite import instrument, workers
from benchmarks.suite.spec import Job
from lightning_bfpp.measure import launcher

GRACE_AFTER_FAILURE_S = 5.0

# glibc's settings that keep freed memory for reuse (the largest block it still maps on its own, and how much free
# memory at the heap's top it keeps), as environment variables for processes started fresh (``plan calibrate``'s)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD, _TRIM_THRESHOLD = 32 << 20, 1 << 30
CACHING_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(_MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(_TRIM_THRESHOLD)}


def keep_freed_memory() -> None:
    """Have this process reuse the memory it frees, as an accelerator's caching allocator does (CUDA's returns
    nothing to the driver during training), for every job alike.

    By default glibc maps each block of a few MiB afresh and unmaps it when freed, or trims the heap back, so the
    next block of that size is new memory again: one page fault per 4 KiB. On this kind of virtual machine a
    4 MiB block (one emulated layer's weight gradient at dp=2) then took about 12 ms to allocate, in 5–15% of
    backwards, at random: noise that reached both the steps measured and the per-layer profile that
    ``schedule="auto"`` plans from (a layer's median backward measured 20–23 ms instead of 10.7 in some runs).
    A no-op without glibc.
    """
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
    mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)


def launch(job: Job, folder: Path) -> list[dict[str, Any]]:
    """Run ``job`` on ``job.processes`` processes forked from this one (the package's launcher); one record per
    rank (``{"error": ...}`` if it failed: the launcher's reason and the rank's last log line)."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("rank*.json"):
        stale.unlink()
    barrier = mp.get_context("fork").Barrier(job.processes) if job.kind in ("independent", "stage_compute") else None
    result = launcher.launch(
        _child, job.processes, folder, args=(job.to_json(), str(folder), barrier), timeout_s=job.timeout_s,
        grace_after_failure_s=GRACE_AFTER_FAILURE_S,
    )  # fmt: skip
    records = []
    for rank in range(job.processes):
        path = folder / f"rank{rank}.json"
        if path.exists():
            records.append(json.loads(path.read_text()))
        else:
            tail = result.log(rank).strip().splitlines()[-1:]
            records.append({"error": result.reason or "no record written", "log_tail": tail})
    return records


def _child(rank: int, job_json: str, folder: str, barrier: Barrier | None) -> None:
    """One rank of a job (its output goes to ``rank<R>.log``); writes ``rank<R>.json``, an error record if it
    raised (then it exits with 1, and the launcher stops the others)."""
    out = Path(folder)
    job = Job.from_json(job_json)
    keep_freed_memory()
    instrument.install()
    try:
        record = workers.run(job, rank, barrier)
    except BaseException as error:
        summary = f"{type(error).__name__}: {error}".strip().splitlines()
        record = {"error": summary[0] if summary else type(error).__name__, "detail": summary[1:6]}
        (out / f"rank{rank}.json").write_text(json.dumps(record))
        raise
    (out / f"rank{rank}.json").write_text(json.dumps(record))
