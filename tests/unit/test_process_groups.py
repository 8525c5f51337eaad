"""A later strategy setup in the same process gets the groups an earlier one created, and a new world new ones.

On torch's fake process group (no communication), one rank of an 8-rank world in this process: the device mesh
and the helper groups a second setup asks for are the first setup's objects, and the world's group registry
does not grow; after ``destroy_process_group`` and a new world they are created again.
"""

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_bfpp.engine.process_groups import reused
from lightning_bfpp.engine.sharding import build_mesh, data_parallel_mesh, second_data_parallel_group
from lightning_bfpp.plan.config import PipelineConfig
from lightning_bfpp.plan.mesh import MeshShape

CPU = torch.device("cpu")


def groups_in_world() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def setup_groups(shape: MeshShape) -> tuple:
    """What one strategy setup creates for ``shape``."""
    mesh = build_mesh(CPU, shape)
    return mesh, data_parallel_mesh(mesh, shape), second_data_parallel_group(mesh, shape.shard_size)


@pytest.fixture
def world():
    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=8)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_second_setup_with_the_same_layout_creates_no_group(world):
    shape = PipelineConfig(pipeline_parallel_size=2, sharding="hybrid_shard").resolve_mesh(8, 4)
    first = setup_groups(shape)
    created = groups_in_world()
    second = setup_groups(shape)
    assert all(a is b for a, b in zip(first, second, strict=True))
    assert groups_in_world() == created


def test_another_layout_gets_groups_of_its_own_and_both_stay(world):
    two, four = MeshShape(2, 4), MeshShape(4, 2)
    mesh_two, mesh_four = build_mesh(CPU, two), build_mesh(CPU, four)
    assert mesh_two is not mesh_four and mesh_four.shape == (2, 4)
    created = groups_in_world()
    assert build_mesh(CPU, two) is mesh_two and build_mesh(CPU, four) is mesh_four
    assert groups_in_world() == created


def test_purposes_that_must_not_share_a_group_get_two(world):
    """The communication thread's group has the mesh's data-parallel ranks, but is a group of its own (and is
    itself reused)."""
    mesh = build_mesh(CPU, MeshShape(2, 4))
    second = second_data_parallel_group(mesh, None)
    assert dist.get_process_group_ranks(second) == mesh["data_parallel"].mesh.tolist()
    assert second is not mesh.get_group("data_parallel")
    assert second_data_parallel_group(mesh, None) is second


def test_a_new_world_creates_them_again():
    made = []
    for _ in range(2):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
        try:
            made.append(build_mesh(CPU, MeshShape(2, 4)))
            assert reused("probe", object) is reused("probe", object)
        finally:
            dist.destroy_process_group()
    assert made[0] is not made[1]


def test_without_a_world_nothing_is_kept_across_worlds():
    assert not dist.is_initialized()
    kept = reused("probe", object)
    assert reused("probe", object) is kept  # no world is a world of its own
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        assert reused("probe", object) is not kept
    finally:
        dist.destroy_process_group()
