"""Measure this machine's links for the planner: point-to-point and collective time against message size.

``python -m lightning_bfpp.plan calibrate --devices 4 --out cluster.json`` starts that many processes
(gloo on CPU, NCCL on GPUs), times ping-pong transfers between two of them and all-gathers and
reduce-scatters within a group of ``--group-size`` (the data-parallel size the plan will use), fits
``time = fixed + bytes / bandwidth`` for each and writes a :class:`~lightning_bfpp.plan.cluster.Cluster`.
The other processes stay idle, as most ranks' links are during a real step. One machine only shows its
intra-node links; the inter-node bandwidth is written equal to them unless given.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_bfpp.plan.cluster import Cluster

SIZES = (4 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)


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


def _worker(rank: int, world: int, port: int, out: str, repeats: int, group_size: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    group = dist.new_group(list(range(group_size)))
    p2p, gather, reduce = [], [], []
    for nbytes in SIZES:
        buf = torch.zeros(nbytes // 4, device=device)

        def ping_pong(buf: torch.Tensor = buf) -> None:
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        p2p.append((nbytes, _time(ping_pong, repeats, cuda) / 2))
        shard = torch.zeros(nbytes // 4 // group_size, device=device)
        full = torch.zeros(shard.numel() * group_size, device=device)

        def all_gather(full: torch.Tensor = full, shard: torch.Tensor = shard) -> None:
            if rank < group_size:
                dist.all_gather_into_tensor(full, shard, group=group)

        def reduce_scatter(full: torch.Tensor = full, shard: torch.Tensor = shard) -> None:
            if rank < group_size:
                dist.reduce_scatter_tensor(shard, full, group=group)

        gather.append((full.numel() * 4, _time(all_gather, repeats, cuda)))
        reduce.append((full.numel() * 4, _time(reduce_scatter, repeats, cuda)))
    if rank == 0:
        Path(out).write_text(json.dumps({"p2p": p2p, "all_gather": gather, "reduce_scatter": reduce}))
    dist.destroy_process_group()


def calibrate(
    devices: int,
    group_size: int = 2,
    memory_bytes: int | None = None,
    inter_node_bandwidth: float | None = None,
    repeats: int = 10,
) -> tuple[Cluster, dict[str, list[tuple[int, float]]]]:
    """Measure ``devices`` local processes; return the cluster and the raw timings."""
    if devices < 2 or not 2 <= group_size <= devices:
        raise ValueError("calibration needs at least 2 devices and a group size between 2 and the device count")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "timings.json")
        mp.spawn(_worker, args=(devices, _free_port(), out, repeats, group_size), nprocs=devices)
        timings = json.loads(Path(out).read_text())
    latency, p2p_bw = _fit([(b, t) for b, t in timings["p2p"]])
    # ring collective of B bytes over n ranks: fixed + (n−1)/n · B / bandwidth (all-gather and reduce-scatter)
    n = group_size
    points = [((n - 1) / n * b, t) for key in ("all_gather", "reduce_scatter") for b, t in timings[key]]
    fixed, bandwidth = _fit(points)
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
        intra_node_bandwidth=bandwidth,
        inter_node_bandwidth=inter_node_bandwidth or bandwidth,
        latency_s=latency,
        p2p_bandwidth_ratio=p2p_bw / bandwidth,
        collective_overhead_s=max(fixed - (n - 1) * latency, 0.0),
    )
    return cluster, timings
