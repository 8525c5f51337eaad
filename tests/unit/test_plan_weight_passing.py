"""The planner's weight passing (TawPipe) and hybrid sharding: simulated times against hand-computed ones on
tiny cases, the bytes formulas, the memory model, and the search. Pure and fast."""

import dataclasses
import itertools

import pytest

from lightning_bfpp.plan import Cluster, LayerCost, Plan, SearchSpace, simulate, uniform
from lightning_bfpp.plan.cluster import hybrid_inter_node_bytes, links
from lightning_bfpp.plan.schedules import weight_passing as wp
from lightning_bfpp.plan.search import format_table, search, search_per_replica_batch
from lightning_bfpp.plan.topology import NodeTopology

T_F, T_B = 1.0, 2.0  # per layer and micro-batch; weight passing's backward adds a recomputed forward: 3.0,
# but the last chunk's, whose forward kept its graph


def model(layers=2, param_bytes=1, **kwargs):
    return uniform(layers, T_F, T_B, param_bytes, 1, 1, optimizer_state_ratio=0.0, **kwargs)


def two_nodes(rail_bandwidth, **kwargs):
    """Two nodes of one device: a fetch is one rail transfer, no node broadcast."""
    return Cluster(2, 1, 2**40, 1e18, 1.0, latency_s=0.0, inter_node_rail_bandwidth=rail_bandwidth, **kwargs)


def passing(devices, microbatches, microbatch_size=1, stagger=False):
    options = wp.WeightPassingOptions(stagger=stagger)
    return Plan("weight_passing", 1, devices, devices, microbatches, microbatch_size, options=options)


def test_the_stagger_is_weight_passings_own_plan_option():
    """``Plan.options`` holds the kind's own options: None at their defaults (so such a plan equals one made
    without), the kind's type from a mapping (a plan read back from JSON), refused for another kind."""
    assert passing(2, 1).options is None and passing(2, 1) == Plan("weight_passing", 1, 2, 2, 1)
    staggered = passing(2, 1, stagger=True)
    assert staggered.options == wp.WeightPassingOptions(stagger=True)
    assert Plan(**dataclasses.asdict(staggered)) == staggered
    assert staggered.describe() == "weight_passing staggered chunks=2 m=1×1"
    assert passing(2, 1).describe() == "weight_passing chunks=2 m=1×1"
    with pytest.raises(ValueError, match="takes no plan options"):
        Plan("breadth_first", 2, 1, 2, 2, options=wp.WeightPassingOptions(stagger=True))
    # the search tries the stagger only where its space asks for it
    cluster = Cluster(4, 2, 2**34, 1e11, 1e9)
    profile = uniform(8, 1e-3, 2e-3, 2**20, 2**10, 2**10)
    both = (wp.WeightPassingOptions(), wp.WeightPassingOptions(stagger=True))
    for space, expected in (
        (SearchSpace(schedules=("weight_passing",)), [None]),
        (SearchSpace(schedules=("weight_passing",), options={"weight_passing": both}), [None, both[1]]),
    ):
        found = search(profile, cluster, 8, space)
        assert sorted({c.config.options for c in found}, key=str) == sorted(expected, key=str)
    assert "weight_passing (staggered)" in format_table(found)


def test_chunk_owners_are_device_bound_storage():
    d, s = 3, 2  # rank (c mod D)·S + ⌊c/D⌋: local rank j of every node owns chunks jD … jD + D − 1
    owners = [NodeTopology(d * s, s).chunk_owner(c) for c in range(d * s)]
    assert owners == [0, 2, 4, 1, 3, 5]
    assert sorted(owners) == list(range(d * s))  # one chunk per device


def test_fetch_is_a_rail_transfer_then_a_node_broadcast():
    cluster = Cluster(6, 2, 2**40, intra_node_bandwidth=10.0, inter_node_bandwidth=0.5, latency_s=0.0,
                      inter_node_rail_bandwidth=1.0)  # fmt: skip
    three_nodes = NodeTopology(6, 2)
    # the owner sends one copy to each of the D − 1 = 2 other nodes (6 / 1 each), then a broadcast (6 / 10)
    assert wp.fetch_s(6, three_nodes, cluster) == pytest.approx(2 * 6 + 0.6)
    assert wp.gradient_s(6, three_nodes, cluster) == pytest.approx(12.6)
    assert wp.fetch_s(6, three_nodes, cluster, stagger=True) == pytest.approx(6 + 0.6)  # one copy per link
    assert wp.fetch_s(6, NodeTopology(2, 2), cluster) == pytest.approx(0.6)  # one node: the broadcast only
    assert wp.fetch_s(6, NodeTopology(3, 1), cluster) == pytest.approx(12)  # one device per node: the rail only
    slow = Cluster(6, 2, 2**40, 10.0, 0.5, latency_s=1e-3, collective_overhead_s=0.01, inter_node_rail_bandwidth=1.0)
    # latency once on the rail; overhead + (S − 1) ring steps on the broadcast
    assert wp.fetch_s(6, three_nodes, slow) == pytest.approx(1e-3 + 12 + 0.01 + 1e-3 + 0.6)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_fetches_hide_behind_compute_but_the_first_and_the_last_gradient(n):
    # two chunks (one layer each) on two nodes; fetch = gradient = 1 byte / 2.5 B/s = 0.4 s < every visit
    step = simulate(passing(2, n), model(), two_nodes(2.5)).step_time
    per_microbatch = 2 * T_F + T_B + (T_B + T_F)  # forwards, then backwards (the first chunk's recomputed)
    assert step == pytest.approx(0.4 + n * per_microbatch + 0.4)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_fetches_longer_than_a_chunks_compute_are_waited_for(n):
    # fetch = gradient = 5 s, longer than any visit (1 s forward, 3 s backward), on a stream each (the runtime's
    # two threads): per micro-batch the fetches of chunk 1 (forward) and chunk 0 (backward) are waited for in
    # full, the gradients hide behind them but the last
    step = simulate(passing(2, n), model(), two_nodes(0.2)).step_time
    assert step == pytest.approx(5 + n * (2 * 5 + T_F + (T_B + T_F)) + 5)
    # the hand-derived timeline for one micro-batch: fetch 0 [0, 5], F0 [5, 6], fetch 1 [5, 10], F1 [10, 11],
    # B1 [11, 13] (its forward kept the graph) while fetch 0 [11, 16], gradient 1 [13, 18], B0 [16, 19],
    # gradient 0 [19, 24]
    if n == 1:
        spans = simulate(passing(2, 1), model(), two_nodes(0.2)).spans
        compute = [(s.kind, s.stage, s.start, s.end) for s in spans if s.kind in ("forward", "backward")]
        assert compute == [("forward", 0, 5, 6), ("forward", 1, 10, 11), ("backward", 1, 11, 13),
                           ("backward", 0, 16, 19)]  # fmt: skip
        reduces = [(s.start, s.end) for s in spans if s.kind == "reduce"]
        assert reduces == [(13, 18), (19, 24)]


def test_a_profile_with_recomputation_is_not_recomputed_twice():
    plain = model()
    recomputed = uniform(2, T_F, T_B + T_F, 1, 1, 1, optimizer_state_ratio=0.0, recompute=True)
    cluster = two_nodes(2.5)
    # every chunk's backward already recomputes (the last chunk's too, where chunk-level recomputation skips it)
    plain_step = simulate(passing(2, 2), plain, cluster).step_time
    assert simulate(passing(2, 2), recomputed, cluster).step_time == pytest.approx(plain_step + 2 * T_F)


def test_the_stagger_sends_one_copy_per_link_and_overlaps_both_directions():
    cluster = Cluster(3, 1, 2**40, 1e18, 1.0, latency_s=0.0, inter_node_rail_bandwidth=0.2)
    profile = model(layers=3)
    plain = simulate(passing(3, 1), profile, cluster)
    staggered = simulate(passing(3, 1, stagger=True), profile, cluster)
    # without the stagger: 2 copies × 5 s per rail transfer: fetches [0, 10], [10, 20], [20, 30] (F2 [30, 31],
    # B2 reuses it [31, 33]), [31, 41], [41, 51]; B1 [41, 44], B0 [51, 54]; gradients [33, 43], [44, 54], [54, 64]
    assert plain.step_time == pytest.approx(64)
    # with it: one copy (5 s) per transfer: fetches end at 5, 10, 15 (F2 runs [15, 16], B2 reuses it
    # [16, 18]), 21, 26; B1 [21, 24], B0 [26, 29], gradient 0 [29, 34]; then the last node finishes
    # D − 1 = 2 mean visits (11 s of compute over 6 visits) later
    assert staggered.step_time == pytest.approx(34 + 2 * 11 / 6)


def test_traffic_matches_the_formulas():
    chunk_bytes, n, topology = [1, 2, 3, 4], 3, NodeTopology(4, 2)
    moved = wp.traffic(chunk_bytes, n, topology)
    total = sum(chunk_bytes)
    # fetched F = N·Ψ − (N − 1)·Ψ_0 (chunk 0 reused from the previous backward) + N·(Ψ − Ψ_{P−1})
    assert moved["fetched"] == n * total - (n - 1) * 1 + n * (total - 4) == 46
    # across nodes: 3·N·(D − 1)·Ψ minus the reuse
    assert moved["cross_node"] == 3 * n * (2 - 1) * total - n * 4 - (n - 1) * 1 == 76
    # local rank 0 sources chunks 0 and 1 in its node (fetched 4 and 6 times), so it receives the rest
    assert moved["broadcast"] == 46 - (4 * 1 + 6 * 2) == 30
    assert moved["reduce"] == n * (total - 1 - 2) == 21  # every gradient but its rail's, once per micro-batch
    # rail 1 (chunks 2 and 3): the owner of chunk 2 sends (fetched 6 + gradients 3) · 3 bytes, receives chunk 3's
    assert moved["rail"] == (6 + 3) * 3 + (3 + 3) * 4 == 51
    one_node = wp.traffic(chunk_bytes, n, NodeTopology(4, 4))
    assert one_node["cross_node"] == one_node["rail"] == 0
    # the brief's approximations for many equal chunks: 3·N·(D−1)·Ψ across nodes, 2·N·Ψ and N·Ψ inside
    big = wp.traffic([1.0] * 64, 8, NodeTopology(64, 16))
    assert big["cross_node"] == pytest.approx(3 * 8 * 3 * 64, rel=0.02)
    assert big["broadcast"] == pytest.approx(2 * 8 * 64, rel=0.1) and big["reduce"] == pytest.approx(8 * 64, rel=0.1)


def test_simulated_fetches_and_bytes_are_the_formulas():
    cluster = Cluster(4, 2, 2**40, 1e9, 1e9, latency_s=0.0)
    prediction = simulate(passing(4, 3), model(layers=8, param_bytes=100), cluster)
    gathers = [s for s in prediction.spans if s.kind == "gather"]
    assert len(gathers) == 3 * 4 - 2 + 3 * 3  # F = N·P − (N − 1) forwards + N·(P − 1) backwards
    assert len([s for s in prediction.spans if s.kind == "reduce"]) == 3 * 4
    assert prediction.traffic == wp.traffic([200] * 4, 3, NodeTopology(4, 2))


def test_the_runtime_lowering_fetches_what_the_model_fetches():
    from lightning_bfpp.plan.actions import REDUCE_GRAD, UNSHARD, count

    p, n = 4, 3
    lowered = passing(p, n).lowered()[0]  # what the runtime runs: the plan's one lowering
    order = wp.visits(p, n)
    counts = [0] * p
    for (_, c, _), needed in zip(order, wp.fetched(order), strict=True):
        counts[c] += needed
    assert [count(lowered, UNSHARD, c) for c in range(p)] == counts
    assert [count(lowered, REDUCE_GRAD, c) for c in range(p)] == [n] * p


def test_memory_owned_state_two_buffers_inputs_and_one_recomputed_chunk():
    layer = LayerCost(1.0, 2.0, param_bytes=100, output_bytes=10, saved_bytes=10, activation_bytes=50)
    costs = [layer, layer]
    # owned chunk × (2 + 6) + two weight and two gradient buffers + (chunk 1's input + its activations)
    assert wp.memory(costs, NodeTopology(2, 1), optimizer_state_ratio=6.0) == 800 + 400 + 10 + 50
    profile = uniform(2, 1.0, 2.0, 100, 10, 10, optimizer_state_ratio=6.0)
    prediction = simulate(passing(2, 4), profile, two_nodes(1e9))
    assert prediction.peak_memory == 800 + 400 + 10 + 10  # activation_bytes defaults to saved_bytes


def test_weight_passing_needs_a_chunk_per_device():
    with pytest.raises(ValueError, match="chunks > 2 layers"):
        simulate(passing(4, 1), model(layers=2), Cluster(4, 2, 2**40, 1.0, 1.0))
    with pytest.raises(ValueError, match="one chunk per device"):
        simulate(Plan("weight_passing", 1, 4, 1, 1, 1), model(layers=8), Cluster(4, 2, 2**40, 1.0, 1.0))


def test_hybrid_shard_gathers_in_a_node_and_all_reduces_a_shard_across_nodes():
    cluster = Cluster(16, 8, 2**40, intra_node_bandwidth=100.0, inter_node_bandwidth=1.0, latency_s=0.0)
    net = links(cluster, p=1, dp=16, mesh_order="data_pipeline")
    assert net.shard_size == (8,) and net.replicate_size == (2,)
    assert net.hybrid_all_gather_s(0, 800) == pytest.approx(7 / 8 * 800 / 100)
    # reduce-scatter in the node, then an all-reduce of the 100-byte shard over 2 nodes: 2 · 1/2 · 100 / 1
    assert net.hybrid_reduce_s(0, 800) == pytest.approx(7 + 100)
    assert hybrid_inter_node_bytes(800, 2) == 800  # 2·Ψ·(D − 1)/D per node, whatever the micro-batches
    profile = uniform(8, T_F, T_B, 100, 1, 0, optimizer_state_ratio=0.0)
    hybrid = simulate(Plan("1f1b", 1, 16, 1, 1, 1, "hybrid_shard"), profile, cluster)
    assert hybrid.step_time == pytest.approx(7 + 8 * (T_F + T_B) + 107)  # gather, compute, blocking reduce
    assert hybrid.comm_bytes == 800 * 7 / 8 + 800 * (7 / 8 + 2 * (1 / 2) / 8)
    full = simulate(Plan("1f1b", 1, 16, 1, 1, 1, "full_shard"), profile, cluster)
    # both hold the unsharded stage and its gradient buffer; hybrid keeps 1/8 of the state, full 1/16
    assert hybrid.peak_memory - full.peak_memory == 2 * (800 / 8 - 800 / 16)
    # the number of micro-batches changes hybrid's compute, not its traffic
    more = simulate(Plan("1f1b", 1, 16, 1, 4, 1, "hybrid_shard"), profile, cluster)
    assert more.comm_bytes == hybrid.comm_bytes


def test_reductions_run_at_their_own_measured_bandwidths():
    # gloo sums on the host: a reduce-scatter at half an all-gather's bandwidth, an all-reduce at 2× (calibrated)
    cluster = Cluster(16, 8, 2**40, intra_node_bandwidth=100.0, inter_node_bandwidth=1.0, latency_s=0.0,
                      reduce_bandwidth_ratio=0.5, all_reduce_bandwidth_ratio=2.0)  # fmt: skip
    net = links(cluster, p=1, dp=16, mesh_order="data_pipeline")
    assert net.hybrid_all_gather_s(0, 800) == pytest.approx(7 / 8 * 800 / 100)
    assert net.hybrid_reduce_s(0, 800) == pytest.approx(7 / 8 * 800 / 50 + 2 * 1 / 2 * 100 / 2)
    flat = links(Cluster(2, 2, 2**40, 10.0, 10.0, latency_s=0.0, reduce_bandwidth_ratio=0.5), p=1, dp=2,
                 mesh_order="data_pipeline")  # fmt: skip
    assert flat.all_gather_s(0, 100) == pytest.approx(5) and flat.reduce_scatter_s(0, 100) == pytest.approx(10)
    assert flat.all_reduce_s(0, 100) == pytest.approx(10)  # 2 · (n − 1)/n · B at the all-gather's bandwidth
    two = NodeTopology(2, 2)  # weight passing: the node broadcast at the gather's bandwidth, the reduce at the sum's
    assert wp.fetch_s(100, two, cluster) == pytest.approx(1) and wp.gradient_s(100, two, cluster) == pytest.approx(2)


def test_search_offers_weight_passing_and_hybrid_shard_across_nodes():
    profile = uniform(8, 1e-3, 2e-3, 2**20, 2**10, 2**10)
    two_nodes_of_two = Cluster(4, 2, 2**34, 1e11, 1e9)
    candidates = search(profile, two_nodes_of_two, global_batch=8, space=SearchSpace(stages_per_rank=(1, 2)))
    feasible = [c for c in candidates if c.infeasible is None]
    assert {"weight_passing", "breadth_first", "1f1b"} <= {c.config.schedule for c in feasible}
    assert "hybrid_shard" in {c.config.sharding for c in feasible}
    assert all(a.prediction.step_time <= b.prediction.step_time for a, b in itertools.pairwise(feasible))
    passing_configs = [c.config for c in feasible if c.config.schedule == "weight_passing"]
    assert {(c.pipeline_parallel_size, c.data_parallel_size, c.stages_per_rank) for c in passing_configs} == {(1, 4, 4)}
    # one node: weight passing still, hybrid_shard not (it would be full_shard)
    one_node = search(profile, Cluster(4, 4, 2**34, 1e11, 1e11), 8, SearchSpace(stages_per_rank=(1, 2)))
    assert "weight_passing" in {c.config.schedule for c in one_node if c.infeasible is None}
    assert "hybrid_shard" not in {c.config.sharding for c in one_node}


def test_search_respects_memory_and_layer_limits_for_weight_passing():
    profile = uniform(8, 1e-3, 2e-3, 2**30, 2**20, 2**20)  # 1 GiB per layer: 8 GiB of owned state + buffers
    small = Cluster(4, 2, 6 * 2**30, 1e11, 1e9)
    passing_only = SearchSpace(schedules=("weight_passing",))
    rejected = [c for c in search(profile, small, 8, passing_only) if c.config.schedule == "weight_passing"]
    assert rejected and all(c.infeasible.startswith("memory") for c in rejected)
    too_few_layers = search(uniform(2, 1e-3, 2e-3, 1, 1, 1), small, 8, passing_only)
    assert all(c.infeasible == "4 chunks > 2 layers" for c in too_few_layers)


def test_the_auto_path_can_plan_weight_passing_and_hybrid_shard():
    # what lightning_bfpp.adapter.auto asks: one schedule and sharding, every pipeline size, the per-replica batch
    profile = uniform(8, 1e-3, 2e-3, 2**20, 2**10, 2**10)
    cluster = Cluster(8, 4, 2**34, 1e11, 1e9)
    space = SearchSpace(schedules=("weight_passing",), shardings=("full_shard",), stages_per_rank=(1, 2, 4, 8))
    best = next(c for c in search_per_replica_batch(profile, cluster, 4, space) if c.infeasible is None)
    assert (best.config.schedule, best.config.pipeline_parallel_size, best.config.data_parallel_size) == (
        "weight_passing", 1, 8)  # fmt: skip
    assert best.config.global_batch == 4 * 8
    space = SearchSpace(schedules=("breadth_first",), shardings=("hybrid_shard",))
    feasible = [c for c in search_per_replica_batch(profile, cluster, 4, space) if c.infeasible is None]
    assert feasible and all(c.config.sharding == "hybrid_shard" for c in feasible)
    # hybrid needs data-parallel groups split evenly over nodes, more than one rank per node (as the strategy)
    assert {c.config.pipeline_parallel_size for c in feasible} <= {1, 2}


def test_the_first_fetch_runs_beside_the_steps_host_work():
    # fetch = gradient = 0.4 s, hidden but the first and the last; the step's host work (1 s) hides the first
    quiet = simulate(passing(2, 1), model(), two_nodes(2.5)).step_time
    busy = simulate(passing(2, 1), model(), two_nodes(2.5, step_overhead_s=1.0))
    assert busy.step_time == pytest.approx(1.0 + quiet - 0.4)
    assert next(s.start for s in busy.spans if s.kind == "gather") == 0.0
    assert next(s.start for s in busy.spans if s.kind == "forward") == pytest.approx(1.0)
