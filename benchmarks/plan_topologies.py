"""Which schedule wins where: weight passing against breadth-first, 1F1B and hybrid sharding, on paper.

    python benchmarks/plan_topologies.py            # Markdown tables (pure computation, well under a minute)

A LLaMA-style 10B model (TawPipe's: 48 layers, hidden 4096) at sequence lengths 2k–32k on 2, 4 and 8 nodes
of 8 GPUs, over a slow inter-node network (10 GbE, TawPipe's) and a fast one (InfiniBand 4×200 Gb/s per
node); then one node, and growing batches. For each case, the fastest feasible configuration the planner
(``lightning_bfpp.plan``) finds in each family, as predicted tokens per second per GPU. Every number rests
on the assumptions printed with it; docs/weight-passing.md discusses them.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# the planner is pure Python; skip the package's __init__, which imports torch and Lightning (seconds)
if "lightning_bfpp" not in sys.modules:
    _package = types.ModuleType("lightning_bfpp")
    _package.__path__ = [str(ROOT / "lightning_bfpp")]
    sys.modules["lightning_bfpp"] = _package

from lightning_bfpp.plan import Candidate, Cluster, ModelProfile, SearchSpace, gpt, search  # noqa: E402
from lightning_bfpp.plan.schedules.weight_passing import WeightPassingOptions  # noqa: E402

LAYERS, HIDDEN, VOCAB = 48, 4096, 32000
PEAK, MFU = 312e12, 0.5  # A100 bf16 dense peak, sustained fraction
GPUS_PER_NODE = 8
MEMORY = 80 * 2**30
TOKENS_PER_GPU = 65536  # per optimizer step: the global batch is this times the GPU count
SEQUENCES = (2048, 4096, 8192, 16384, 32768)
NODES = (2, 4, 8)
WP = "weight passing"


@dataclass(frozen=True)
class Network:
    name: str
    intra: float  # bytes/s per GPU inside a node (collective bus bandwidth)
    node: float  # bytes/s per node across nodes, each way
    rail: float  # bytes/s one GPU reaches across nodes while the others of its node are quiet
    latency_s: float


NETWORKS = (
    Network("10 GbE (TawPipe's testbed)", 150e9, 1.25e9, 1.25e9, 25e-6),
    Network("InfiniBand 4×200 Gb/s", 150e9, 80e9, 20e9, 5e-6),
)

# the families compared: (label, schedules, shardings, pipeline sizes, stages per rank)
FAMILIES = (
    ("breadth-first, p≥2", ("breadth_first",), ("full_shard", "hybrid_shard"), (2, 4, 8), (1, 2, 4)),
    ("1F1B, p≥2", ("1f1b",), ("no_shard", "full_shard", "hybrid_shard"), (2, 4, 8), (1,)),
    ("hybrid_shard, p=1", ("breadth_first", "1f1b"), ("hybrid_shard",), (1,), (1, 2, 4, 8)),
    ("full_shard, p=1", ("breadth_first", "1f1b"), ("full_shard",), (1,), (1, 2, 4, 8)),
    (WP, ("weight_passing",), ("full_shard",), (1,), (1,)),
    ("WP staggered*", ("weight_passing",), ("full_shard",), (1,), (1,)),
)


def profiles(sequence: int) -> list[ModelProfile]:
    """The model with and without activation recomputation (weight passing always recomputes)."""
    return [
        replace(
            gpt(LAYERS, HIDDEN, sequence, VOCAB, flops_per_second=PEAK * MFU, recompute=r, flash_attention=True),
            optimizer_state_ratio=6.0,
            name=f"llama-10b s={sequence}" + (" recompute" if r else ""),
        )
        for r in (True, False)
    ]


def cluster(nodes: int, network: Network) -> Cluster:
    return Cluster(
        num_devices=nodes * GPUS_PER_NODE,
        devices_per_node=GPUS_PER_NODE,
        memory_bytes=MEMORY,
        intra_node_bandwidth=network.intra,
        inter_node_bandwidth=network.node / GPUS_PER_NODE,
        inter_node_rail_bandwidth=network.rail,
        latency_s=network.latency_s,
        overlap_reductions=True,
    )


def _microbatches(per_replica: int, p: int, every: bool) -> tuple[int, ...]:
    """Micro-batch counts tried: every power of two for weight passing (each micro-batch fetches every chunk
    again, so it wants the fewest that fit); for the others the largest up to ``16·max(p, 2)`` (with compute
    scaled linearly, more micro-batches only shrink the bubble and the activations held; capped to keep the
    simulations quick)."""
    counts = [m for m in range(1, per_replica + 1) if per_replica % m == 0 and m & (m - 1) == 0]
    return tuple(counts) if every else tuple([m for m in counts if m <= 16 * max(p, 2)][-1:])


Best = tuple[Candidate, bool]  # the fastest configuration of a family, and whether it recomputes activations


def best(family: tuple, sequence: int, cl: Cluster, tokens_per_gpu: int = TOKENS_PER_GPU) -> Best | str:
    """The fastest feasible configuration of ``family``, or why none is."""
    label, schedules, shardings, sizes, stages = family
    batch = tokens_per_gpu * cl.num_devices // sequence
    found: list[Best] = []
    rejected: list[Candidate] = []
    passing = schedules == ("weight_passing",)
    # breadth-first holds every micro-batch's activations: without recomputation it never fits here
    recompute_only = passing or ("breadth_first" in schedules and sizes != (1,))
    for profile in profiles(sequence)[: 1 if recompute_only else 2]:
        for p in sizes:
            dp = cl.num_devices // p
            if batch % dp:
                continue
            space = SearchSpace(
                schedules=schedules,
                shardings=shardings,
                pipeline_sizes=(p,),
                stages_per_rank=stages,
                num_microbatches=_microbatches(batch // dp, p, passing),
                options={"weight_passing": (WeightPassingOptions(stagger=label.endswith("*")),)},
            )
            for c in search(profile, cl, batch, space):
                if c.infeasible:
                    rejected.append(c)
                else:
                    found.append((c, profile.recompute))
    if found:
        return min(found, key=lambda found: found[0].prediction.step_time)
    if any(c.infeasible.startswith("memory") for c in rejected):
        return "out of memory"
    if any("lies in one node" in c.infeasible for c in rejected):
        return "= full_shard (one node)"
    return rejected[0].infeasible if rejected else "no configuration"


def short(found: Best) -> str:
    c, recompute = found
    cfg = c.config
    if cfg.schedule == "weight_passing":
        return f"m={cfg.num_microbatches}×{cfg.microbatch_size}"
    sharding = {"full_shard": "full", "hybrid_shard": "hybrid", "no_shard": "none"}.get(cfg.sharding, cfg.sharding)
    kind = {"breadth_first": "bf", "1f1b": "1f1b"}[cfg.schedule]
    pipe = f"p={cfg.pipeline_parallel_size} " if cfg.pipeline_parallel_size > 1 else ""
    order = " x-node" if cfg.pipeline_parallel_size > 1 and cfg.mesh_order == "pipeline_data" else ""
    stages = f" v={cfg.stages_per_rank}" if cfg.schedule == "breadth_first" else ""
    return (
        f"{kind} {pipe}m={cfg.num_microbatches}×{cfg.microbatch_size}{stages} {sharding}{order}"
        f"{' rc' if recompute else ''}"
    )


def row(cases: dict[str, Best | str], tokens_per_gpu: int) -> list[str]:
    rate = {k: tokens_per_gpu / c[0].prediction.step_time for k, c in cases.items() if isinstance(c, tuple)}
    cells = [f"{rate[k]:,.0f} ({short(c)})" if isinstance(c, tuple) else c for k, c in cases.items()]
    runtime = {k: v for k, v in rate.items() if not k.endswith("*")}  # what the runtime can run
    winner = max(runtime, key=runtime.__getitem__) if runtime else "—"
    others = {k: v for k, v in runtime.items() if k != WP}
    if WP in rate and others:
        rival = max(others, key=others.__getitem__)
        verdict = f"{rate[WP] / others[rival]:.2f}× ({rival})"
    else:
        verdict = "—"
    return [*cells, winner, verdict]


def table(title: str, rows: list[tuple[str, int, Cluster, int]]) -> None:
    labels = [f[0] for f in FAMILIES]
    print(f"\n### {title}\n")
    print("| GPUs | sequence | " + " | ".join(labels) + " | fastest (runtime) | weight passing ÷ best other |")
    print("|" + "---|" * (len(labels) + 4))
    for what, sequence, cl, tokens in rows:
        cases = {f[0]: best(f, sequence, cl, tokens) for f in FAMILIES}
        print(f"| {what} | {sequence // 1024}k | " + " | ".join(row(cases, tokens)) + " |")


def main() -> None:
    profile = profiles(2048)[0]
    print(
        f"LLaMA-style model: {LAYERS} layers, hidden {HIDDEN}, vocabulary {VOCAB}:"
        f" {profile.param_bytes / 2 / 1e9:.1f}B parameters as {profile.num_layers} pipeline layers;"
        f" {PEAK * MFU / 1e12:.0f} TFLOP/s sustained per GPU ({MFU:.0%} of {PEAK / 1e12:.0f}),"
        f" {MEMORY / 2**30:.0f} GiB;"
        f" {GPUS_PER_NODE} GPUs per node; {TOKENS_PER_GPU:,} tokens per GPU per step; bf16 weights and"
        " gradients, fp32 Adam (16 bytes per parameter); FlashAttention activations. Cells: predicted tokens/s"
        " per GPU (configuration: bf = breadth-first, x-node = pipeline across nodes, rc = activation recomputation)."
        " * not implemented by the runtime."
    )
    for network in NETWORKS:
        rows = [
            (f"{nodes}×{GPUS_PER_NODE}", s, cluster(nodes, network), TOKENS_PER_GPU)
            for nodes in NODES
            for s in SEQUENCES
        ]
        table(
            f"{network.name}: {network.node / 1e9:g} GB/s per node, {network.rail / 1e9:g} GB/s for one GPU,"
            f" {network.intra / 1e9:g} GB/s inside a node",
            rows,
        )
    tawpipe = cluster(3, NETWORKS[0])
    table("TawPipe's own setting: 3 nodes of 8, 10 GbE, 16k sequences", [("3×8", 16384, tawpipe, TOKENS_PER_GPU)])
    one = cluster(1, NETWORKS[0])
    table("One node of 8 GPUs (no inter-node traffic)", [("1×8", s, one, TOKENS_PER_GPU) for s in SEQUENCES])
    for network in NETWORKS:
        cl = cluster(4, network)
        rows = [(f"4×8, {t // 1024}k tokens/GPU", 8192, cl, t) for t in (16384, 65536, 262144, 1048576)]
        table(f"More micro-batches per step: 4 nodes, 8k sequences, {network.name}", rows)


if __name__ == "__main__":
    main()
