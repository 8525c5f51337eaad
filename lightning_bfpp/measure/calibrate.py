"""Measure this machine for the planner: its links, and the pipeline runtime's own costs.

``python -m lightning_bfpp.plan calibrate --devices 4 --out cluster.json`` measures, at that many processes
(gloo on CPU, NCCL on GPUs):

- **links**: ping-pong transfers between two processes, and all-gathers, reduce-scatters and all-reduces within
  a group of ``--group-size`` (the data-parallel size the plan will use), each fitted as ``time = fixed +
  bytes / bandwidth`` (the reductions' bandwidths as ratios to the all-gathers'), on each size's median over
  three sweeps (``link_rounds``; ``--timings`` writes each term's range over them); the other processes stay
  idle, as most ranks' links are during a real step. Then a tensor group's all-reduce as a step runs it:
  every group of ``--group-size`` consecutive processes at once, each call right after the process's own
  work, so that it pays for the group's members not arriving together (on this 2-core machine, about
  3 ms per small all-reduce in a step against 1.5 ms back to back). One machine only shows its intra-node links; the
  inter-node bandwidth is written equal to them unless given;
- **the runtime** (:func:`measure_runtime`): ``BFPPStrategy`` trains an emulated model (layers that sleep 5 and
  10 ms, :mod:`~lightning_bfpp.measure.emulated`) on all the processes in two layouts, the second with 4× more
  schedule actions per rank, three times each, alternating. What the two layouts' median step times have
  beyond the simulated ones gives the host cost per schedule action and per step (Python, the step's
  collective, Lightning's loop), which grow with the process count and are what the simulation would
  otherwise miss on small layers. Two more layouts price what those two leave out: a tensor group's all-reduce
  as a step pays it, and the extra cost of an action on a stage with data-parallel replicas (FSDP2's hooks and
  copies; two ``full_shard`` replicas of layers with 1 MiB of weights). The layers are long
  enough for the host to wait on its "device" most of the time, as it does on accelerators: with 1 ms
  layers, 8 processes on 2 cores kept every core busy, and what was measured was the processes queueing
  for the cores (180 ms per step instead of about 10);
- **the step's first gather and last reduction** (with the step's host cost the runtime measurement found):
  every group of ``--group-size`` gathers, then reduce-scatters, 16 MiB at once, each process busy with that
  host work meanwhile, as a step issues the gather of its first stage and ends with the reduction of its last;
  against one group's collective alone, as the links price it, those are ``Cluster.first_gather_slowdown`` and
  ``last_reduce_slowdown``. Every other collective of a step runs with some ranks computing or waiting, but these
  two meet every group's copies and sums and every process's host work at once: on 4 processes sharing 2 cores
  the gather took 20–28 ms where the links price 9 ms and the reduce-scatter 34 ms where they price 18 ms
  (16 MiB), and traced steps waited for them as long.

Every process runs one intra-op thread (``OMP_NUM_THREADS=1``, as torchrun sets by default): several
processes sharing a few cores, each with a thread per core, make any host-side op on an activation spin
against the others, a cost of milliseconds per MiB that a GPU's host never pays and that moved the
emulated runs' steps by up to a quarter at 1 MiB activations.

The result is a :class:`~lightning_bfpp.plan.cluster.Cluster`. This module runs the calibration; the parts live
in modules of one concern each, and every name they had here is still importable from here:
:mod:`~lightning_bfpp.measure.links` (the link and contention measurements, in processes of their own),
:mod:`~lightning_bfpp.measure.fitting` (the fits, pure) and :mod:`~lightning_bfpp.measure.emulated_jobs` (the
emulated models trained with Lightning, each job in processes of its own, with the strategy the caller passes in:
this package imports nothing above the engine).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from lightning_bfpp.measure.emulated import EmulatedModel, EmulatedNet
from lightning_bfpp.measure.emulated_jobs import run_emulated, run_emulated_auto, run_emulated_many
from lightning_bfpp.measure.fitting import (
    _runtime_row,
    _tensor_cost,
    cost_weights,
    data_parallel_action_cost,
    fit_runtime_costs,
    link_spread,
    link_terms,
    link_timings,
    runtime_spread,
    sensitivity,
)
from lightning_bfpp.measure.links import (
    CONTENDED_BYTES,
    LINKS,
    SIZES,
    TENSOR_ALL_REDUCE_BYTES,
    measure_contended,
    measure_links,
)
from lightning_bfpp.measure.links import _contended as _contended
from lightning_bfpp.measure.links import _link_calls as _link_calls
from lightning_bfpp.plan.cluster import Cluster, contended_slowdown, tensor_all_reduce_s
from lightning_bfpp.plan.plan import Plan

# the calibration's parts are importable from here too (the link calls, ``_link_calls`` and ``_contended``, as well)
__all__ = [
    "CONTENDED_BYTES",
    "DATA_PARALLEL_RUNTIME_MODEL",
    "LINKS",
    "RUNTIME_MODEL",
    "SIZES",
    "TENSOR_ALL_REDUCE_BYTES",
    "calibrate",
    "cost_weights",
    "data_parallel_action_cost",
    "data_parallel_runtime_configs",
    "fit_runtime_costs",
    "link_spread",
    "link_terms",
    "link_timings",
    "measure_runtime",
    "one_thread",
    "run_emulated",
    "run_emulated_auto",
    "run_emulated_many",
    "runtime_configs",
    "runtime_spread",
    "sensitivity",
    "tensor_runtime_config",
]

# the runtime calibration's model: sleeping layers, long enough that the processes' host work does not saturate
# a few shared cores (the host waits on the device, as on accelerators), short enough for a quick run
RUNTIME_MODEL = EmulatedModel(layers=16, forward_ms=5.0, backward_ms=10.0, param_numel=16_384, activation_numel=4096)

# the data-parallel layout's model: the same layers with 1 MiB of weights each, so that FSDP2's hooks and copies run
# on real shards while the gathers and reductions (priced by the links measured first) stay a small part of a step
DATA_PARALLEL_RUNTIME_MODEL = replace(RUNTIME_MODEL, param_numel=1 << 18)


def calibrate(
    devices: int,
    group_size: int = 2,
    memory_bytes: int | None = None,
    inter_node_bandwidth: float | None = None,
    repeats: int = 10,
    runtime: bool = True,
    link_rounds: int = 3,
    *,
    strategy: type | None = None,
) -> tuple[Cluster, dict[str, Any]]:
    """Measure ``devices`` local processes; return the cluster and the raw timings, with ``link_spread`` (each
    link term's range over the ``link_rounds`` sweeps, the terms being fitted on each size's median over them)
    and, with the runtime, ``runtime_spread`` (each runtime cost's range over the layouts' rounds).

    ``runtime=False`` leaves the runtime's per-action and per-step costs at 0 (links only: seconds, where the
    runtime's six emulated training jobs take minutes). The runtime's jobs train with ``strategy``
    (``BFPPStrategy``), which it then needs.
    """
    if devices < 2 or not 2 <= group_size <= devices:
        raise ValueError("calibration needs at least 2 devices and a group size between 2 and the device count")
    if link_rounds < 1:
        raise ValueError(f"calibration needs at least one round of the links, got {link_rounds}")
    if runtime and strategy is None:
        raise ValueError("calibrating the runtime trains with `strategy` (BFPPStrategy): pass it, or runtime=False")
    timings = measure_links(devices, group_size, repeats, link_rounds)
    timings.update(link_timings(timings["link_rounds"], statistics.median))
    terms = link_terms(timings, group_size)
    timings["link_spread"] = link_spread(timings["link_rounds"], group_size)
    if memory_bytes is None:
        memory_bytes = (
            torch.cuda.get_device_properties(0).total_memory
            if torch.cuda.is_available()
            else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // devices
        )
    cluster = Cluster(
        num_devices=devices,
        devices_per_node=devices,
        memory_bytes=int(memory_bytes),
        inter_node_bandwidth=inter_node_bandwidth or terms["intra_node_bandwidth"],
        **terms,
    )
    if timings["tensor_all_reduce"]:  # the fixed part of a tensor group's all-reduce, as a step pays it
        ((nbytes, seconds),) = timings["tensor_all_reduce"]
        moved = tensor_all_reduce_s(replace(cluster, collective_overhead_s=0.0), group_size, nbytes)
        cluster = replace(cluster, tensor_collective_overhead_s=max(seconds - moved, 0.0))
    if runtime:
        assert strategy is not None  # checked above, before the links
        cluster, costs = measure_runtime(devices, cluster, strategy=strategy)
        timings["runtime"] = costs
        timings["runtime_spread"] = runtime_spread(costs)
    # the step's first gather and last reduction beside the step's host work as the runtime's costs price it
    timings.update(measure_contended(devices, group_size, repeats, cluster.step_overhead_s))
    ((gathered, gather_s),) = timings["first_gather"]
    ((reduced, reduce_s),) = timings["last_reduce"]
    cluster = replace(
        cluster,
        first_gather_slowdown=contended_slowdown(cluster, "all_gather", group_size, gathered, gather_s),
        last_reduce_slowdown=contended_slowdown(cluster, "reduce_scatter", group_size, reduced, reduce_s),
    )
    return cluster, timings


def runtime_configs(devices: int) -> tuple[Plan, Plan]:
    """Two layouts over all ``devices`` that differ only in actions per rank (``2·v·m``: 4× in the second)."""
    if devices < 2 or RUNTIME_MODEL.layers % (2 * devices):
        raise ValueError(
            f"the runtime calibration runs {RUNTIME_MODEL.layers} layers as 2 stages per process, which"
            f" {devices} processes do not divide; calibrate at a power of two up to 8, or pass runtime=False"
        )
    return (
        Plan("breadth_first", devices, 1, 2, devices, 1),
        Plan("breadth_first", devices, 1, 2, 4 * devices, 1),
    )


def tensor_runtime_config(devices: int) -> Plan | None:
    """The first of :func:`runtime_configs` with each pipeline rank's layers split over 2 processes; None for an
    odd process count."""
    if devices % 2:
        return None
    few = runtime_configs(devices)[0]
    return replace(few, pipeline_parallel_size=devices // 2, tensor_parallel_size=2)


def data_parallel_runtime_configs(devices: int) -> tuple[Plan, Plan] | None:
    """Two layouts of :data:`DATA_PARALLEL_RUNTIME_MODEL` over all ``devices``, two ``full_shard`` replicas of
    pipelines of ``devices / 2``, that differ only in actions per rank (4× in the second, as
    :func:`runtime_configs`); None below 4 processes or for an odd count (no pipeline beside the replicas)."""
    if devices < 4 or devices % 2:
        return None
    p = devices // 2
    return (
        Plan("breadth_first", p, 2, 2, 2 * p, 1, sharding="full_shard"),
        Plan("breadth_first", p, 2, 2, 8 * p, 1, sharding="full_shard"),
    )


@contextmanager
def one_thread() -> Iterator[None]:
    """One intra-op thread in this process while profiling, as the training processes run (``run_emulated``):
    with a thread per core, the host-side ops on a 256 KiB activation measured 5 ms slower on 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def measure_runtime(
    devices: int,
    links: Cluster,
    steps: int = 12,
    rounds: int = 3,
    tensor: bool = True,
    data_parallel: bool = True,
    *,
    strategy: type,
) -> tuple[Cluster, list[dict[str, Any]]]:
    """The runtime's own cost per schedule action and per step at ``devices`` processes, added to ``links``; the
    emulated jobs train with ``strategy`` (``BFPPStrategy``).

    Each configuration of :func:`runtime_configs` trains ``steps`` steps in a job of its own, ``rounds`` times,
    the two configurations alternating; its median step time (after the first, which also infers shapes),
    the median over its rounds, less the simulated one (this machine's links, the emulated layers' measured
    sleeps) is the runtime's cost, fitted as a cost per step and per action charged as the simulation
    charges them (:func:`cost_weights`, :func:`fit_runtime_costs`). One round of each moved the fitted
    cost per action by a fifth between calibrations at 8 processes on 2 cores (3.2 against 3.8 ms), enough
    to put predictions with many actions per rank 11–13% off; alternating rounds spread the machine's drift
    over both configurations, and the median drops a disturbed job.

    With ``tensor`` (and an even process count) a third layout, the first with each pipeline rank's layers
    split over 2 processes (:func:`tensor_runtime_config`), measures a tensor group's all-reduce as a step
    pays it: what its step has beyond the simulated one with the runtime's costs just fitted, per all-reduce on
    the critical path, is ``tensor_collective_overhead_s``. In a step the two members meet at every layer, so
    each all-reduce also waits for the later of the two; on 2 shared cores that made it about 3 ms against
    the 1.5 ms of back-to-back calls.

    With ``data_parallel`` (and 4 or more processes, an even count) two more layouts,
    :func:`data_parallel_runtime_configs`, measure what an action costs on a stage with data-parallel replicas
    beyond the other layouts' cost per action: FSDP2's hooks and copies in every forward and backward. The two
    differ only in actions, and are fitted as the first two are: their cost per action less the unreplicated
    one is ``data_parallel_action_overhead_s`` (their cost per step, FSDP2's and the optimizer's, is the same for
    every layout of one mesh and is left out). Left out, the planner took actions on sharded stages for as cheap
    as unsharded ones, and at p=2 dp=2 on 4 processes chose 8 stages per rank where 2 measured 5% faster. Fitted
    from one layout's step instead (what it has beyond the simulated one, per action), the term took every error
    of the per-step cost fitted on other layouts: 0.39 ms at 4 processes and 0.02 ms at 8 in one calibration,
    each far enough off to make ``auto`` choose the slower of two layouts 2–4% apart at dp=2 (more stages per
    rank at p=4 m=16, fewer at p=2 m=2).
    """
    from lightning_bfpp.measure.profile import profile_module

    if rounds < 1:
        raise ValueError(f"measure_runtime needs at least one round, got {rounds}")
    with one_thread():
        batch = (torch.randn(1, RUNTIME_MODEL.activation_numel),)
        profile = profile_module(EmulatedNet(RUNTIME_MODEL), batch, _emulated_input, repeats=7)
    profile = replace(profile, optimizer_state_ratio=0.0)
    split = tensor_runtime_config(devices) if tensor else None
    replicated = data_parallel_runtime_configs(devices) if data_parallel else None
    layouts = [(config, RUNTIME_MODEL) for config in runtime_configs(devices)]
    if split is not None:
        layouts.append((split, RUNTIME_MODEL))
    if replicated is not None:
        layouts.extend((config, DATA_PARALLEL_RUNTIME_MODEL) for config in replicated)
    # each round of each layout in a job of its own, the layouts alternating: in one long job at 8 processes on
    # 2 cores the later rounds ran up to a quarter slower than the first, and the fitted cost per action with them
    runs: list[list[float]] = [[] for _ in layouts]
    for _ in range(rounds):
        for i, (config, model) in enumerate(layouts):
            runs[i].append(run_emulated(config, model, steps, devices, strategy=strategy))
    rows = [
        _runtime_row(config, measured, profile, links)
        for (config, _), measured in zip(layouts[:2], runs[:2], strict=True)
    ]
    per_action, per_step = fit_runtime_costs(rows)
    cluster = replace(links, action_overhead_s=per_action, step_overhead_s=per_step)
    if split is not None:
        layers = tuple(replace(layer, tensor_parallel_all_reduces=1) for layer in profile.layers)
        row = _tensor_cost(split, replace(profile, layers=layers), cluster, statistics.median(runs[2]))
        rows.append({**row, "rounds_s": runs[2]})
        cluster = replace(cluster, tensor_collective_overhead_s=row["tensor_collective_overhead_s"])
    if replicated is not None:
        # the same layers' measured times, with this model's weights
        weights = DATA_PARALLEL_RUNTIME_MODEL.param_bytes
        layers = tuple(replace(layer, param_bytes=weights) for layer in profile.layers)
        weighted = replace(profile, layers=layers)
        dp_rows = [
            _runtime_row(config, measured, weighted, links)
            for config, measured in zip(replicated, runs[-2:], strict=True)
        ]
        cost = data_parallel_action_cost(dp_rows, per_action)
        rows.extend({**row, "data_parallel_action_overhead_s": cost} for row in dp_rows)
        cluster = replace(cluster, data_parallel_action_overhead_s=cost)
    return cluster, rows


def _emulated_input(module: nn.Module, batch: tuple[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """What :class:`~lightning_bfpp.measure.emulated.EmulatedNet`'s ``training_step`` passes to ``self(...)`` for
    ``batch``, its one tensor: the profile's capture for the emulated model, which needs none of the strategy's."""
    (x,) = batch
    return (x,), {}
