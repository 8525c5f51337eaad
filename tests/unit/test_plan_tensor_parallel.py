"""The planner's model of tensor parallelism inside stages (pure, no processes)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_bfpp.plan import Cluster, Plan, SearchSpace, gpt, search, simulate
from lightning_bfpp.plan.cluster import tensor_all_reduce_s, tensor_groups_as_devices

CLUSTER = Cluster(num_devices=16, devices_per_node=8, memory_bytes=80 * 2**30, intra_node_bandwidth=200e9,
                  inter_node_bandwidth=25e9, latency_s=10e-6)  # fmt: skip
MODEL = gpt(num_layers=16, hidden=4096, sequence=2048, vocab=51200, flops_per_second=150e12)


def test_a_split_block_costs_each_rank_its_share_plus_two_all_reduces_each_way():
    block = MODEL.layers[1]
    assert block.tensor_parallel_all_reduces == 2 and MODEL.layers[0].tensor_parallel_all_reduces == 0
    all_reduce = tensor_all_reduce_s(CLUSTER, 4, block.output_bytes)
    # a ring all-reduce inside the node: 2(t − 1)/t of the bytes over the node's links, 2(t − 1) steps
    assert all_reduce == pytest.approx(6 * 10e-6 + 1.5 * block.output_bytes / 200e9)
    split = block.split_over_tensor_group(4, lambda n: tensor_all_reduce_s(CLUSTER, 4, n))
    assert split.forward_s == pytest.approx(block.forward_s / 4 + 2 * all_reduce)
    assert split.backward_s == pytest.approx(block.backward_s / 4 + 2 * all_reduce)
    assert split.param_bytes == block.param_bytes // 4
    assert split.output_bytes == block.output_bytes  # whole on every tensor rank (no sequence parallelism)
    # activations: all but the norms' and residuals' inputs (10·s·h bytes) are sharded
    assert split.saved_bytes == block.saved_bytes - (block.saved_bytes - 10 * 2048 * 4096) * 3 // 4
    assert MODEL.layers[0].split_over_tensor_group(4, lambda n: 1.0) == MODEL.layers[0]  # not split: whole


def test_tensor_groups_are_the_layouts_devices():
    assert tensor_groups_as_devices(CLUSTER, 4) == replace(CLUSTER, num_devices=4, devices_per_node=2)
    with pytest.raises(ValueError, match="must divide the devices of a node"):
        tensor_groups_as_devices(CLUSTER, 3)


def test_tensor_parallelism_trades_compute_and_memory_for_all_reduces():
    base = Plan("breadth_first", 2, 8, 2, 4, 1)
    tp = Plan("breadth_first", 2, 2, 2, 4, 1, tensor_parallel_size=4)
    alone, split = simulate(base, MODEL, CLUSTER), simulate(tp, MODEL, CLUSTER)
    assert "t=4" in tp.describe()
    # a quarter of the weights per rank (the embedding and head are not split), less activation memory
    assert split.peak_memory < 0.5 * alone.peak_memory
    # per replica the same batch now runs on 4 times the devices: the step is shorter, but not 4 times
    assert alone.step_time / 4 < split.step_time < alone.step_time
    # with the node's links 100 times slower, the all-reduces dominate and the split loses
    slow = replace(CLUSTER, intra_node_bandwidth=2e9)
    assert simulate(tp, MODEL, slow).step_time > simulate(tp, MODEL, CLUSTER).step_time * 1.5


def test_the_search_considers_tensor_sizes_that_divide_a_node():
    space = SearchSpace(schedules=("breadth_first",), shardings=("full_shard",), tensor_parallel_sizes=(1, 2, 3, 4))
    candidates = search(MODEL, CLUSTER, 16, space)
    sizes = {c.config.tensor_parallel_size for c in candidates}
    assert sizes == {1, 2, 4}  # 3 divides no node of 8
    assert all(c.config.pipeline_parallel_size * c.config.data_parallel_size * c.config.tensor_parallel_size == 16
               for c in candidates)  # fmt: skip


def test_the_command_line_considers_the_tensor_sizes_it_is_given(capsys):
    from lightning_bfpp.plan.__main__ import main

    args = ["--gpt", "16,4096,2048,51200", "--flops", "150e12", "--devices", "16", "--devices-per-node", "8",
            "--memory", "80GiB", "--intra-node-bandwidth", "200GB/s", "--inter-node-bandwidth", "25GB/s",
            "--global-batch", "8", "--schedules", "breadth_first", "--top", "200"]  # fmt: skip
    main(args)
    assert "| dp | v |" in capsys.readouterr().out  # no tensor column without tensor groups
    main([*args, "--tensor-parallel-sizes", "1,2,4"])
    out = capsys.readouterr().out
    assert "| dp | t | v |" in out
    sizes = {line.split(" | ")[4] for line in out.splitlines() if line.startswith("| ") and "breadth_first" in line}
    assert sizes == {"1", "2", "4"}


def test_a_tensor_all_reduce_pays_its_own_measured_fixed_cost():
    """``plan calibrate`` measures a tensor group's all-reduce as a step runs it (right after each member's own
    work); where it has, that fixed cost replaces the quiet collectives' one."""
    quiet = replace(CLUSTER, collective_overhead_s=1e-3)
    in_step = replace(quiet, tensor_collective_overhead_s=3e-3)
    assert tensor_all_reduce_s(in_step, 2, 4096) - tensor_all_reduce_s(quiet, 2, 4096) == pytest.approx(2e-3)
    assert tensor_all_reduce_s(in_step, 1, 4096) == 0.0


def test_a_layer_measured_split_only_gains_its_all_reduces_and_only_at_its_size():
    """ "auto" with tensor parallelism measures each layer split (one rank's share, collectives taken out):
    the planner adds the all-reduces as the cluster prices them and divides nothing again."""
    share = replace(MODEL.layers[1].split_over_tensor_group(4, lambda n: 0.0), tensor_parallel_all_reduces=2,
                    measured_split=4)  # fmt: skip
    all_reduce = tensor_all_reduce_s(CLUSTER, 4, share.output_bytes)
    planned = share.split_over_tensor_group(4, lambda n: tensor_all_reduce_s(CLUSTER, 4, n))
    assert planned.forward_s == pytest.approx(share.forward_s + 2 * all_reduce)
    assert planned.backward_s == pytest.approx(share.backward_s + 2 * all_reduce)
    assert planned.weight_grad_s == share.weight_grad_s  # the weight gradient waits for no other rank
    assert (planned.param_bytes, planned.saved_bytes) == (share.param_bytes, share.saved_bytes)
    for size in (1, 2):
        match = f"measured split over 4 tensor ranks cannot be planned at tensor_parallel_size={size}"
        with pytest.raises(ValueError, match=match):
            simulate(Plan("breadth_first", 2, 2, 1, 4, 1, tensor_parallel_size=size),
                     replace(MODEL, layers=(share,) * 4), replace(CLUSTER, num_devices=4 * size))  # fmt: skip


def test_with_a_per_replica_batch_a_tensor_group_loads_one_replicas_batch():
    """Lightning's batch size is per process; the ranks of a tensor group load the same batch, so the global
    batch is the per-replica batch times the data-parallel size, not times the processes."""
    from lightning_bfpp.plan.search import search_per_replica_batch

    space = SearchSpace(schedules=("breadth_first",), shardings=("full_shard",), stages_per_rank=(1,),
                        tensor_parallel_sizes=(2,))  # fmt: skip
    candidates = search_per_replica_batch(MODEL, replace(CLUSTER, num_devices=8), 4, space)
    assert candidates
    for c in candidates:
        cfg = c.config
        assert cfg.tensor_parallel_size == 2
        assert cfg.pipeline_parallel_size * cfg.data_parallel_size * 2 == 8
        assert cfg.num_microbatches * cfg.microbatch_size == 4
