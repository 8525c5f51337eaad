"""The step's one collective, as the rank that arrives last sees it: gloo's all-gather against its all-to-all.

    python benchmarks/step_sync.py                  # 4 processes, the last arriving 4 ms late: about 20 s
    python benchmarks/step_sync.py --processes 2

``LoggedValueSync`` exchanges one small row per rank after every step. The pipeline's first rank arrives
last (its last backward ends the step), and the time it spends in the exchange is on the critical path of
the next step. Each process sends the row ``LoggedValueSync`` sends (float64, header plus 8 values); every
iteration lines the ranks up with a barrier, holds rank 0 back ``--late-ms``, and times rank 0's call. The
two kinds alternate in blocks, so drift in the machine's load hits both. Prints rank 0's median and 90th
percentile per kind, in ms. The processes are started by the package's launcher (``lightning_bfpp.measure.launcher``)
as new interpreters with one intra-op thread each; they meet through its ``MASTER_ADDR``/``MASTER_PORT``, and
rank 0 writes its timings to the launch's folder for this process to print.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_bfpp.measure import launcher

ROW = 6 + 8  # LoggedValueSync's header and initial capacity
KINDS = ("all_gather", "all_to_all")


def _exchange(kind: str, row: torch.Tensor, world: int) -> torch.Tensor:
    out = torch.empty(world * row.numel(), dtype=row.dtype)
    if kind == "all_gather":
        dist.all_gather_single(out, row)  # what LoggedValueSync called before
    else:
        dist.all_to_all_single(out, row.repeat(world))
    return out.view(world, -1)


def _worker(rank: int, late_ms: float, blocks: int, iters: int, folder: str) -> None:
    """One process, started by the launcher (its world and rendezvous in the environment); rank 0 writes its
    median and 90th percentile per kind to ``folder/rank0.json``."""
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for block in range(blocks):
        for kind in KINDS if block % 2 == 0 else KINDS[::-1]:
            for i in range(iters):
                dist.barrier()
                if rank == 0:
                    time.sleep(late_ms / 1e3)
                row = torch.full((ROW,), float(rank), dtype=torch.float64)
                start = time.perf_counter()
                rows = _exchange(kind, row, world)
                elapsed = time.perf_counter() - start
                if not torch.equal(rows[:, 0], torch.arange(world, dtype=torch.float64)):
                    raise AssertionError(f"{kind} delivered the wrong rows")
                if i >= 2:  # the first calls of a block set up connections
                    times[kind].append(1e3 * elapsed)
    if rank == 0:
        measured = {kind: (statistics.median(v), statistics.quantiles(v, n=10)[8]) for kind, v in times.items()}
        (Path(folder) / f"rank{rank}.json").write_text(json.dumps(measured))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--late-ms", type=float, default=4.0, help="how long after the others rank 0 arrives")
    parser.add_argument("--blocks", type=int, default=4, help="alternating blocks per kind")
    parser.add_argument("--iters", type=int, default=40, help="calls per block")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # new interpreters, as the training processes whose exchange this times
        work = (args.late_ms, args.blocks, args.iters, tmp)
        target = "benchmarks.step_sync:_worker"
        result = launcher.launch(target, args.processes, Path(tmp), args=work, start="spawn", timeout_s=600)
        if not result.ok:
            raise RuntimeError(f"the exchange on {args.processes} processes failed: {result.report()}")
        measured = json.loads((Path(tmp) / "rank0.json").read_text())
    print(
        f"{args.processes} gloo processes, rank 0 arriving {args.late_ms:g} ms after the others; its time in the call:"
    )
    for kind, (median, p90) in measured.items():
        print(f"  {kind:<11} median {median:.2f} ms, 90th percentile {p90:.2f} ms")


if __name__ == "__main__":
    main()
