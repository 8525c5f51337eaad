"""The planner as pure functions: the simulator against closed-form schedule formulas, memory and traffic,
the topology model, the search, and the command line."""

import itertools
import json
import math
import statistics
from dataclasses import replace

import pytest

from lightning_bfpp.plan import Cluster, Plan, SearchSpace, format_table, gpt, search, simulate, uniform
from lightning_bfpp.plan.__main__ import main, quantity
from lightning_bfpp.plan.cluster import links

FREE = Cluster(num_devices=64, devices_per_node=8, memory_bytes=2**40, intra_node_bandwidth=1e18,
               inter_node_bandwidth=1e18, latency_s=0.0)  # fmt: skip
T_F, T_B = 1.0, 2.0  # per layer and micro-batch


def model(layers=16, param_bytes=1, saved=100):
    return uniform(layers, T_F, T_B, param_bytes, 10, saved, optimizer_state_ratio=0.0)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (8, 16)])
def test_non_looped_schedules_take_m_plus_p_minus_one_slots(p, m):
    per_stage = (T_F + T_B) * 16 / p
    for schedule in ("gpipe", "1f1b"):
        step = simulate(Plan(schedule, p, 1, 1, m, 1), model(), FREE).step_time
        assert step == pytest.approx((m + p - 1) * per_stage)


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 4), (4, 2, 8), (4, 4, 8), (2, 8, 2)])
def test_looped_schedules_cut_the_bubble_by_v(p, v, m):
    # the paper's bubble (p − 1)/(v·m) for m ≥ p: step = m·(tF+tB)_rank + (p − 1)·(tF+tB)_stage
    rank_time = (T_F + T_B) * 16 / p
    expected = m * rank_time + (p - 1) * rank_time / v
    assert simulate(Plan("breadth_first", p, 1, v, m, 1), model(), FREE).step_time == pytest.approx(expected)
    if m >= p:
        assert simulate(Plan("depth_first", p, 1, v, m, 1), model(), FREE).step_time == pytest.approx(expected)


def test_breadth_first_with_fewer_microbatches_than_ranks_stalls_each_loop():
    p, v, m = 4, 2, 2
    stage = (T_F + T_B) * 16 / (p * v)
    step = simulate(Plan("breadth_first", p, 1, v, m, 1), model(), FREE).step_time
    ideal = m * v * stage
    assert step / ideal - 1 == pytest.approx((v * (p - m) + m - 1) / (v * m))


def test_activation_memory_breadth_first_holds_every_microbatch_1f1b_at_most_p():
    """Per micro-batch in flight a rank holds its layers' saved activations and its stage's output (10 bytes, kept
    for the backward); the computing layer's transient adds one layer's activations on top."""
    p, m, saved = 4, 16, 100
    bf = simulate(Plan("breadth_first", p, 1, 1, m, 1), model(saved=saved), FREE)
    ofob = simulate(Plan("1f1b", p, 1, 1, m, 1), model(saved=saved), FREE)
    layers_per_rank = 16 // p
    in_flight = layers_per_rank * saved + 10
    assert bf.activation_peaks[0] == m * in_flight + saved
    assert ofob.activation_peaks[0] == p * in_flight + saved
    assert bf.peak_memory == pytest.approx(m * in_flight + saved, rel=0.01)  # the weights are a few bytes here
    assert ofob.peak_memory == pytest.approx(p * in_flight + saved, rel=0.01)


def test_full_shard_traffic_and_memory():
    big = model(param_bytes=1000, saved=0)
    cluster = Cluster(4, 4, 2**40, 1e18, 1e18, latency_s=0.0)
    bf = simulate(Plan("breadth_first", 2, 2, 4, 8, 1), big, cluster)
    df = simulate(Plan("depth_first", 2, 2, 4, 8, 1), big, cluster)
    stage_bytes = 1000 * 16 // 8
    # breadth-first: 2v−2 gathers and v reductions of a stage, each moving half its bytes (dp=2)
    assert bf.comm_bytes >= (6 + 4) * stage_bytes // 2
    assert df.comm_bytes > 2 * bf.comm_bytes  # a gather per visit
    held = 4 * stage_bytes // 2  # four local stages, sharded in two
    assert bf.peak_memory >= 2 * held  # weights and gradients (optimizer state ratio 0 here)


def test_mesh_order_decides_which_group_stays_in_a_node():
    cluster = Cluster(16, 8, 2**40, intra_node_bandwidth=100.0, inter_node_bandwidth=1.0)
    pipelines_in_node = links(cluster, p=8, dp=2, mesh_order="data_pipeline")
    replicas_in_node = links(cluster, p=8, dp=2, mesh_order="pipeline_data")
    # 2 nodes of 8: a pipeline of 8 fits a node, or the replica pairs do and the pipeline crosses once
    assert set(pipelines_in_node.p2p_bandwidth) == {100.0} and set(pipelines_in_node.data_parallel_bandwidth) == {1.0}
    assert set(replicas_in_node.data_parallel_bandwidth) == {100.0} and min(replicas_in_node.p2p_bandwidth) == 1.0


def test_search_ranks_and_explains_what_cannot_run():
    profile = uniform(8, 1e-3, 2e-3, 2**30, 2**20, 2**20)
    cluster = Cluster(4, 4, memory_bytes=12 * 2**30, intra_node_bandwidth=1e11, inter_node_bandwidth=1e11)
    candidates = search(profile, cluster, global_batch=8, space=SearchSpace(stages_per_rank=(1, 2, 4)))
    feasible = [c for c in candidates if c.infeasible is None]
    assert feasible and all(a.prediction.step_time <= b.prediction.step_time for a, b in itertools.pairwise(feasible))
    reasons = {c.infeasible.split(":")[0] for c in candidates if c.infeasible}
    assert "memory" in reasons  # e.g. p=1: all 8 GiB of weights with optimizer state on one device
    assert any("stages >" in c.infeasible for c in candidates if c.infeasible)
    table = format_table(candidates, top=3)
    assert table.count("\n") == 1 + 3 + 5 and "infeasible:" in table


def test_gpt_profile_counts_parameters():
    profile = gpt(64, 8192, 2048, 51200, flops_per_second=1e14)
    assert profile.num_layers == 66
    assert profile.param_bytes / 2 == pytest.approx(52.4e9, rel=0.01)  # the paper's 52B-parameter scale
    block = profile.layers[1]
    assert block.backward_s == pytest.approx(2 * block.forward_s)
    assert gpt(2, 1024, 512, 100, flops_per_second=1e14, recompute=True).layers[1].saved_bytes == 2 * 512 * 1024


def test_quantities():
    assert quantity("80GiB") == 80 * 2**30 and quantity("25GB/s") == 25e9 and quantity("1.5e9") == 1.5e9
    with pytest.raises(Exception, match="not a size"):
        quantity("fast")


def test_command_line(capsys, tmp_path):
    main(["--gpt", "8,1024,512,1000", "--flops", "1e14", "--devices", "8", "--devices-per-node", "4",
          "--memory", "16GiB", "--intra-node-bandwidth", "100GB/s", "--inter-node-bandwidth", "10GB/s",
          "--global-batch", "16", "--top", "3", "--timeline", str(tmp_path / "best.png"),
          "--json", str(tmp_path / "all.json")])  # fmt: skip
    out = capsys.readouterr().out
    assert "configurations feasible" in out and "| 1 |" in out
    assert (tmp_path / "best.png").stat().st_size > 5000 and (tmp_path / "all.json").exists()
    with pytest.raises(SystemExit, match="--memory"):
        main(["--gpt", "8,1024,512,1000", "--flops", "1e14", "--devices", "8", "--intra-node-bandwidth", "1GB/s",
              "--global-batch", "16"])  # fmt: skip


def test_overlapping_reductions_never_slows_a_step():
    profile = uniform(16, 1e-3, 2e-3, 2**24, 2**16, 2**16)
    cluster = Cluster(8, 8, 2**40, 1e9, 1e9)
    for schedule in ("breadth_first", "depth_first"):
        config = Plan(schedule, 4, 2, 2, 8, 1)
        plain = simulate(config, profile, cluster).step_time
        overlapped = simulate(config, profile, Cluster(8, 8, 2**40, 1e9, 1e9, overlap_reductions=True)).step_time
        assert overlapped <= plain and not math.isclose(overlapped, plain)


def test_an_overlapped_reduction_holds_the_rank_only_at_its_wait():
    """With overlapped reductions, a reduction slower than the backward after it holds the rank at its
    WAIT_REDUCE_GRAD (just before the next reduction), and nowhere before; the step ends after the last wait."""
    profile = uniform(4, 1e-3, 2e-3, 2**26, 2**16, 2**16)  # large weights: each reduction outlasts a sweep
    cluster = Cluster(8, 8, 2**40, 1e9, 1e8, overlap_reductions=True)
    prediction = simulate(Plan("breadth_first", 2, 2, 2, 2, 1), profile, cluster)
    waits = [s for s in prediction.spans if s.kind == "reduce_wait"]
    reduces = {(s.rank, s.stage): s for s in prediction.spans if s.kind == "reduce"}
    assert waits, "the first reduction outlasts the next stage's backward sweep"
    for wait in waits:
        assert math.isclose(wait.end, reduces[(wait.rank, wait.stage)].end)  # until that stage's reduction ends
        later = [s for s in prediction.spans if s.rank == wait.rank and s.kind == "backward" and s.start > wait.start]
        assert all(s.start >= wait.end for s in later)
    assert prediction.step_time >= max(s.end for s in reduces.values())


def test_one_command_plan_for_a_lightning_module(capsys, tmp_path):
    # measures examples/train_gpt.py's GPT on one micro-batch of its DataModule, then ranks layouts
    main(["--module", "examples.train_gpt:GPT", "--init-args", '{"layers": 4, "dim": 32}',
          "--datamodule", "examples.train_gpt:SortDigitsData", "--microbatch-size", "4", "--repeats", "1",
          "--devices", "4", "--memory", "4GiB", "--intra-node-bandwidth", "10GB/s", "--global-batch", "32",
          "--top", "2"])  # fmt: skip
    out = capsys.readouterr().out
    assert out.startswith("GPT: 6 layers") and "| 1 |" in out
    main(["profile", "--module", "examples.train_gpt:GPT", "--init-args", '{"layers": 2, "dim": 16}',
          "--datamodule", "examples.train_gpt:SortDigitsData", "--microbatch-size", "8", "--repeats", "1",
          "--out", str(tmp_path / "profile.json")])  # fmt: skip
    from lightning_bfpp.plan import ModelProfile

    assert ModelProfile.from_json(tmp_path / "profile.json").microbatch_size == 8


def test_runtime_calibration_fits_per_action_and_per_step_costs():
    from lightning_bfpp.measure.calibrate import fit_runtime_costs, runtime_configs

    # 16 and 64 actions per rank; the runtime adds 5 ms per step and 1 ms per action
    rows = [
        {"actions": 16, "simulated_s": 0.100, "measured_s": 0.100 + 0.005 + 0.016},
        {"actions": 64, "simulated_s": 0.300, "measured_s": 0.300 + 0.005 + 0.064},
    ]
    assert fit_runtime_costs(rows) == pytest.approx((0.001, 0.005))
    # weighted as the simulation charges them: 46 and 142 actions on the critical path, the step cost once
    rows = [
        {"actions": 32, "action_weight": 46.0, "step_weight": 1.0, "simulated_s": 0.4,
         "measured_s": 0.4 + 0.005 + 0.046},
        {"actions": 128, "action_weight": 142.0, "step_weight": 1.0, "simulated_s": 1.2,
         "measured_s": 1.2 + 0.005 + 0.142},
    ]  # fmt: skip
    assert fit_runtime_costs(rows) == pytest.approx((0.001, 0.005))
    # an excess that no positive step cost explains: 0 per step, the cost per action fitted over both runs
    rows[0]["measured_s"], rows[1]["measured_s"] = 0.4 + 0.040, 1.2 + 0.150
    per_action, per_step = fit_runtime_costs(rows)
    assert per_step == 0.0
    assert per_action == pytest.approx((46 * 0.040 + 142 * 0.150) / (46**2 + 142**2))
    with pytest.raises(ValueError, match="must differ"):
        fit_runtime_costs([rows[0], rows[0]])
    for devices in (2, 4, 8):  # the two layouts use every process and differ only in actions per rank (4×)
        few, many = runtime_configs(devices)
        assert few.pipeline_parallel_size * few.data_parallel_size == devices
        assert many.num_microbatches == 4 * few.num_microbatches and many.stages_per_rank == few.stages_per_rank
    with pytest.raises(ValueError, match="do not divide"):
        runtime_configs(3)


def test_runtime_costs_are_weighted_by_the_actions_on_the_critical_path():
    from lightning_bfpp.measure.calibrate import RUNTIME_MODEL, cost_weights, runtime_configs

    model = RUNTIME_MODEL
    profile = uniform(model.layers, model.forward_ms / 1e3, model.backward_ms / 1e3, model.param_bytes,
                      model.activation_bytes, optimizer_state_ratio=0.0)  # fmt: skip
    links = Cluster(num_devices=8, devices_per_node=8, memory_bytes=2**34, intra_node_bandwidth=1e12,
                    inter_node_bandwidth=1e12, latency_s=0.0)  # fmt: skip
    for config in runtime_configs(8):
        weights = cost_weights(config, profile, links)
        p, v, m = config.pipeline_parallel_size, config.stages_per_rank, config.num_microbatches
        # more than a rank's own 2·m·v actions: the pipeline's fill and drain are on the path too
        assert 2 * m * v < weights["action_weight"] <= 2 * (m * v + p - 1) + 1e-6
        assert weights["step_weight"] == pytest.approx(1.0)


class _Strategy:
    """Stands for the strategy the runtime's calibration trains with (``BFPPStrategy``), which it is given."""


def test_runtime_calibration_alternates_rounds_and_takes_each_layouts_median(monkeypatch):
    from lightning_bfpp.measure import calibrate as calibration

    few, many = calibration.runtime_configs(2)
    order: list[int] = []
    # the second round of the many-action layout was disturbed (other work on the machine): 1 s instead of 0.3
    steps = {few.num_microbatches: [0.10, 0.11, 0.12], many.num_microbatches: [0.30, 1.00, 0.32]}

    def run_emulated(config, model, steps_, devices, strategy):
        assert strategy is _Strategy  # what the calibration was given to train with
        order.append(config.num_microbatches)
        return steps[config.num_microbatches][order.count(config.num_microbatches) - 1]

    monkeypatch.setattr(calibration, "run_emulated", run_emulated)
    links = Cluster(num_devices=2, devices_per_node=2, memory_bytes=2**30, intra_node_bandwidth=1e9,
                    inter_node_bandwidth=1e9)  # fmt: skip
    cluster, rows = calibration.measure_runtime(2, links, steps=3, rounds=3, tensor=False, strategy=_Strategy)
    assert order == [few.num_microbatches, many.num_microbatches] * 3  # alternating, so drift reaches both
    assert [r["measured_s"] for r in rows] == [0.11, 0.32]  # the medians: the disturbed round is dropped
    assert [r["rounds_s"] for r in rows] == [steps[few.num_microbatches], steps[many.num_microbatches]]
    # each run weighted by its actions on the critical path, more than a rank's own (see cost_weights)
    assert all(r["action_weight"] > r["actions"] for r in rows)
    assert (cluster.action_overhead_s, cluster.step_overhead_s) == pytest.approx(calibration.fit_runtime_costs(rows))
    with pytest.raises(ValueError, match="at least one round"):
        calibration.measure_runtime(2, links, rounds=0, strategy=_Strategy)


def test_the_runtime_costs_range_is_their_fit_on_each_round_alone():
    """``plan calibrate --timings``: each runtime cost fitted on one round of every layout; a round in which the
    many-action layout was disturbed shows as the top of the cost per action's range, which the medians drop."""
    from lightning_bfpp.measure import calibrate as calibration

    def row(actions: float, weight: float, step_weight: float, extra: list[float], **more: float) -> dict:
        return {"actions": actions, "action_weight": weight, "step_weight": step_weight, "simulated_s": 1.0,
                "rounds_s": [1.0 + e for e in extra], "measured_s": 1.0 + statistics.median(extra), **more}  # fmt: skip

    # 5 ms per step and 1 ms per action in rounds 0 and 2; round 1 of the second layout 9.6 ms slower
    rows = [row(16, 22, 1, [0.027, 0.027, 0.027]), row(64, 70, 1, [0.075, 0.0846, 0.075])]
    # the replicated layouts: 0.5 ms per action more (round 2: 1 ms), their per-step cost left out
    replicated = [row(16, 22, 0, [0.033, 0.033, 0.033]), row(64, 70, 0, [0.105, 0.105, 0.129])]
    spread = calibration.runtime_spread(rows + [{**r, "data_parallel_action_overhead_s": 0.0} for r in replicated])
    # round 1 alone: 1.2 ms per action and 0.6 ms per step
    assert spread["action_overhead_s"] == pytest.approx((0.001, 0.0012))
    assert spread["step_overhead_s"] == pytest.approx((0.0006, 0.005))
    # per round 1.5, 1.5 and 2 ms per replicated action, less that round's unreplicated cost
    assert spread["data_parallel_action_overhead_s"] == pytest.approx((0.0003, 0.001))
    assert calibration.fit_runtime_costs(rows) == pytest.approx((0.001, 0.005))  # the medians: round 1 dropped
    assert "data_parallel_action_overhead_s" not in calibration.runtime_spread(rows)


def test_the_first_gather_runs_beside_the_steps_host_work():
    # one stage of 600 bytes over dp=2: a gather takes 3 s (300 of 600 bytes at 100 B/s), the step's host work 5 s
    profile = uniform(2, 1.0, 2.0, 300, 1, 1, optimizer_state_ratio=0.0)
    quiet = Cluster(2, 2, 2**40, 100.0, 100.0, latency_s=0.0)
    busy = Cluster(2, 2, 2**40, 100.0, 100.0, latency_s=0.0, step_overhead_s=5.0)
    config = Plan("breadth_first", 1, 2, 1, 1, 1)
    alone = simulate(config, profile, quiet).step_time
    assert alone == pytest.approx(3 + 2 + 4 + 3)  # gather, forward, backward, blocking reduce
    prefetched = simulate(config, profile, busy)
    assert prefetched.step_time == pytest.approx(5 + alone - 3)  # the gather is hidden behind the host work
    spans = [(s.kind, s.start) for s in prefetched.spans if s.rank == 0 and s.kind in ("gather", "forward")]
    assert spans[:2] == [("gather", 0.0), ("forward", 5.0)]
    # without the runtime's prefetch, the first gather waits for the host work
    late = simulate(Plan("breadth_first", 1, 2, 1, 1, 1, prefetch_stages=0), profile, busy)
    assert next(s.start for s in late.spans if s.rank == 0 and s.kind == "gather") == pytest.approx(5.0)


def test_only_the_steps_first_gather_pays_the_contention_of_every_rank_gathering_at_once():
    # two stages per rank of 600 bytes over dp=2: each gather takes 3 s; the step's first takes 2.5× that, 7.5 s,
    # of which the 5 s of host work hide 5
    profile = uniform(4, 1.0, 2.0, 300, 1, 1, optimizer_state_ratio=0.0)
    busy = Cluster(2, 2, 2**40, 100.0, 100.0, latency_s=0.0, step_overhead_s=5.0)
    contended = replace(busy, first_gather_slowdown=2.5)
    config = Plan("breadth_first", 1, 2, 2, 1, 1, sharding="full_shard")
    gathers = [s.duration for s in simulate(config, profile, contended).spans if s.kind == "gather"]
    assert len(gathers) > 1
    assert gathers[0] == pytest.approx(7.5) and gathers[1:] == pytest.approx([3.0] * (len(gathers) - 1))
    step = simulate(config, profile, busy).step_time
    assert simulate(config, profile, contended).step_time == pytest.approx(step + 7.5 - 5)
    # without replicas there is nothing to gather, and nothing changes
    alone = Plan("breadth_first", 1, 1, 2, 1, 1)
    assert simulate(alone, profile, contended).step_time == simulate(alone, profile, busy).step_time


def test_only_each_ranks_last_reduction_pays_the_contention_of_every_rank_ending_its_step():
    # two stages per rank of 600 bytes over dp=2, blocking reductions: each reduce-scatter takes 3 s (300 of 600
    # bytes at 100 B/s), each rank's last 2× that
    profile = uniform(4, 1.0, 2.0, 300, 1, 1, optimizer_state_ratio=0.0)
    quiet = Cluster(2, 2, 2**40, 100.0, 100.0, latency_s=0.0)
    contended = replace(quiet, last_reduce_slowdown=2.0)
    config = Plan("breadth_first", 1, 2, 2, 1, 1, sharding="full_shard")
    reductions = [s.duration for s in simulate(config, profile, contended).spans if s.kind == "reduce"]
    assert reductions == pytest.approx([3.0, 6.0])  # the stage reduced last, at the step's end
    step = simulate(config, profile, quiet).step_time
    assert simulate(config, profile, contended).step_time == pytest.approx(step + 3)
    # without replicas there is nothing to reduce, and nothing changes
    alone = Plan("breadth_first", 1, 1, 2, 1, 1)
    assert simulate(alone, profile, contended).step_time == simulate(alone, profile, quiet).step_time


def test_the_links_are_fitted_on_each_sizes_median_over_rounds_and_a_slow_round_only_widens_the_spread():
    """``calibrate`` sweeps every link's sizes ``link_rounds`` times: one slow spell of the shared host (here a
    round with a third of the bandwidth) moves the fitted terms not at all and shows in their spread."""
    from lightning_bfpp.measure import calibrate as calibration

    def seconds(nbytes: int, bandwidth: float, factor: float) -> float:  # ring over 2 ranks: half the bytes move
        return 1e-3 + factor * nbytes / 2 / bandwidth

    sizes = calibration.SIZES
    rounds = {
        name: [(b, [seconds(b, bw, 1.0), seconds(b, bw / 3, 1.0), seconds(b, bw, 1.02)]) for b in sizes]
        for name, bw in (("p2p", 4e9), ("all_gather", 1e9), ("reduce_scatter", 0.5e9), ("all_reduce", 1e9))
    }
    rounds["p2p"] = [(b, [2 * t - 1e-3 for t in ts]) for b, ts in rounds["p2p"]]  # the whole message, one latency
    terms = calibration.link_terms(calibration.link_timings(rounds, statistics.median), 2)
    assert terms["intra_node_bandwidth"] == pytest.approx(1e9 / 1.02)
    assert terms["reduce_bandwidth_ratio"] == pytest.approx(0.5)
    assert terms["all_reduce_bandwidth_ratio"] == pytest.approx(2.0)  # twice the bytes in the same time
    spread = calibration.link_spread(rounds, 2)
    assert spread["intra_node_bandwidth"] == pytest.approx((1e9 / 3, 1e9))
    assert spread["reduce_bandwidth_ratio"] == pytest.approx((0.5, 0.5))  # the slow round slowed every link alike


def test_a_contended_collectives_slowdown_is_its_measured_time_over_the_links_price():
    from lightning_bfpp.plan.cluster import contended_slowdown

    # 16 MiB over 2 ranks at 1 GB/s with 1 ms per call: 1 ms + 8 MiB / 1 GB/s ≈ 9.39 ms for a gather alone, and a
    # reduce-scatter at half the bandwidth 1 ms + 8 MiB / 0.5 GB/s
    cluster = Cluster(4, 4, 2**40, 1e9, 1e9, latency_s=0.0, collective_overhead_s=1e-3, reduce_bandwidth_ratio=0.5)
    gather, reduce = 1e-3 + (8 << 20) / 1e9, 1e-3 + (8 << 20) / 0.5e9
    assert contended_slowdown(cluster, "all_gather", 2, 16 << 20, 3 * gather) == pytest.approx(3.0)
    assert contended_slowdown(cluster, "reduce_scatter", 2, 16 << 20, 3 * gather) == pytest.approx(3 * gather / reduce)
    # a host quicker than its fitted links does not make these collectives cheaper than the others
    assert contended_slowdown(cluster, "all_gather", 2, 16 << 20, 0.5 * gather) == 1.0
    assert contended_slowdown(cluster, "reduce_scatter", 2, 16 << 20, 0.5 * reduce) == 1.0


def test_calibrate_writes_the_cluster_and_with_timings_what_it_was_fitted_on(tmp_path, monkeypatch, capsys):
    from lightning_bfpp.measure import calibrate as calibration

    cluster = Cluster(2, 2, 2**30, 1e9, 1e9, last_reduce_slowdown=1.5)
    timings = {"link_spread": {"reduce_bandwidth_ratio": [0.4, 0.6]}}
    given: list[object] = []

    def calibrate(devices, group_size, runtime, strategy):
        given.append(strategy)
        return cluster, timings

    monkeypatch.setattr(calibration, "calibrate", calibrate)
    main(["calibrate", "--devices", "2", "--no-runtime", "--out", str(tmp_path / "c.json"),
          "--timings", str(tmp_path / "t.json")])  # fmt: skip
    assert given == [None]  # links only: nothing to train with
    assert Cluster.from_json(tmp_path / "c.json") == cluster
    assert json.loads((tmp_path / "t.json").read_text()) == timings
    assert "t.json" in capsys.readouterr().out


def test_the_links_collective_calls_run_on_a_gloo_group(tmp_path):
    """The calls ``calibrate`` times for each collective (torch's ``all_gather_single``, ``reduce_scatter_single``
    and ``all_reduce``), on a one-process gloo group; the ping-pong needs two processes and is left out."""
    import torch
    import torch.distributed as dist

    from lightning_bfpp.measure import calibrate as calibration

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        calls = calibration._link_calls(0, dist.group.WORLD, 1, 4 << 10, torch.device("cpu"))
        assert set(calls) == set(calibration.LINKS) and calls["p2p"][1] == 2
        for name in ("all_gather", "reduce_scatter", "all_reduce"):
            fn, transfers = calls[name]
            assert transfers == 1
            fn()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_a_contended_collective_is_timed_from_the_call_to_its_end_while_the_host_works(tmp_path, collective):
    """``calibrate``'s measurement on a one-process gloo group: torch's async gather, polled while the host works,
    and its async reduce-scatter, waited for at once (the calls the calibration relies on)."""
    import torch
    import torch.distributed as dist

    from lightning_bfpp.measure import calibrate as calibration

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        timings = calibration._contended(0, 1, 1, 1, torch.device("cpu"), False, 0.5, collective, warmup=0)
    finally:
        dist.destroy_process_group()
    ((nbytes, seconds),) = timings
    assert nbytes == calibration.CONTENDED_BYTES
    assert 0 < seconds < 0.5  # noted while the host worked: 16 MiB in one process ends long before


def test_the_runtime_calibration_recovers_the_data_parallel_cost_per_action_from_two_steps():
    """``measure_runtime``'s data-parallel layouts: the extra cost per action on a replicated stage that makes the
    simulated steps the measured ones (steps simulated with 0.7 ms give back 0.7 ms), whatever the replicated
    steps' own cost per step; charged by the simulator only where there are replicas."""
    from lightning_bfpp.measure import calibrate as calibration

    configs = calibration.data_parallel_runtime_configs(8)
    assert configs is not None
    few, many = configs
    assert all((c.pipeline_parallel_size, c.data_parallel_size, c.sharding) == (4, 2, "full_shard") for c in configs)
    assert many.num_microbatches == 4 * few.num_microbatches and many.stages_per_rank == few.stages_per_rank
    assert calibration.data_parallel_runtime_configs(2) is None
    assert calibration.data_parallel_runtime_configs(6) is not None
    assert calibration.data_parallel_runtime_configs(5) is None
    profile = uniform(16, 5e-3, 10e-3, 1 << 20, 4096, optimizer_state_ratio=0.0)
    links = Cluster(8, 8, 2**40, 1e9, 1e9, latency_s=1e-4)
    # the replicated steps also carry 9 ms per step that nothing simulated prices (the optimizer's and FSDP2's own
    # work): read from one step's residual it would pass for a cost per action, the difference of two steps
    # that differ only in actions cancels it
    truth = replace(links, action_overhead_s=1e-3, data_parallel_action_overhead_s=7e-4)
    rows = [{"actions": 2 * c.stages_per_rank * c.num_microbatches,
             "measured_s": simulate(c, profile, truth).step_time + 9e-3,
             **calibration.cost_weights(c, profile, links)} for c in configs]  # fmt: skip
    assert calibration.data_parallel_action_cost(rows, 1e-3) == pytest.approx(7e-4, rel=2e-2)
    one_step = (rows[0]["measured_s"] - rows[0]["simulated_s"]) / rows[0]["action_weight"] - 1e-3
    assert one_step > 1.2 * 7e-4
    assert calibration.data_parallel_action_cost(rows, 5e-3) == 0.0  # never below 0
    # without replicas nothing changes; with them every action pays it
    cluster = replace(links, action_overhead_s=1e-3)
    costly = replace(cluster, data_parallel_action_overhead_s=5e-3)
    alone = Plan("breadth_first", 4, 1, 2, 8, 1)
    assert simulate(alone, profile, costly).step_time == pytest.approx(simulate(alone, profile, cluster).step_time)
    v, m = few.stages_per_rank, few.num_microbatches
    assert simulate(few, profile, costly).step_time > simulate(few, profile, cluster).step_time + 2 * m * v * 4e-3


def test_the_runtime_calibration_runs_every_layout_in_alternating_rounds(monkeypatch):
    """At 4 processes all four layouts run, alternating round by round, and the costs fitted from steps simulated
    with known costs are those costs."""
    from lightning_bfpp.measure import calibrate as calibration

    truth = dict(action_overhead_s=1.5e-3, step_overhead_s=4e-3, tensor_collective_overhead_s=2e-3,
                 data_parallel_action_overhead_s=8e-4)  # fmt: skip
    links = Cluster(4, 4, 2**40, 1e9, 1e9, latency_s=1e-4)
    profile = uniform(16, 5e-3, 10e-3, calibration.RUNTIME_MODEL.param_bytes, 4096, optimizer_state_ratio=0.0)
    order: list[str] = []

    def run_emulated(config, model, steps, devices, strategy):
        assert strategy is _Strategy
        order.append(config.describe())
        layers = tuple(replace(layer, param_bytes=model.param_bytes, tensor_parallel_all_reduces=1)
                       for layer in profile.layers)  # fmt: skip
        return simulate(config, replace(profile, layers=layers), replace(links, **truth)).step_time

    monkeypatch.setattr(calibration, "run_emulated", run_emulated)
    monkeypatch.setattr("lightning_bfpp.measure.profile.profile_module", lambda *args, **kwargs: profile)
    cluster, rows = calibration.measure_runtime(4, links, steps=3, rounds=2, strategy=_Strategy)
    layouts = [*calibration.runtime_configs(4), calibration.tensor_runtime_config(4),
               *calibration.data_parallel_runtime_configs(4)]  # fmt: skip
    assert order == [config.describe() for config in layouts] * 2
    assert len(rows) == 5
    for field, value in truth.items():
        assert getattr(cluster, field) == pytest.approx(value, rel=2e-2), field


def test_the_runtime_calibration_is_given_its_strategy_and_profiles_what_the_emulated_step_passes_on():
    """The measuring code imports nothing above the engine: the runtime's calibration trains with the strategy it
    is given (by its import name, in the job's processes), and profiles the emulated model on what its
    ``training_step`` passes to ``self(...)`` without the strategy's capture."""
    import torch

    from lightning_bfpp.adapter.strategy import BFPPStrategy
    from lightning_bfpp.adapter.user_step import training_step_input
    from lightning_bfpp.measure import calibrate as calibration
    from lightning_bfpp.measure import emulated_jobs
    from lightning_bfpp.measure.emulated import EmulatedNet

    with pytest.raises(ValueError, match="pass it, or runtime=False"):
        calibration.calibrate(2)  # refused before anything is measured
    assert emulated_jobs._imported(emulated_jobs._importable_name(BFPPStrategy)) is BFPPStrategy

    class Local:
        pass

    with pytest.raises(ValueError, match="cannot be imported by name"):
        emulated_jobs._importable_name(Local)
    batch = (torch.randn(1, calibration.RUNTIME_MODEL.activation_numel),)
    net = EmulatedNet(calibration.RUNTIME_MODEL)
    ours, theirs = calibration._emulated_input(net, batch), training_step_input(net, batch)
    assert ours[1] == theirs[1] == {} and len(ours[0]) == len(theirs[0]) == 1 and ours[0][0] is theirs[0][0]


def test_the_runtime_calibration_recovers_a_tensor_all_reduces_cost_from_a_step():
    """``measure_runtime``'s third layout: the fixed cost per tensor all-reduce that makes the simulated step the
    measured one. A step simulated with 2 ms per all-reduce gives back 2 ms."""
    from lightning_bfpp.measure import calibrate as calibration

    config = calibration.tensor_runtime_config(4)
    assert config is not None and config.tensor_parallel_size == 2 and config.pipeline_parallel_size == 2
    assert calibration.tensor_runtime_config(3) is None
    profile = uniform(16, 5e-3, 10e-3, 4096, 4096, optimizer_state_ratio=0.0)
    profile = replace(profile, layers=tuple(replace(layer, tensor_parallel_all_reduces=1) for layer in profile.layers))
    cluster = Cluster(4, 4, 2**40, 1e9, 1e9, latency_s=0.0, action_overhead_s=1e-3)
    measured = simulate(config, profile, replace(cluster, tensor_collective_overhead_s=2e-3)).step_time
    row = calibration._tensor_cost(config, profile, cluster, measured)
    assert row["tensor_collective_overhead_s"] == pytest.approx(2e-3, rel=1e-3)
    assert row["tensor_all_reduces"] >= 2 * 4 * config.stages_per_rank  # per layer, forward and backward
