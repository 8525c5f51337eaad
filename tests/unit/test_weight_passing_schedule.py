"""The pure half of weight passing: chunk ownership on a node topology, the action lists, the configuration."""

from __future__ import annotations

import pytest

from lightning_bfpp.plan import Plan
from lightning_bfpp.plan.actions import REDUCE_GRAD, UNSHARD, Kind, format_schedule, max_resident_stages, validate
from lightning_bfpp.plan.config import PipelineConfig
from lightning_bfpp.plan.mesh import MeshShape
from lightning_bfpp.plan.schedules import generate
from lightning_bfpp.plan.schedules.weight_passing import weight_passing
from lightning_bfpp.plan.topology import NodeTopology


def test_tawpipe_placement_spreads_consecutive_chunks_over_nodes():
    topo = NodeTopology(world_size=8, processes_per_node=4)  # D = 2 nodes, S = 4
    owners = [topo.chunk_owner(c) for c in range(8)]
    assert owners == [0, 4, 1, 5, 2, 6, 3, 7]  # (c mod D)·S + c // D
    assert sorted(owners) == list(range(8))  # one chunk per rank
    # local rank j owns D consecutive chunks, one per node, all on its rail
    for j in range(4):
        mine = [c for c in range(8) if topo.local_rank(topo.chunk_owner(c)) == j]
        assert mine == [2 * j, 2 * j + 1]
        assert {topo.chunk_owner(c) for c in mine} == set(topo.rail_ranks(j))
    assert topo.rail_member(1, node=0) == 0 and topo.rail_member(1, node=1) == 4  # chunk 1's owner is rank 4
    assert NodeTopology(6, 2).rail_ranks(1) == (1, 3, 5)
    assert NodeTopology(6, 2).node_ranks(2) == (4, 5)
    with pytest.raises(ValueError, match="must divide"):
        NodeTopology(6, 4)


def test_weight_passing_order_and_its_transfers():
    schedule = weight_passing(num_chunks=3, num_microbatches=2)
    assert [str(a) for a in schedule[0]] == [
        "0F0", "1F0", "2F0", "2B0", "1B0", "0B0",
        "0F1", "1F1", "2F1", "2B1", "1B1", "0B1",
    ]  # fmt: skip
    validate(schedule, 1, 3, 2)
    assert generate("weight_passing", 1, 3, 2) == schedule
    with pytest.raises(ValueError, match="pipeline_parallel_size=1"):
        generate("weight_passing", 2, 3, 2)
    plan = Plan("weight_passing", 1, 3, 3, 2)  # three ranks, a chunk each, every rank running this list
    assert plan.compute == schedule
    lowered = plan.lowered()[0]
    text = format_schedule({0: lowered})
    actions = lowered
    # a gradient goes back to its owner after every backward, whatever the accumulation
    assert [a for a in actions if a.kind is REDUCE_GRAD] == [
        a for a in plan.lowered(reduce_grads=False)[0] if a.kind is REDUCE_GRAD
    ]
    assert sum(a.kind is REDUCE_GRAD for a in actions) == 6, text
    # fetches: every visit, except the last chunk's backward (it stays from its forward) and chunk 0's next
    # forward (it stays from its backward): 1 + N, 2N, N for chunks 0, middle, last
    fetches = [sum(a.kind is UNSHARD and a.stage == c for a in actions) for c in range(3)]
    assert fetches == [1 + 2, 2 * 2, 2], text
    assert max_resident_stages(actions) == 2  # the computing chunk and the one fetched ahead
    assert max_resident_stages(Plan("weight_passing", 1, 3, 3, 2, prefetch_stages=0).lowered()[0]) == 1
    assert all(a.kind is not Kind.UNSHARD or a.stage in range(3) for a in actions)


def test_configuration():
    config = PipelineConfig(schedule="weight_passing", processes_per_node=2)
    assert config.resolve_mesh(6, 2) == MeshShape(pipeline_parallel_size=1, data_parallel_size=6)
    layout = config.resolve_plan(MeshShape(1, 6), [10] * 12)
    assert layout.stages_per_rank == 6 and layout.num_microbatches == 1
    assert layout.stage_layer_counts == (2,) * 6
    for bad in (
        {"pipeline_parallel_size": 2},
        {"stages_per_rank": 2},
        {"data_parallel_size": 2},
        {"sharding": "no_shard"},
    ):
        with pytest.raises(ValueError, match="schedule='weight_passing' sets"):
            PipelineConfig(schedule="weight_passing", **bad)
    with pytest.raises(ValueError, match="one chunk per rank"):
        config.resolve_plan(MeshShape(1, 6), [10] * 4)
    with pytest.raises(ValueError, match="one chunk per rank"):
        PipelineConfig(schedule="weight_passing", partition=[1, 1]).resolve_plan(MeshShape(1, 4), [1] * 2)
    with pytest.raises(ValueError, match="processes_per_node"):
        PipelineConfig(processes_per_node=0)
