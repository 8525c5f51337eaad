"""Weight passing (``schedule="weight_passing"``, lightning_bfpp.engine.runners.weight_passing) equals one-device
training.

Nodes are emulated on this machine with ``processes_per_node``: 2 nodes × 2, 3 nodes × 2 and 2 nodes × 4
processes, and one process alone (which sends nothing). Per layout one launch runs:

- a marker run (``tests.probe_models.MarkerNet``, one scalar layer per chunk): every owner writes its chunk
  id into its chunk, so the values the layers see on every rank give the order chunks reached it (forward
  0 … n−1, backward n−1 … 0, each backward after the recomputed forward), and rank ``r``'s loss is weighted
  by ``2**r``, so each owner's gradient says whose contributions reached it, and how often;
- training runs compared with one device: per-step losses and final parameters within 1e-5 (fp32), with
  different weights in every chunk (a randomly initialised model);
- on 2 × 2, the transfers of one step counted per process group (node broadcasts and reductions,
  point-to-point along rails) against the formulas of docs/weight-passing.md, AdamW with clipping and
  gradient accumulation, validation, and checkpoints: saved under weight passing and resumed under
  breadth-first, and the other way round, both equal to one device saving and resuming.
"""

from __future__ import annotations

import pytest
import torch

from lightning_bfpp.plan.topology import NodeTopology
from tests.distributed.harness import assert_params_match, assert_steps_match, launch, relative_error
from tests.models import RunSpec, make_model, reference_run

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

TOL = 1e-5
LAYOUTS = [(2, 2), (3, 2), (2, 4), (1, 1)]  # nodes × processes per node
CHECKPOINT = "ckpts/last.ckpt"
BREADTH_FIRST = {"pipeline_parallel_size": 2, "stages_per_rank": 2, "num_microbatches": 2}


def wp(per_node: int, m: int = 2, **strategy) -> dict:
    return {"schedule": "weight_passing", "processes_per_node": per_node, "num_microbatches": m, **strategy}


def runs_for(nodes: int, per_node: int) -> list[RunSpec]:
    world = nodes * per_node

    def run(name: str, m: int = 2, **fields) -> RunSpec:
        """Weight passing over every rank, ``m`` micro-batches of 2 samples per rank and step."""
        fields = {"model": {"optimizer": "adamw"}, "local_batch_size": 2 * m, "data_parallel_size": world, **fields}
        return RunSpec(name=name, strategy=fields.pop("strategy", wp(per_node, m=m)), **fields)

    def breadth_first(name: str, **fields) -> RunSpec:
        """The same global batch through p=2 × dp=2 breadth-first."""
        return run(name, strategy=BREADTH_FIRST, local_batch_size=8, data_parallel_size=2, **fields)

    layout = f"{nodes}x{per_node}"
    runs = [
        run(
            f"markers_{layout}",
            model_factory="tests.probe_models:marker_net",
            trainer={"max_steps": 2},
            checks=["markers"],
        ),
        # a global batch that divides the data set, so that the one-device loader sees the same batches
        run(f"sgd_{layout}", model={"optimizer": "sgd"}, data={"num_samples": 48 if world == 6 else 64}),
    ]
    if world == 1:
        # one process owns the only chunk and sends nothing; batch norm over whole batches (one micro-batch)
        batch_norm = run(
            "batch_norm_1x1",
            m=1,
            model_factory="tests.replica_models:batch_norm_net",
            local_batch_size=8,
            checks=["rank_state"],
        )
        return [*runs, batch_norm]
    if (nodes, per_node) != (2, 2):
        return runs
    steps = {"max_steps": 3}
    return [
        *runs,
        run("traffic_2x2", m=3, model={"optimizer": "sgd"}, trainer={"max_steps": 2}, checks=["traffic"]),
        run(
            "adamw_clip_accumulate_validate_2x2",
            trainer={"gradient_clip_val": 0.05, "accumulate_grad_batches": 2, **steps},
            checks=["validate"],
        ),
        run("wp_half", trainer=steps, checks=["last_checkpoint_every_step"]),
        breadth_first("bf_from_wp", trainer={"max_steps": 6}, resume_from=f"wp_half/{CHECKPOINT}"),
        breadth_first("bf_half", trainer=steps, checks=["last_checkpoint_every_step"]),
        run("wp_from_bf", trainer={"max_steps": 6}, resume_from=f"bf_half/{CHECKPOINT}"),
    ]


RUNS = {layout: runs_for(*layout) for layout in LAYOUTS}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = {}
    for (nodes, per_node), runs in RUNS.items():
        folder = tmp_path_factory.mktemp(f"wp{nodes}x{per_node}")
        out.update(launch(runs, nodes * per_node, folder, timeout=840))
        out[f"folder_{nodes}x{per_node}"] = folder
    return out


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: f"{layout[0]}x{layout[1]}")
def test_chunks_visit_in_order_and_gradients_reach_their_owners(layout, results):
    nodes, per_node = layout
    world = nodes * per_node
    result = results[f"markers_{nodes}x{per_node}"]
    microbatches, steps = 2, 2
    one = []
    for _ in range(microbatches):
        one += [["F", float(c), c == world - 1] for c in range(world)]
        one += [["B", float(world - 1)]]
        for c in reversed(range(world - 1)):
            one += [["F", float(c), True], ["B", float(c)]]
    topology = NodeTopology(world, per_node)
    owned_by = {topology.chunk_owner(c): c for c in range(world)}
    for rank, report in enumerate(r["markers"] for r in result.ranks):
        assert report["visits"] == one * steps, f"rank {rank}"
        # every rank's contribution (2**r) reached the owner once per micro-batch, averaged over the world
        assert report["owner_gradients"] == {str(owned_by[rank]): pytest.approx((2**world - 1) / world, rel=1e-6)}
    # TawPipe's placement: consecutive chunks on different nodes
    assert [topology.node_of(topology.chunk_owner(c)) for c in range(nodes)] == list(range(nodes))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: f"{layout[0]}x{layout[1]}")
def test_weight_passing_matches_one_device(layout, results):
    run = RUNS[layout][1]
    ref = reference_run(run)
    result = results[run.name]
    assert_steps_match(result, ref, tol=TOL, keys=("train_loss",))
    assert_params_match(result, ref, tol=TOL)
    initial = make_model(run).state_dict()
    assert min(relative_error(ref.params[k], initial[k]) for k in ref.params if k.endswith("weight")) > 1e-3


def test_one_process_trains_weights_and_buffers_as_one_device(results):
    """On one process no transfer is scheduled: each backward's gradients stay in ``.grad`` (they were taken for
    a reduction that never came, and nothing trained), and the one chunk's running statistics are the device's."""
    run = next(r for r in RUNS[(1, 1)] if r.name == "batch_norm_1x1")
    ref = reference_run(run)
    assert_steps_match(results[run.name], ref, tol=TOL, keys=("train_loss",))
    state = torch.load(results["folder_1x1"] / "out" / run.name / "state_end_rank0.pt")
    got = {**state["params"], **state["buffers"]}
    assert set(got) == set(ref.params) and any(k.endswith("running_var") for k in got)
    worst = max(relative_error(got[k], ref.params[k]) for k in ref.params)
    assert worst <= TOL, f"largest relative error {worst:.2e}"
    initial = make_model(run).state_dict()
    assert min(relative_error(ref.params[k], initial[k]) for k in ref.params if k.endswith("weight")) > 1e-3


@pytest.mark.parametrize("name", ["adamw_clip_accumulate_validate_2x2"])
def test_optimizer_clipping_accumulation_and_validation(name, results):
    run = next(r for r in RUNS[(2, 2)] if r.name == name)
    ref = reference_run(run)
    result = results[name]
    assert_steps_match(result, ref, tol=TOL, keys=("train_loss",))
    assert_params_match(result, ref, tol=TOL)
    want = [s["grad_norm"] for s in ref.steps]  # None on a batch that does not step
    assert sum(w is not None for w in want) == 3
    for rank_result in result.ranks:  # the gradient norm the clipping used: the whole model's
        got = [s["grad_norm"] for s in rank_result["steps"]]
        assert [g is None for g in got] == [w is None for w in want]
        assert [g for g in got if g is not None] == pytest.approx([w for w in want if w is not None], rel=TOL)
    assert result.ranks[0]["validations"] and len(result.ranks[0]["validations"]) == len(ref.validations)
    for got, want in zip(result.ranks[0]["validations"], ref.validations, strict=True):
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=TOL), key


def test_checkpoints_move_between_weight_passing_and_breadth_first(results):
    runs = {r.name: r for r in RUNS[(2, 2)]}
    folder = results["folder_2x2"]
    for name, half_name in (("bf_from_wp", "wp_half"), ("wp_from_bf", "bf_half")):
        first = reference_run(runs[half_name])
        ref = reference_run(runs[name], resume_from=str(first.extras["out"] / CHECKPOINT))
        result = results[name]
        assert [s["step"] for s in result.steps(0)] == [4, 5, 6]
        assert_steps_match(result, ref, tol=TOL, keys=("train_loss",))
        assert_params_match(result, ref, tol=TOL)
    assert (folder / "out" / "wp_half" / CHECKPOINT).exists()


def test_transfers_per_step_match_the_formulas(results):
    """Bytes per process group in one step on 2 nodes × 2 (D = 2 nodes, S = 2, n = 4 chunks, N = 3).

    Along the rails (across nodes), per step: the owner sends a chunk to the D − 1 other nodes once per fetch,
    and each node's gradient sum once per backward; a chunk is fetched for every visit except when it is still
    here from the one before (the last chunk's forward → its backward; chunk 0's backward → the next
    micro-batch's forward). That is TawPipe's 3·N·(D−1)·Ψ less (D−1)·((N−1)·Ψ₀ + N·Ψₙ₋₁). Inside a node: one
    broadcast per fetch and one reduce per backward.
    """
    from lightning_bfpp.engine.layers import layer_weights, pipeline_layers
    from lightning_bfpp.plan.config import PipelineConfig
    from lightning_bfpp.plan.mesh import MeshShape

    run = next(r for r in RUNS[(2, 2)] if r.name == "traffic_2x2")
    nodes, per_node, n, m = 2, 2, 4, 3
    named = pipeline_layers(make_model(run))
    config = PipelineConfig(**{k: v for k, v in run.strategy.items()})
    layout = config.resolve_plan(MeshShape(1, n), layer_weights(named))
    weights = layer_weights(named)
    psi = [
        4 * sum(weights[i] for i in range(sum(layout.stage_layer_counts[:c]), sum(layout.stage_layer_counts[: c + 1])))
        for c in range(n)
    ]
    fetches = [1 + m] + [2 * m] * (n - 2) + [m]
    topology = NodeTopology(nodes * per_node, per_node)
    rails = [sorted(topology.rail_ranks(j)) for j in range(per_node)]
    node_groups = [sorted(topology.node_ranks(d)) for d in range(nodes)]
    result = results["traffic_2x2"]
    step = 1  # the first training step (setup's transfers are recorded as step 0)
    sent = received = broadcast = reduced = 0
    for rank_result in result.ranks:
        for entry_step, name, ranks, size, _ in rank_result["traffic"]:
            if entry_step != step:
                continue
            if name == "isend":
                assert sorted(ranks) in rails, ranks
                sent += size
            elif name == "irecv":
                assert sorted(ranks) in rails, ranks
                received += size
            elif name == "broadcast":
                assert sorted(ranks) in node_groups, ranks
                broadcast += size
            elif name == "reduce":
                assert sorted(ranks) in node_groups, ranks
                reduced += size
    weights_across = (nodes - 1) * sum(f * p for f, p in zip(fetches, psi, strict=True))
    gradients_across = (nodes - 1) * m * sum(psi)
    assert sent == received == weights_across + gradients_across
    tawpipe = 3 * m * (nodes - 1) * sum(psi)
    assert sent == tawpipe - (nodes - 1) * ((m - 1) * psi[0] + m * psi[-1])
    world = nodes * per_node
    assert broadcast == world * sum(f * p for f, p in zip(fetches, psi, strict=True))  # every rank, every fetch
    assert reduced == world * m * sum(psi)
