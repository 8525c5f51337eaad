"""``sharding="hybrid_shard"``: ZeRO-3 inside a node, gradients all-reduced across nodes (FSDP2's HSDP).

One launch of 4 CPU processes laid out as 2 emulated nodes of 2 (``processes_per_node=2``), p=1, so the
data-parallel group of 4 is 2 replicas × 2 shards: shard groups {0, 1} and {2, 3}, replicate groups {0, 2}
and {1, 3}. Checked: training equals one device (fp32, every step's loss and the final parameters, 1e-5
relative, as in test_equivalence), also with parameters tied across stages and reductions on the
communication thread; a checkpoint written under hybrid sharding resumes exactly under another layout; the
bytes each collective moves per step, per process group; and the configuration error on every rank.
"""

from __future__ import annotations

import math
from collections import defaultdict

import pytest

from tests.distributed.harness import assert_params_match, assert_steps_match, launch, relative_error
from tests.models import RunSpec, make_model, reference_run

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

TOL = 1e-5
PER_NODE, SHARDS, NODES = 2, 2, 2  # processes per node; the shard group (a node's ranks); replicas (nodes)
HYBRID = {"pipeline_parallel_size": 1, "stages_per_rank": 2, "sharding": "hybrid_shard", "processes_per_node": 2}


def hybrid(name: str, m: int, model=None, strategy=None, **kwargs) -> RunSpec:
    return RunSpec(
        name=name,
        strategy={**HYBRID, "num_microbatches": m, **(strategy or {})},
        model={"optimizer": "sgd", **(model or {})},
        local_batch_size=2 * m,
        data_parallel_size=4,
        **kwargs,
    )


CKPT_MODEL = {"optimizer": "adamw", "param_groups": 2, "scheduler": "step"}
EPOCHS = {"data": {"num_samples": 48}}  # 3 steps of 16 samples per epoch (see test_checkpoint)
RUNS = [
    # the same model and steps with 2 and 4 micro-batches: the bytes per step must not change
    hybrid("hybrid_m2", 2, checks=["traffic"]),
    hybrid("hybrid_m4", 4, checks=["traffic"]),
    # a weight tied across the rank's two stages (summed over shards) and reductions on the communication thread
    hybrid("hybrid_tied_thread", 2, model={"tie_blocks": True}, strategy={"overlap_reductions": "thread"}),
    # one epoch under hybrid sharding, saved; the second epoch resumed at (p, dp) = (2, 2), full_shard
    hybrid(
        "hybrid_half",
        2,
        model=CKPT_MODEL,
        trainer={"max_epochs": 1, "max_steps": -1},
        checks=["save_at_end"],
        **EPOCHS,
    ),
    RunSpec(
        name="resume_p2_dp2",
        strategy={"pipeline_parallel_size": 2, "stages_per_rank": 2, "num_microbatches": 4},
        model=dict(CKPT_MODEL),
        trainer={"max_epochs": 2, "max_steps": -1},
        local_batch_size=8,
        data_parallel_size=2,
        resume_from="hybrid_half/end.ckpt",
        **EPOCHS,
    ),
    # every data-parallel rank in one node: nothing to replicate across nodes, refused on every rank
    hybrid("hybrid_in_one_node", 2, strategy={"processes_per_node": 4}, expect_error=True),
]
EQUIVALENT = ["hybrid_m2", "hybrid_m4", "hybrid_tied_thread"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(RUNS, 4, tmp_path_factory.mktemp("hybrid"), timeout=540)


def spec(name: str) -> RunSpec:
    return next(r for r in RUNS if r.name == name)


@pytest.mark.parametrize("name", EQUIVALENT)
def test_matches_single_device(name, results):
    run = spec(name)
    ref, result = reference_run(run), results[name]
    assert len(ref.steps) == 6
    assert_steps_match(result, ref, tol=TOL, keys=("train_loss", "samples", "max_err"))
    assert_params_match(result, ref, tol=TOL)
    initial = make_model(run).state_dict()
    assert min(relative_error(ref.params[k], initial[k]) for k in ref.params if k.endswith("weight")) > 1e-3
    shapes = {n: p.shape for n, p in make_model(run).named_parameters(remove_duplicate=False)}
    for rank, rank_result in enumerate(result.ranks):
        holdings = rank_result["holdings"]
        assert (holdings["pipeline_rank"], holdings["data_parallel_rank"]) == (0, rank)
        # each rank holds at most its half of every parameter's rows (FSDP2 pads dimension 0 to a multiple of S)
        for param_name, param in holdings["params"].items():
            rows = shapes[param_name][0]
            assert param["dtensor"], param_name
            assert param["local_numel"] <= math.ceil(rows / SHARDS) * param["numel"] // rows, param_name
    threads = {e[3] for r in result.ranks for e in r["timed"] if e[1] == "reduce_on"}
    if name.endswith("_thread"):
        assert threads and all(t.startswith("bfpp-reduce") for t in threads), threads
    else:
        assert threads == {"MainThread"}, threads


def test_checkpoint_written_under_hybrid_sharding_resumes_under_another_layout(results):
    ref = reference_run(spec("resume_p2_dp2"))  # two epochs on one device
    losses = [s["callback_metrics"]["train_loss"] for s in ref.steps]
    assert len(losses) == 6
    for name, expected in (("hybrid_half", losses[:3]), ("resume_p2_dp2", losses[3:])):
        for rank_result in results[name].ranks:
            got = [s["callback_metrics"]["train_loss"] for s in rank_result["steps"]]
            assert got == pytest.approx(expected, rel=TOL), name
    assert_params_match(results["resume_p2_dp2"], ref, tol=TOL)


def test_configuration_error_on_every_rank(results):
    errors = [r["error"] for r in results["hybrid_in_one_node"].ranks]
    assert len(set(errors)) == 1 and errors[0].startswith("ValueError: BFPPStrategy: sharding='hybrid_shard'")
    assert "lies inside one node" in errors[0] and "use sharding='full_shard'" in errors[0]


def padded_shard_bytes(run: RunSpec) -> int:
    """Ψ/S: the bytes of one rank's shard of the model (FSDP2 pads dimension 0 to a multiple of S)."""
    total = 0
    for param in make_model(run).parameters():
        rows = math.ceil(param.shape[0] / SHARDS)
        total += rows * (param.numel() // param.shape[0]) * param.element_size()
    return total


def fsdp_bytes_per_step(rank_result, step: int) -> dict[tuple[str, tuple[int, ...]], int]:
    """(collective, group ranks) -> bytes moved inside FSDP2's gathers and reductions at this step."""
    out: dict[tuple[str, tuple[int, ...]], int] = defaultdict(int)
    for s, name, ranks, size, inside_fsdp in rank_result["traffic"]:
        if s == step and inside_fsdp:
            out[(name, tuple(ranks))] += size
    return dict(out)


def test_bytes_per_process_group_per_step(results):
    """Across nodes only the gradient all-reduce: Ψ/S bytes per rank and step over its replicate group, i.e.
    2·Ψ·(D−1)/D per node for a ring, whatever the number of micro-batches; gathers and reduce-scatters stay
    inside the node (Ψ = the padded bytes of the sharded weights, S ranks per node, D nodes)."""
    shard = padded_shard_bytes(spec("hybrid_m2"))
    psi = SHARDS * shard
    per_run = {}
    for name in ("hybrid_m2", "hybrid_m4"):
        ranks = results[name].ranks
        per_rank = []
        for rank, rank_result in enumerate(ranks):
            node = rank // PER_NODE
            replicate_group = tuple(range(rank % PER_NODE, 4, PER_NODE))
            shard_group = tuple(range(node * PER_NODE, (node + 1) * PER_NODE))
            steps = [fsdp_bytes_per_step(rank_result, step) for step in (2, 3)]  # step 1 also infers shapes
            assert steps[0] == steps[1], f"{name} rank {rank}: steps 2 and 3 moved different bytes"
            moved = steps[0]
            cross_node = {k: v for k, v in moved.items() if len({r // PER_NODE for r in k[1]}) > 1}
            assert cross_node == {("all_reduce", replicate_group): shard}, (name, rank, moved)
            inside = {k[0]: v for k, v in moved.items() if k not in cross_node}
            assert {k[1] for k in moved if k not in cross_node} == {shard_group}
            # every weight is reduce-scattered once per step: the whole unsharded gradient in, Ψ bytes
            assert inside["reduce_scatter_single"] == psi, (name, rank, moved)
            # v=2 under breadth-first: each stage gathered once (both are resident during the first forward
            # anyway, so neither is released between its sweeps): Ψ bytes in all
            assert inside["all_gather_single"] == psi, (name, rank, moved)
            per_rank.append(moved)
        per_run[name] = per_rank
        # a ring all-reduce of Ψ/S bytes over D nodes sends 2·(Ψ/S)·(D−1)/D per rank; S ranks per node
        node_volume = PER_NODE * 2 * shard * (NODES - 1) / NODES
        assert node_volume == 2 * psi * (NODES - 1) / NODES
    assert per_run["hybrid_m2"] == per_run["hybrid_m4"]  # independent of the number of micro-batches
