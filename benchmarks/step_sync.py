"""The step's one collective, as the rank that arrives last sees it: gloo's all-gather against its all-to-all.

    python benchmarks/step_sync.py                  # 4 processes, the last arriving 4 ms late: about 20 s
    python benchmarks/step_sync.py --processes 2

``LoggedValueSync`` exchanges one small row per rank after every step. The pipeline's first rank arrives
last (its last backward ends the step), and the time it spends in the exchange is on the critical path of
the next step. Each process sends the row ``LoggedValueSync`` sends (float64, header plus 8 values); every
iteration lines the ranks up with a barrier, holds rank 0 back ``--late-ms``, and times rank 0's call. The
two kinds alternate in blocks, so drift in the machine's load hits both. Prints rank 0's median and 90th
percentile per kind, in ms.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROW = 6 + 8  # LoggedValueSync's header and initial capacity
KINDS = ("all_gather", "all_to_all")


def _exchange(kind: str, row: torch.Tensor, world: int) -> torch.Tensor:
    out = torch.empty(world * row.numel(), dtype=row.dtype)
    if kind == "all_gather":
        dist.all_gather_single(out, row)  # what LoggedValueSync called before
    else:
        dist.all_to_all_single(out, row.repeat(world))
    return out.view(world, -1)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, results: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for block in range(args.blocks):
        for kind in KINDS if block % 2 == 0 else KINDS[::-1]:
            for i in range(args.iters):
                dist.barrier()
                if rank == 0:
                    time.sleep(args.late_ms / 1e3)
                row = torch.full((ROW,), float(rank), dtype=torch.float64)
                start = time.perf_counter()
                rows = _exchange(kind, row, world)
                elapsed = time.perf_counter() - start
                if not torch.equal(rows[:, 0], torch.arange(world, dtype=torch.float64)):
                    raise AssertionError(f"{kind} delivered the wrong rows")
                if i >= 2:  # the first calls of a block set up connections
                    times[kind].append(1e3 * elapsed)
    if rank == 0:
        results.put({kind: (statistics.median(v), statistics.quantiles(v, n=10)[8]) for kind, v in times.items()})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--late-ms", type=float, default=4.0, help="how long after the others rank 0 arrives")
    parser.add_argument("--blocks", type=int, default=4, help="alternating blocks per kind")
    parser.add_argument("--iters", type=int, default=40, help="calls per block")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    processes = [
        ctx.Process(target=_worker, args=(r, args.processes, port, args, results)) for r in range(args.processes)
    ]
    for p in processes:
        p.start()
    measured = results.get(timeout=600)
    for p in processes:
        p.join()
    print(
        f"{args.processes} gloo processes, rank 0 arriving {args.late_ms:g} ms after the others; its time in the call:"
    )
    for kind, (median, p90) in measured.items():
        print(f"  {kind:<11} median {median:.2f} ms, 90th percentile {p90:.2f} ms")


if __name__ == "__main__":
    main()
