"""The planner's predictions for the paper's headline regime: a 52B-parameter GPT on 64 GPUs, small batches.

    python benchmarks/plan_52b.py            # a markdown table per assumption set (a minute or two)
    python benchmarks/plan_52b.py --tensor-parallel   # breadth-first + full sharding alone against 3D

For each global batch size, the fastest feasible configuration of each schedule (over pipeline size,
stages per rank, micro-batches, sharding, mesh order and, for depth-first, the group size), as predicted
by ``lightning_bfpp.plan``. Every number rests on the assumptions printed with it; see docs/planner.md.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_bfpp.plan import Cluster, SearchSpace, gpt, search

MODEL = dict(num_layers=64, hidden=8192, sequence=2048, vocab=51200)
FLOPS = 312e12 * 0.5  # A100 bf16 peak at 50% utilisation
CLUSTER = Cluster(
    num_devices=64,
    devices_per_node=8,
    memory_bytes=80 * 2**30,
    intra_node_bandwidth=200e9,
    inter_node_bandwidth=25e9,
    latency_s=10e-6,
)
BATCHES = (32, 64, 128, 256, 512)
# depth-first in Megatron's default order (group size N = p), and with N tuned (up to N = m, where its
# forward order becomes breadth-first's); GPipe is left out: 1F1B's step time with more memory
ROWS = {
    "breadth_first": ("breadth_first", "all"),
    "breadth_first_zb": ("breadth_first_zb", "all"),
    "depth_first (N = p)": ("depth_first", "pipeline"),
    "depth_first (N tuned)": ("depth_first", "all"),
    "1f1b": ("1f1b", "all"),
}


def best_per_schedule(overlap: bool) -> dict[int, dict[str, object]]:
    profile = replace(gpt(**MODEL, flops_per_second=FLOPS, recompute=True), optimizer_state_ratio=6.0)
    cluster = replace(CLUSTER, overlap_reductions=overlap)
    table: dict[int, dict[str, object]] = {}
    for batch in BATCHES:
        table[batch] = {}
        for row, (schedule, groups) in ROWS.items():
            space = SearchSpace(
                schedules=(schedule,), pipeline_sizes=(4, 8, 16, 32), stages_per_rank=(1, 2, 4, 8), group_sizes=groups
            )
            feasible = [c for c in search(profile, cluster, batch, space) if c.infeasible is None]
            table[batch][row] = feasible[0] if feasible else None
    return table


PIPELINES = (4, 8, 16, 32)  # as in the tables above; `--no-pipeline-floor` adds 1 and 2 (sharding alone)


def tensor_parallel_rows(overlap: bool = True) -> None:
    """Breadth-first with full sharding alone against 3D (tensor groups of 2, 4, 8 inside a node), per batch:
    the fastest feasible configuration of each tensor size."""
    profile = replace(gpt(**MODEL, flops_per_second=FLOPS, recompute=True), optimizer_state_ratio=6.0)
    cluster = replace(CLUSTER, overlap_reductions=overlap)
    print("\n| global batch (per GPU) | tensor size | fastest feasible configuration | step (s) | tokens/s/GPU |"
          " peak memory (GiB) | against t=1 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for batch in BATCHES:
        alone = None
        for t in (1, 2, 4, 8):
            space = SearchSpace(
                schedules=("breadth_first",), shardings=("full_shard",), pipeline_sizes=PIPELINES,
                stages_per_rank=(1, 2, 4, 8), tensor_parallel_sizes=(t,),
            )  # fmt: skip
            feasible = [c for c in search(profile, cluster, batch, space) if c.infeasible is None]
            if not feasible:
                print(f"| {batch} ({batch / 64:g}) | {t} | none feasible | | | | |")
                continue
            pred = feasible[0].prediction
            alone = alone or pred
            tokens = batch * MODEL["sequence"] / pred.step_time / 64
            print(
                f"| {batch} ({batch / 64:g}) | {t} | {feasible[0].config.describe()} | {pred.step_time:.2f} |"
                f" {tokens:,.0f} | {pred.peak_memory / 2**30:.1f} | {alone.step_time / pred.step_time - 1:+.0%} |"
            )


def main() -> None:
    if "--tensor-parallel" in sys.argv:
        if "--no-pipeline-floor" in sys.argv:
            global PIPELINES
            PIPELINES = (1, 2, 4, 8, 16, 32)
        tensor_parallel_rows()
        return
    profile = gpt(**MODEL, flops_per_second=FLOPS)
    print(
        f"GPT: {MODEL['num_layers']} layers, hidden {MODEL['hidden']}, sequence {MODEL['sequence']},"
        f" vocabulary {MODEL['vocab']}: {profile.param_bytes / 2 / 1e9:.1f}B parameters; 64 GPUs, 8 per node,"
        f" 80 GiB, {FLOPS / 1e12:.0f} TFLOP/s sustained, 200 GB/s in a node, 25 GB/s between nodes;"
        " bf16 weights and gradients, fp32 Adam state (12 bytes per parameter), full recomputation"
    )
    for overlap in (False, True):
        how = "overlapping later compute (BFPPStrategy on CUDA)" if overlap else "holding up compute (torch's)"
        print(f"\n### gradient reductions {how}\n")
        print()
        print("|---|---|---|---|---|---|---|")
        for batch, rows in best_per_schedule(overlap).items():
            bf = rows["breadth_first"]
            for schedule, c in rows.items():
                if c is None:
                    print(f"| {batch} ({batch / 64:g}) | {schedule} | none feasible | | | | |")
                    continue
                pred = c.prediction
                tokens = batch * MODEL["sequence"] / pred.step_time / 64
                ratio = bf.prediction.throughput / pred.throughput if bf else float("nan")
                print(
                    f"| {batch} ({batch / 64:g}) | {schedule} | {c.config.describe()} | {pred.step_time:.2f} |"
                    f" {tokens:,.0f} | {pred.bubble_fraction:.1%} |"
                    f" {'' if schedule == 'breadth_first' else f'{ratio - 1:+.0%}'} |"
                )


if __name__ == "__main__":
    main()
