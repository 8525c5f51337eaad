"""``sharding="hybrid_shard"``: which configurations are accepted, and which ranks shard and replicate together.

The validation and the rank groups are pure (:mod:`lightning_bfpp.plan.config`); the device mesh the stages shard
over is built for every rank of an 8-rank world in one process, on torch's fake process group (no
communication), and must give each rank exactly those groups.
"""

import itertools

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_bfpp.engine.sharding import REPLICATE, SHARD, build_mesh, data_parallel_mesh, second_data_parallel_group
from lightning_bfpp.plan.config import PipelineConfig
from lightning_bfpp.plan.mesh import MeshShape


def resolve(world: int, per_node: int, p: int, order: str = "data_pipeline") -> MeshShape:
    config = PipelineConfig(pipeline_parallel_size=p, sharding="hybrid_shard", mesh_order=order)
    return config.resolve_mesh(world, per_node)


def test_accepted_layouts_and_their_groups():
    # 2 nodes of 2, one pipeline rank: 2 replicas of 2 shards
    shape = resolve(4, 2, 1)
    assert (shape.data_parallel_size, shape.shard_size, shape.replicate_size) == (4, 2, 2)
    assert shape.hybrid_groups() == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    # 2 nodes of 4, pipelines of 2 consecutive ranks: a node holds 2 ranks of each data-parallel group
    assert resolve(8, 4, 2).hybrid_groups() == ([[0, 2], [4, 6], [1, 3], [5, 7]], [[0, 4], [2, 6], [1, 5], [3, 7]])
    # 4 nodes of 2, data-parallel groups of 4 consecutive ranks (pipeline_data)
    shape = resolve(8, 2, 2, "pipeline_data")
    assert shape.hybrid_groups() == ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2], [1, 3], [4, 6], [5, 7]])
    # no hybrid_shard: no shard size
    assert PipelineConfig(pipeline_parallel_size=1).resolve_mesh(4, 2).shard_size is None


@pytest.mark.parametrize(
    ("world", "per_node", "p", "order", "match"),
    [
        (4, 4, 1, "data_pipeline", r"each data-parallel group \(4 ranks\) lies inside one node"),
        (8, 4, 2, "pipeline_data", "lies inside one node"),
        (4, 2, 2, "data_pipeline", "each node holds one rank of each data-parallel group"),
        (8, 2, 2, "data_pipeline", "nothing to shard inside a node"),
        (12, 4, 3, "data_pipeline", r"spread unevenly over nodes \(pipeline rank 0's: 2, 1, 1 per node\)"),
        (6, 3, 2, "data_pipeline", "spread unevenly"),
    ],
)
def test_refused_layouts_name_the_problem_and_the_fix(world, per_node, p, order, match):
    with pytest.raises(ValueError, match=match) as error:
        resolve(world, per_node, p, order)
    message = str(error.value)
    assert message.startswith("BFPPStrategy: sharding='hybrid_shard' shards inside a node")
    assert "multiple of the data-parallel ranks per node and larger than it" in message
    assert "use sharding='full_shard' or 'no_shard'" in message


def test_the_planner_plans_it():  # lightning_bfpp.plan models hybrid sharding (docs/weight-passing.md)
    assert PipelineConfig(pipeline_parallel_size="auto", sharding="hybrid_shard").sharding == "hybrid_shard"


LAYOUTS = [(w, n) for w in (4, 8, 12, 16, 24) for n in (1, 2, 3, 4, 6, 8, 12) if w % n == 0]


@pytest.mark.parametrize(("world", "per_node"), LAYOUTS)
def test_every_accepted_layout_shards_inside_nodes_and_replicates_across_them(world, per_node):
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    for p, order in itertools.product(divisors, ("data_pipeline", "pipeline_data")):
        try:
            shape = resolve(world, per_node, p, order)
        except ValueError:
            continue
        shard, replicate = shape.hybrid_groups()
        assert 1 < shape.shard_size < shape.data_parallel_size
        assert all(len({r // per_node for r in group}) == 1 for group in shard)  # a shard group: one node
        assert all(len({r // per_node for r in group}) == len(group) for group in replicate)  # one rank a node
        assert sorted(r for group in shard for r in group) == list(range(world))
        assert sorted(r for group in replicate for r in group) == list(range(world))
        for group in shard:  # every pair (shard group, replicate group) of a data-parallel group meets once
            assert all(len(set(group) & set(other)) <= 1 for other in replicate)


@pytest.mark.parametrize(("per_node", "order"), [(4, "data_pipeline"), (2, "pipeline_data")])
def test_the_device_mesh_has_these_groups_on_every_rank(per_node, order):
    assert not dist.is_initialized()
    shape = resolve(8, per_node, 2, order)
    shard, replicate = shape.hybrid_groups()
    for rank in range(8):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
        try:
            mesh = build_mesh(torch.device("cpu"), shape)
            sharding_mesh = data_parallel_mesh(mesh, shape)
            assert sharding_mesh.mesh_dim_names == (REPLICATE, SHARD)
            shard_ranks, replicate_ranks = sharding_mesh[SHARD].mesh.tolist(), sharding_mesh[REPLICATE].mesh.tolist()
            assert shard_ranks in shard and rank in shard_ranks
            assert replicate_ranks in replicate and rank in replicate_ranks
            # the data-parallel dimension every other consumer reads is unchanged
            assert mesh.mesh_dim_names is not None and "data_parallel" in mesh.mesh_dim_names
            assert mesh["data_parallel"].size() == 4 and mesh.size() == 8
            # the communication thread's reduce-scatter group: the same ranks as the shard group
            second = second_data_parallel_group(mesh, shape.shard_size)
            assert dist.get_process_group_ranks(second) == sharding_mesh[SHARD].mesh.tolist()
        finally:
            dist.destroy_process_group()
