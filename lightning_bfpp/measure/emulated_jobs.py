"""Emulated models (:mod:`~lightning_bfpp.measure.emulated`) trained with Lightning, each job in processes of its own.

:func:`run_emulated_many` starts the job's processes with the package's launcher (new interpreters, each told its
rank as Lightning's launcher would tell it), every process trains the job's runs in the same order
(:func:`_train_emulated`), and global rank 0 writes each run's step times back. The calibration
(:func:`~lightning_bfpp.measure.calibrate.measure_runtime`), the benchmarks and the tests measure the runtime so.

The strategy to train with (``BFPPStrategy``) is the caller's to pass in, as a class: the measuring code imports
nothing above the engine, and each rank imports the class by the name the caller's class has
(``module:qualified name``).
"""

from __future__ import annotations

import functools
import importlib
import itertools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from lightning_bfpp.measure import launcher
from lightning_bfpp.measure.emulated import EmulatedModel
from lightning_bfpp.plan.cluster import Cluster
from lightning_bfpp.plan.config import config_rules
from lightning_bfpp.plan.plan import Plan


def run_emulated(
    config: Plan,
    model: EmulatedModel,
    steps: int,
    devices: int,
    processes_per_node: int | None = None,
    *,
    strategy: type,
) -> float:
    """Train ``config`` on ``model`` with ``strategy`` (``BFPPStrategy``) in a job of its own; the median step
    time (s).

    ``processes_per_node`` lays the processes out as nodes of that many (hybrid sharding, weight passing)."""
    return run_emulated_many([(config, model)], steps, devices, processes_per_node, strategy=strategy)[0]


def run_emulated_auto(
    config: Plan, model: EmulatedModel, steps: int, devices: int, cluster: Cluster, *, strategy: type
) -> tuple[float, Plan, float]:
    """Train ``model`` with ``strategy(pipeline_parallel_size="auto")`` (``BFPPStrategy``, with ``config``'s
    schedule, sharding, stages per rank, micro-batches and tensor size) on ``cluster``, in a job of its own: the
    median step time (s), the layout the planner chose, and the step it predicted for it (s)."""
    job = _emulated_job([(config, model)], steps, devices, None, strategy, auto_cluster=asdict(cluster))
    run = job[0]
    return float(run["step_time"]), Plan(**run["chosen"]), float(run["predicted_step_time"])


def run_emulated_many(
    runs: Sequence[tuple[Plan, EmulatedModel]],
    steps: int,
    devices: int,
    processes_per_node: int | None = None,
    *,
    strategy: type,
) -> list[float]:
    """Train each ``(config, model)`` of ``runs`` with ``strategy`` (``BFPPStrategy``), one after the other in the
    same ``devices`` processes (one start-up for all: a start costs more than a few steps on a few cores); the
    median step time (s) of each."""
    return [float(run["step_time"]) for run in _emulated_job(runs, steps, devices, processes_per_node, strategy)]


def _importable_name(cls: type) -> str:
    """``module:qualified name``, by which the child process imports ``cls``."""
    if "<locals>" in cls.__qualname__ or cls.__module__ == "__main__":
        raise ValueError(f"the emulated runs import the strategy by its name: {cls!r} cannot be imported by name")
    return f"{cls.__module__}:{cls.__qualname__}"


def _imported(name: str) -> type:
    """The class :func:`_importable_name` named."""
    module, _, qualified = name.partition(":")
    return functools.reduce(getattr, qualified.split("."), importlib.import_module(module))


def _emulated_job(
    runs: Sequence[tuple[Plan, EmulatedModel]],
    steps: int,
    devices: int,
    processes_per_node: int | None,
    strategy: type,
    auto_cluster: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    # one intra-op thread per process unless the caller set its own, as torchrun sets: with the default (every core
    # per process) a host-side op on an activation (the emulated layer's add, a loss) spins all processes' threads
    # against each other and costs milliseconds per MiB, which an accelerator's host never pays
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "steps.json"
        job = {
            "runs": [{"config": asdict(config), "model": asdict(model)} for config, model in runs],
            "steps": steps,
            "devices": devices,
            "processes_per_node": processes_per_node,
            "auto_cluster": auto_cluster,
            "strategy": _importable_name(strategy),
        }
        # new interpreters: the caller may have used torch already, whose thread pools do not survive a fork
        target = f"{__name__}:_train_emulated"
        result = launcher.launch(target, devices, Path(tmp), args=(job, str(out)), start="spawn", threads=threads)
        if not result.ok:
            described = "; ".join(config.describe() for config, _ in runs)
            raise RuntimeError(f"the emulated runs ({described}) failed: {result.report()}")
        return list(json.loads(out.read_text()))


def _train_emulated(rank: int, job: dict[str, Any], out: str) -> None:
    """One rank of an emulated training job (the launcher's, as Lightning sees processes started outside it): every
    rank runs the same runs in the same order."""
    results = []
    for run in job["runs"]:
        results.append(_train_one(Plan(**run["config"]), EmulatedModel(**run["model"]), job))
        launcher.rearm_reports()  # the run's Trainer put the default signal handlers back when it ended
    if results[0] is not None:  # global rank 0 measured
        Path(out).write_text(json.dumps(results))


def _train_one(config: Plan, model: EmulatedModel, job: dict[str, Any]) -> dict[str, Any] | None:
    import lightning as L

    from lightning_bfpp.measure.emulated import EmulatedNet, emulated_loader

    steps = int(job["steps"])
    starts: list[float] = []

    class StepTimes(L.Callback):
        def on_train_batch_start(self, *args: object) -> None:
            starts.append(time.perf_counter())

        def on_train_end(self, *args: object) -> None:
            starts.append(time.perf_counter())

    auto = job.get("auto_cluster")
    arguments = config_rules(config.schedule).arguments(config)  # the strategy arguments that lay it out
    if auto:
        arguments["pipeline_parallel_size"] = "auto"
    strategy = _imported(job["strategy"])(
        **arguments,
        cluster=Cluster(**auto) if auto else None,
        sharding=config.sharding,
        prefetch_stages=config.prefetch_stages,
        processes_per_node=job.get("processes_per_node"),
        tensor_parallel_size=config.tensor_parallel_size,
    )
    trainer = L.Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=job["devices"], strategy=strategy,
        max_steps=steps, callbacks=[StepTimes()], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    # every replica gets `steps` full batches (the sampler splits the data set over the replicas)
    replicas = job["devices"] // config.tensor_parallel_size if auto else config.data_parallel_size
    trainer.fit(EmulatedNet(model), emulated_loader(model, config.num_microbatches, steps * replicas))
    if trainer.global_rank != 0:
        return None
    durations = [b - a for a, b in itertools.pairwise(starts)][1:]
    result: dict[str, Any] = {"step_time": statistics.median(durations), "steps": durations}
    if auto:
        assert strategy.planned is not None and strategy.planned.prediction is not None
        result["chosen"] = asdict(strategy.planned.config)
        result["predicted_step_time"] = strategy.planned.prediction.step_time
    return result
