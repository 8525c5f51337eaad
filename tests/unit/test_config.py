"""Configuration errors are raised up front, name the argument and say what to do."""

import pytest

from lightning_bfpp.plan.config import PipelineConfig
from lightning_bfpp.plan.mesh import MeshShape


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pipeline_parallel_size": 0}, "pipeline_parallel_size` must be a positive int"),
        ({"stages_per_rank": -1}, "stages_per_rank"),
        ({"num_microbatches": 2.5}, "num_microbatches"),
        ({"schedule": "zigzag"}, "unknown `schedule='zigzag'`; choose one of breadth_first"),
        ({"sharding": "zero3"}, "unknown `sharding='zero3'`; choose one of full_shard"),
        ({"partition": "memory"}, "unknown `partition='memory'`"),
        ({"partition": [2, 0, 2]}, "positive ints"),
    ],
)
def test_invalid_arguments_are_rejected_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PipelineConfig(**kwargs)


def test_mesh_resolution():
    assert PipelineConfig().resolve_mesh(4, 4) == MeshShape(4, 1)
    assert PipelineConfig().resolve_mesh(8, 4) == MeshShape(4, 2)  # two nodes of four
    assert PipelineConfig(pipeline_parallel_size=2).resolve_mesh(8, 8) == MeshShape(2, 4)
    assert PipelineConfig(data_parallel_size=2).resolve_mesh(8, 8) == MeshShape(4, 2)
    with pytest.raises(ValueError, match="must divide the world size"):
        PipelineConfig(pipeline_parallel_size=3).resolve_mesh(4, 4)
    with pytest.raises(ValueError, match=r"2 × 4 = 8, but the world size .* is 4"):
        PipelineConfig(pipeline_parallel_size=2, data_parallel_size=4).resolve_mesh(4, 4)
    with pytest.raises(ValueError, match="lists 3 stages"):
        PipelineConfig(pipeline_parallel_size=2, stages_per_rank=2, partition=[1, 1, 1]).resolve_mesh(2, 2)


def test_layout_resolution():
    mesh = MeshShape(2, 1)
    layout = PipelineConfig().resolve_plan(mesh, [10] * 6)
    assert (layout.stages_per_rank, layout.num_microbatches, layout.num_stages) == (2, 2, 4)
    assert PipelineConfig().resolve_plan(mesh, [10] * 3).stages_per_rank == 1
    layout = PipelineConfig(partition=[1, 2, 2, 1]).resolve_plan(mesh, [10] * 6)
    assert layout.stage_layer_counts == (1, 2, 2, 1) and layout.stages_per_rank == 2
    with pytest.raises(ValueError, match="returns 3 layers, fewer than the 4 stages"):
        PipelineConfig(stages_per_rank=2).resolve_plan(mesh, [1, 2, 3])
    with pytest.raises(ValueError, match="must add up to 6"):
        PipelineConfig(partition=[1, 1, 1, 1]).resolve_plan(mesh, [10] * 6)


def test_time_partition_balances_the_given_times():
    mesh = MeshShape(pipeline_parallel_size=2, data_parallel_size=1)
    config = PipelineConfig(partition="time", stages_per_rank=1)
    # equal parameters, one slow layer at the end: time puts it alone
    assert config.resolve_plan(mesh, [10] * 4, [0.001, 0.001, 0.001, 0.003]).stage_layer_counts == (3, 1)
    with pytest.raises(ValueError, match="one measured time per layer"):
        config.resolve_plan(mesh, [10] * 4)
