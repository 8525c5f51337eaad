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

The result is a :class:`~lightning_bfpp.plan.cluster.Cluster`.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_bfpp.measure.emulated import EmulatedModel
from lightning_bfpp.plan.cluster import Cluster, contended_slowdown, tensor_all_reduce_s
from lightning_bfpp.plan.costs import ModelProfile
from lightning_bfpp.plan.plan import Plan
from lightning_bfpp.plan.simulate import simulate

# the runtime calibration's model: sleeping layers, long enough that the processes' host work does not saturate
# a few shared cores (the host waits on the device, as on accelerators), short enough for a quick run
RUNTIME_MODEL = EmulatedModel(layers=16, forward_ms=5.0, backward_ms=10.0, param_numel=16_384, activation_numel=4096)

# the data-parallel layout's model: the same layers with 1 MiB of weights each, so that FSDP2's hooks and copies run
# on real shards while the gathers and reductions (priced by the links measured first) stay a small part of a step
DATA_PARALLEL_RUNTIME_MODEL = replace(RUNTIME_MODEL, param_numel=1 << 18)

SIZES = (4 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
LINKS = ("p2p", "all_gather", "reduce_scatter", "all_reduce")
# the step's first gather and last reduction, as a step issues them: a stage's weights (the largest of SIZES), where
# contention shows
CONTENDED_BYTES = SIZES[-1]
# a tensor-parallel all-reduce of one small activation: its fixed cost is what matters
TENSOR_ALL_REDUCE_BYTES = 4 << 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``t = a + b·x``; returns (a, 1/b)."""
    xs, ts = zip(*points, strict=True)
    mx, mt = statistics.fmean(xs), statistics.fmean(ts)
    slope = sum((x - mx) * (t - mt) for x, t in points) / sum((x - mx) ** 2 for x in xs)
    return max(mt - slope * mx, 0.0), 1.0 / slope


def _time(fn, repeats: int, cuda: bool) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _join(rank: int, world: int, port: int) -> tuple[torch.device, bool]:
    """Join the measuring processes' group; this process's device, and whether it is a GPU."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # as the training processes (run_emulated): gloo's CPU work is not oversubscribed
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    return device, cuda


def _worker(rank: int, world: int, port: int, out: str, repeats: int, group_size: int, rounds: int) -> None:
    device, cuda = _join(rank, world, port)
    group = dist.new_group(list(range(group_size)))
    calls = [_link_calls(rank, group, group_size, nbytes, device) for nbytes in SIZES]
    # every size of every link ``rounds`` times, the sweep's direction alternating: one sweep's medians of
    # consecutive calls took a slow spell of the shared host whole (a reduce-scatter's bandwidth fitted 0.17 of
    # the gathers' in one calibration, 0.46–0.63 in five others the same hour); its median over rounds does not
    measured: dict[str, list[list[float]]] = {name: [[] for _ in SIZES] for name in LINKS}
    for round_ in range(rounds):
        for i in range(len(SIZES)) if round_ % 2 == 0 else reversed(range(len(SIZES))):
            for name, (fn, per_call) in calls[i].items():
                measured[name][i].append(_time(fn, repeats, cuda) / per_call)
    tensor = _tensor_all_reduce(rank, world, group_size, repeats, device, cuda)
    if rank == 0:
        rounds_by_link = {name: list(zip(SIZES, by_size, strict=True)) for name, by_size in measured.items()}
        timings = {"link_rounds": rounds_by_link, "tensor_all_reduce": tensor}
        Path(out).write_text(json.dumps(timings))
    dist.destroy_process_group()


def _link_calls(
    rank: int, group: dist.ProcessGroup, group_size: int, nbytes: int, device: torch.device
) -> dict[str, tuple[Callable[[], None], int]]:
    """Each link's call for ``nbytes`` on this rank, and how many transfers one call makes (a ping-pong: two).
    The collectives run on the first ``group_size`` ranks, the others idle, as most ranks' links are in a step."""
    buf = torch.zeros(nbytes // 4, device=device)
    shard = torch.zeros(nbytes // 4 // group_size, device=device)
    full = torch.zeros(shard.numel() * group_size, device=device)
    member = rank < group_size

    def ping_pong() -> None:
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)

    def all_gather() -> None:
        if member:
            dist.all_gather_single(full, shard, group=group)

    def reduce_scatter() -> None:
        if member:
            dist.reduce_scatter_single(shard, full, group=group)

    def all_reduce() -> None:
        if member:
            dist.all_reduce(full, group=group)

    return {"p2p": (ping_pong, 2), "all_gather": (all_gather, 1), "reduce_scatter": (reduce_scatter, 1),
            "all_reduce": (all_reduce, 1)}  # fmt: skip


def _tensor_all_reduce(
    rank: int, world: int, size: int, repeats: int, device: torch.device, cuda: bool
) -> list[tuple[int, float]]:
    """A tensor group's all-reduce as a step runs it: every group of ``size`` consecutive ranks at once, each call
    right after the rank's own 5 ms of work (here a sleep), so that it also pays for the ranks not arriving
    together. Rank 0's median call time, at ``TENSOR_ALL_REDUCE_BYTES``."""
    groups = [dist.new_group(list(range(start, start + size))) for start in range(0, world - world % size, size)]
    if rank >= len(groups) * size:
        return []
    group = groups[rank // size]
    buf = torch.zeros(TENSOR_ALL_REDUCE_BYTES // 4, device=device)
    times = []
    for attempt in range(4 * repeats + 2):  # cheap (a few ms each), and noisy on shared cores
        time.sleep(5e-3)
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dist.all_reduce(buf, group=group)
        if cuda:
            torch.cuda.synchronize(device)
        if attempt >= 2:  # the first calls set the group up
            times.append(time.perf_counter() - start)
    return [(TENSOR_ALL_REDUCE_BYTES, statistics.median(times))]


def _contended_worker(rank: int, world: int, port: int, out: str, repeats: int, group_size: int, host_s: float) -> None:
    device, cuda = _join(rank, world, port)
    timings = {
        name: _contended(rank, world, group_size, repeats, device, cuda, host_s, collective)
        for name, collective in (("first_gather", "all_gather"), ("last_reduce", "reduce_scatter"))
    }
    if rank == 0:
        Path(out).write_text(json.dumps(timings))
    dist.destroy_process_group()


def _contended(
    rank: int,
    world: int,
    size: int,
    repeats: int,
    device: torch.device,
    cuda: bool,
    host_s: float,
    collective: str,
    warmup: int = 5,
) -> list[tuple[int, float]]:
    """A step's first gather or last reduction as a step issues it: every group of ``size`` consecutive ranks
    runs ``collective`` (``"all_gather"`` or ``"reduce_scatter"``) of :data:`CONTENDED_BYTES` at once, beside
    ``host_s`` of host work (a Python loop, as the step's preparation and its optimizer update are). Rank 0's
    median time from the call to the collective's end, after ``warmup`` calls (the first after the groups'
    set-up took 2–6× the later ones on gloo).

    The gather starts the step, and every rank works beside it: each polls it while working and notes its end.
    The reduction ends the step: the rank it ends has nothing left to do but wait (its optimizer update needs
    the gradients) while the other ranks work, so rank 0 waits for it at once. That also makes its end
    observable: gloo's reduce-scatter reports itself complete only once waited for."""
    groups = [dist.new_group(list(range(start, start + size))) for start in range(0, world - world % size, size)]
    group = groups[rank // size] if rank < len(groups) * size else None
    shard = torch.zeros(CONTENDED_BYTES // 4 // size, device=device)
    full = torch.zeros(shard.numel() * size, device=device)
    waits = collective == "reduce_scatter" and rank == 0
    times = []
    for attempt in range(warmup + 2 * repeats):
        dist.barrier()
        start = time.perf_counter()
        if group is None:
            continue
        if collective == "all_gather":
            work = dist.all_gather_single(full, shard, group=group, async_op=True)
        else:
            work = dist.reduce_scatter_single(shard, full, group=group, async_op=True)
        done = None
        while not waits and time.perf_counter() < start + host_s:  # the host work, noting when the gather ends
            if done is None and work.is_completed():
                done = time.perf_counter()
        work.wait()
        if cuda:
            torch.cuda.synchronize(device)
        if attempt >= warmup:
            times.append((done or time.perf_counter()) - start)
    return [(CONTENDED_BYTES, statistics.median(times))] if times else []


def link_terms(timings: dict[str, Any], group_size: int) -> dict[str, float]:
    """The cluster's link terms fitted on ``timings`` (``(bytes, seconds)`` per link and size): each link
    ``time = fixed + bytes / bandwidth``, the reductions' bandwidths as ratios to the all-gathers'."""
    latency, p2p_bandwidth = _fit([(b, t) for b, t in timings["p2p"]])
    # ring collectives of B bytes over n ranks: fixed + (n−1)/n · B / bandwidth (all-gather, reduce-scatter),
    # fixed + 2·(n−1)/n · B / bandwidth (all-reduce); each fitted on its own (gloo sums on the host: its
    # reduce-scatters take about twice an all-gather's time), the per-call cost from the all-gathers
    n = group_size
    fixed, bandwidth = _fit([((n - 1) / n * b, t) for b, t in timings["all_gather"]])
    _, reduce_bandwidth = _fit([((n - 1) / n * b, t) for b, t in timings["reduce_scatter"]])
    _, all_reduce_bandwidth = _fit([(2 * (n - 1) / n * b, t) for b, t in timings["all_reduce"]])
    return {
        "intra_node_bandwidth": bandwidth,
        "latency_s": latency,
        "p2p_bandwidth_ratio": p2p_bandwidth / bandwidth,
        "collective_overhead_s": max(fixed - (n - 1) * latency, 0.0),
        "reduce_bandwidth_ratio": reduce_bandwidth / bandwidth,
        "all_reduce_bandwidth_ratio": all_reduce_bandwidth / bandwidth,
    }


def link_timings(rounds_by_link: dict[str, Any], pick: Callable[[list[float]], float]) -> dict[str, Any]:
    """``(bytes, seconds)`` per link and size from each size's seconds over the sweeps (``link_rounds``), one
    value picked from them: their median, for the fit, or one sweep's, for its spread."""
    return {name: [(b, pick(seconds)) for b, seconds in by_size] for name, by_size in rounds_by_link.items()}


def link_spread(rounds_by_link: dict[str, Any], group_size: int) -> dict[str, tuple[float, float]]:
    """Each link term's lowest and highest value fitted on one sweep of the links alone (``link_rounds``): how far
    the calibration's own repetitions disagree, beside the terms fitted on their medians."""
    rounds = len(rounds_by_link["p2p"][0][1])
    fits = [
        link_terms(link_timings(rounds_by_link, lambda seconds, r=r: seconds[r]), group_size) for r in range(rounds)
    ]
    return {term: (min(f[term] for f in fits), max(f[term] for f in fits)) for term in fits[0]}


def calibrate(
    devices: int,
    group_size: int = 2,
    memory_bytes: int | None = None,
    inter_node_bandwidth: float | None = None,
    repeats: int = 10,
    runtime: bool = True,
    link_rounds: int = 3,
) -> tuple[Cluster, dict[str, Any]]:
    """Measure ``devices`` local processes; return the cluster and the raw timings, with ``link_spread`` (each
    link term's range over the ``link_rounds`` sweeps, the terms being fitted on each size's median over them)
    and, with the runtime, ``runtime_spread`` (each runtime cost's range over the layouts' rounds).

    ``runtime=False`` leaves the runtime's per-action and per-step costs at 0 (links only: seconds, where the
    runtime's six emulated training jobs take minutes).
    """
    if devices < 2 or not 2 <= group_size <= devices:
        raise ValueError("calibration needs at least 2 devices and a group size between 2 and the device count")
    if link_rounds < 1:
        raise ValueError(f"calibration needs at least one round of the links, got {link_rounds}")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "timings.json")
        mp.spawn(_worker, args=(devices, _free_port(), out, repeats, group_size, link_rounds), nprocs=devices)
        timings = json.loads(Path(out).read_text())
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
        cluster, costs = measure_runtime(devices, cluster)
        timings["runtime"] = costs
        timings["runtime_spread"] = runtime_spread(costs)
    # the step's first gather and last reduction beside the step's host work as the runtime's costs price it
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "contended.json")
        args = (devices, _free_port(), out, repeats, group_size, cluster.step_overhead_s)
        mp.spawn(_contended_worker, args=args, nprocs=devices)
        timings.update(json.loads(Path(out).read_text()))
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
) -> tuple[Cluster, list[dict[str, Any]]]:
    """The runtime's own cost per schedule action and per step at ``devices`` processes, added to ``links``.

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
    from lightning_bfpp.measure.emulated import EmulatedNet
    from lightning_bfpp.measure.profile import profile_module

    if rounds < 1:
        raise ValueError(f"measure_runtime needs at least one round, got {rounds}")
    with one_thread():
        batch = (torch.randn(1, RUNTIME_MODEL.activation_numel),)
        profile = profile_module(EmulatedNet(RUNTIME_MODEL), batch, repeats=7)
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
            runs[i].append(run_emulated(config, model, steps, devices))
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


def runtime_spread(rows: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """The runtime's costs fitted on each round alone (round ``r`` of every layout, which ran one after another)
    instead of on the layouts' medians over the rounds: each cost's lowest and highest value, how far the
    calibration's own repetitions disagree. From :func:`measure_runtime`'s rows: the two unreplicated layouts
    first, the two replicated ones (with ``data_parallel_action_overhead_s``) where measured."""
    rounds = min(len(row["rounds_s"]) for row in rows)
    fits: dict[str, list[float]] = {"action_overhead_s": [], "step_overhead_s": []}
    for r in range(rounds):
        this_round = [{**row, "measured_s": row["rounds_s"][r]} for row in rows]
        per_action, per_step = fit_runtime_costs(this_round[:2])
        fits["action_overhead_s"].append(per_action)
        fits["step_overhead_s"].append(per_step)
        replicated = [row for row in this_round if "data_parallel_action_overhead_s" in row]
        if replicated:
            cost = data_parallel_action_cost(replicated, per_action)
            fits.setdefault("data_parallel_action_overhead_s", []).append(cost)
    return {term: (min(values), max(values)) for term, values in fits.items()}


def _runtime_row(config: Plan, rounds_s: list[float], profile: ModelProfile, links: Cluster) -> dict[str, Any]:
    """One layout's calibration row: its actions per rank, its median step over the rounds, and its simulated step
    with the weights of each runtime cost (:func:`cost_weights`)."""
    return {
        "actions": 2 * config.stages_per_rank * config.num_microbatches,
        "measured_s": statistics.median(rounds_s),
        "rounds_s": rounds_s,
        **cost_weights(config, profile, links),
    }


def _tensor_cost(
    config: Plan, profile: ModelProfile, cluster: Cluster, measured: float, probe_s: float = 1e-3
) -> dict[str, float]:
    """The fixed cost per tensor all-reduce that makes the simulated step of ``config`` the measured one."""
    free_cluster = replace(cluster, tensor_collective_overhead_s=0.0)
    # the step with free tensor all-reduces, and the all-reduces on its critical path
    free, weight = sensitivity(config, profile, free_cluster, "tensor_collective_overhead_s", probe_s)
    return {
        "tensor_all_reduces": weight,
        "measured_s": measured,
        "simulated_s": free,
        "tensor_collective_overhead_s": max((measured - free) / weight, 0.0),
    }


def data_parallel_action_cost(rows: list[dict[str, Any]], per_action: float) -> float:
    """The cost per action on a replicated stage beyond ``per_action`` (the unreplicated layouts'), from the two
    replicated layouts' rows (:func:`cost_weights`): how much more the second step has beyond its simulated one
    than the first, per action more on its critical path, less ``per_action``; not below 0.

    A constant per step cancels in the difference, which is why the fit is not :func:`fit_runtime_costs`': the
    simulator hides the step's host work behind the first stage's gather, so both steps' ``step_weight`` is 0
    at these weights, while the optimizer's and FSDP2's own per-step work still reaches the measured steps.
    """
    few, many = rows
    actions = many["action_weight"] - few["action_weight"]
    if actions <= 0:
        raise ValueError("the second replicated layout must have more actions on its critical path than the first")
    extra = (many["measured_s"] - many["simulated_s"]) - (few["measured_s"] - few["simulated_s"])
    return max(extra / actions - per_action, 0.0)


def cost_weights(config: Plan, profile: ModelProfile, links: Cluster, probe_s: float = 1e-3) -> dict[str, float]:
    """The simulated step of ``config`` without runtime costs, and how much it grows per second of runtime cost
    per action (``action_weight``: about the actions on the critical path) and per step (``step_weight``).

    The fit must charge the costs as the simulation will: every action on the critical path pays the cost per
    action, and with ``p`` ranks that path holds about ``2(m·v + p − 1)`` actions, not a rank's ``2·m·v``.
    Fitting against a rank's own count put the cost per action about 12% high (3.44 against 3.06 ms on the
    same 8-process measurements).
    """
    base, action_weight = sensitivity(config, profile, links, "action_overhead_s", probe_s)
    _, step_weight = sensitivity(config, profile, links, "step_overhead_s", probe_s)
    return {"simulated_s": base, "action_weight": action_weight, "step_weight": step_weight}


def sensitivity(
    config: Plan, profile: ModelProfile, cluster: Cluster, field: str, probe_s: float = 1e-3
) -> tuple[float, float]:
    """The simulated step of ``config`` on ``cluster``, and how much it grows per second added to the cluster's
    cost ``field`` (the step is linear in each such cost while the critical path stays the same)."""
    base = simulate(config, profile, cluster).step_time
    probed = simulate(config, profile, replace(cluster, **{field: getattr(cluster, field) + probe_s})).step_time
    return base, (probed - base) / probe_s


def fit_runtime_costs(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """``(per action, per step)`` seconds, neither below 0, from two runs' measured and simulated steps: the
    measured excess is ``step_weight × per_step + action_weight × per_action`` (see :func:`cost_weights`;
    without weights, one per step and ``actions`` per rank). Where the exact solution has a negative cost,
    that cost is 0 and the other is the least-squares fit over both runs."""
    extra = [r["measured_s"] - r["simulated_s"] for r in rows]
    a = [r.get("action_weight", r["actions"]) for r in rows]
    b = [r.get("step_weight", 1.0) for r in rows]
    det = a[0] * b[1] - a[1] * b[0]
    if abs(det) < 1e-12:
        raise ValueError("the two runs must differ in how their steps grow with the cost per action and per step")
    per_action = (extra[0] * b[1] - extra[1] * b[0]) / det
    per_step = (a[0] * extra[1] - a[1] * extra[0]) / det
    if per_step < 0:
        per_action, per_step = _least_squares(a, extra), 0.0
    elif per_action < 0:
        per_action, per_step = 0.0, _least_squares(b, extra)
    return max(per_action, 0.0), max(per_step, 0.0)


def _least_squares(weights: list[float], extra: list[float]) -> float:
    """The ``x`` minimising ``Σ (weight·x − extra)²``."""
    return sum(w * e for w, e in zip(weights, extra, strict=True)) / sum(w * w for w in weights)


def run_emulated(
    config: Plan, model: EmulatedModel, steps: int, devices: int, processes_per_node: int | None = None
) -> float:
    """Train ``config`` on ``model`` with ``BFPPStrategy`` in a job of its own; the median step time (s).

    ``processes_per_node`` lays the processes out as nodes of that many (hybrid sharding, weight passing)."""
    return run_emulated_many([(config, model)], steps, devices, processes_per_node)[0]


def run_emulated_auto(
    config: Plan, model: EmulatedModel, steps: int, devices: int, cluster: Cluster
) -> tuple[float, Plan, float]:
    """Train ``model`` with ``BFPPStrategy(pipeline_parallel_size="auto")`` (and ``config``'s schedule,
    sharding, stages per rank, micro-batches and tensor size) on ``cluster``, in a job of its own: the median
    step time (s), the layout the planner chose, and the step it predicted for it (s)."""
    job = _emulated_job([(config, model)], steps, devices, None, auto_cluster=asdict(cluster))
    run = job[0]
    return float(run["step_time"]), Plan(**run["chosen"]), float(run["predicted_step_time"])


def run_emulated_many(
    runs: Sequence[tuple[Plan, EmulatedModel]],
    steps: int,
    devices: int,
    processes_per_node: int | None = None,
) -> list[float]:
    """Train each ``(config, model)`` of ``runs`` with ``BFPPStrategy``, one after the other in the same
    ``devices`` processes (one start-up for all: a start costs more than a few steps on a few cores); the median
    step time (s) of each."""
    return [float(run["step_time"]) for run in _emulated_job(runs, steps, devices, processes_per_node)]


def _emulated_job(
    runs: Sequence[tuple[Plan, EmulatedModel]],
    steps: int,
    devices: int,
    processes_per_node: int | None,
    auto_cluster: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    # one intra-op thread per process, as torchrun sets: with the default (every core per process) a host-side
    # op on an activation (the emulated layer's add, a loss) spins all processes' threads against each other
    # and costs milliseconds per MiB, which an accelerator's host never pays
    env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "steps.json"
        job = {
            "runs": [{"config": asdict(config), "model": asdict(model)} for config, model in runs],
            "steps": steps,
            "devices": devices,
            "processes_per_node": processes_per_node,
            "auto_cluster": auto_cluster,
        }
        cmd = [sys.executable, "-m", "lightning_bfpp.measure.calibrate", json.dumps(job), str(out)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            described = "; ".join(config.describe() for config, _ in runs)
            raise RuntimeError(f"the emulated runs ({described}) failed:\n{proc.stderr[-3000:]}")
        return list(json.loads(out.read_text()))


def _train_emulated(job: dict[str, Any], out: Path) -> None:
    """One emulated training job (``run_emulated_many``'s child process): Lightning starts the other processes,
    which run the same runs in the same order."""
    results = [_train_one(Plan(**run["config"]), EmulatedModel(**run["model"]), job) for run in job["runs"]]
    if results[0] is not None:  # global rank 0 measured
        out.write_text(json.dumps(results))


def _train_one(config: Plan, model: EmulatedModel, job: dict[str, Any]) -> dict[str, Any] | None:
    import lightning as L

    from lightning_bfpp import BFPPStrategy
    from lightning_bfpp.measure.emulated import EmulatedNet, emulated_loader

    steps = int(job["steps"])
    starts: list[float] = []

    class StepTimes(L.Callback):
        def on_train_batch_start(self, *args: object) -> None:
            starts.append(time.perf_counter())

        def on_train_end(self, *args: object) -> None:
            starts.append(time.perf_counter())

    auto = job.get("auto_cluster")
    arguments = config.kind.arguments(config)  # the strategy arguments that lay the plan out
    if auto:
        arguments["pipeline_parallel_size"] = "auto"
    strategy = BFPPStrategy(
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


if __name__ == "__main__":
    _train_emulated(json.loads(sys.argv[1]), Path(sys.argv[2]))
