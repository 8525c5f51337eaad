"""The calibration's link measurements, each in ``devices`` processes of its own (gloo on CPU, NCCL on GPUs).

:func:`measure_links`: ping-pong transfers between two processes, and all-gathers, reduce-scatters and
all-reduces within a group of ``group_size``, each size of :data:`SIZES` swept ``rounds`` times (the other
processes idle, as most ranks' links are during a real step); then a tensor group's all-reduce as a step runs
it (:func:`_tensor_all_reduce`). :func:`measure_contended`: the step's first gather and last reduction, every
group at once beside the step's host work (:func:`_contended`). Each returns the timings rank 0 wrote; the
fitting is :mod:`lightning_bfpp.measure.fitting`'s.

Every process runs one intra-op thread, as the training processes do (:func:`_join`); the package's launcher
(:mod:`~lightning_bfpp.measure.launcher`) starts them.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_bfpp.measure import launcher

SIZES = (4 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
LINKS = ("p2p", "all_gather", "reduce_scatter", "all_reduce")
# the step's first gather and last reduction, as a step issues them: a stage's weights (the largest of SIZES), where
# contention shows
CONTENDED_BYTES = SIZES[-1]
# a tensor-parallel all-reduce of one small activation: its fixed cost is what matters
TENSOR_ALL_REDUCE_BYTES = 4 << 10


def measure_links(devices: int, group_size: int, repeats: int, rounds: int) -> dict[str, Any]:
    """The links' timings at ``devices`` processes: ``link_rounds`` (per link, each size's seconds over the
    ``rounds`` sweeps) and ``tensor_all_reduce`` (``[(bytes, seconds)]``, or empty where no group fits)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "timings.json")
        _launch("_worker", devices, Path(tmp), (out, repeats, group_size, rounds))
        return dict(json.loads(Path(out).read_text()))


def measure_contended(devices: int, group_size: int, repeats: int, host_s: float) -> dict[str, Any]:
    """The step's ``first_gather`` and ``last_reduce`` at ``devices`` processes (each ``[(bytes, seconds)]``),
    every process doing ``host_s`` of host work beside them."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "contended.json")
        _launch("_contended_worker", devices, Path(tmp), (out, repeats, group_size, host_s))
        return dict(json.loads(Path(out).read_text()))


def _launch(worker: str, devices: int, folder: Path, args: tuple[Any, ...]) -> None:
    """Run this module's ``worker`` on ``devices`` new interpreters (the caller may have used torch already, so
    the ranks are not forked from it); raise with the failed rank's output if one fails."""
    result = launcher.launch(f"{__name__}:{worker}", devices, folder, args=args, start="spawn")
    if not result.ok:
        raise RuntimeError(f"the link measurement on {devices} processes failed: {result.report()}")


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


def _join(rank: int) -> tuple[torch.device, int, bool]:
    """Join the measuring processes' group (the launcher's ``MASTER_*`` and ``WORLD_SIZE``); this process's device,
    the world size, and whether it is a GPU."""
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)  # as the training processes (run_emulated): gloo's CPU work is not oversubscribed
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    return device, world, cuda


def _worker(rank: int, out: str, repeats: int, group_size: int, rounds: int) -> None:
    device, world, cuda = _join(rank)
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


def _contended_worker(rank: int, out: str, repeats: int, group_size: int, host_s: float) -> None:
    device, world, cuda = _join(rank)
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
